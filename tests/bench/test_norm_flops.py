"""bench/norm_flops.py: its multiply-adds per token against torch's FLOP counter on real steps of a tiny Llama
(tied and untied, in shapes where both norm forms are picked): a plain GRPO step counts 2 B T plain, and a VCPO
step with book-keeping counts 2 B T norms more."""

import importlib.util
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vcpo
from support.tiny_models import tiny_llama


def _bench_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), "..", "..", "bench",
                                                                     f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


norm_flops = _bench_module("norm_flops")
GRPO = _bench_module("common").GRPO  # the plain step's options, as the benches run it


def step_flops(model, batch, options) -> int:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with FlopCounterMode(display=False) as counter:
        vcpo.step(model, optimizer, batch, vcpo.VCPOConfig(**options))
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
def test_counts_equal_the_flop_counter_of_real_steps(tied):
    b, t = 4, 24  # t (d_in + d_out) against d_in d_out: ghost for the MLP's 32 x 96, materialised for 32 x 32
    model = tiny_llama(tied=tied, hidden_size=32, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=64, max_position_embeddings=t)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 64, (b, t), generator=g)
    ones = torch.ones(b, t, dtype=torch.long)
    batch = vcpo.RolloutBatch(ids, ones, ones * (torch.arange(t) >= 4), -torch.rand(b, t, generator=g) - 3,
                              torch.tensor([1.0, 0.0, 0.0, 1.0]), group_index=torch.tensor([0, 0, 1, 1]), num_groups=2)
    count = norm_flops.count(model, model.config, t)
    assert count["ghost"] > 0 and count["materialised"] > 0
    plain = step_flops(model, batch, GRPO)
    ours = step_flops(model, batch, dict(assembly="bookkeeping"))
    assert plain == 2 * b * t * count["plain"]
    assert ours - plain == 2 * b * t * count["norms"]
