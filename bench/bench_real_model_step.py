"""The real-model update step as a pytest-benchmark case, for the kernel suite's history (`--benchmark-save`,
`--benchmark-compare` across commits): one `vcpo.step` on SmolLM2-135M-Instruct, 16 x 256 in groups of 4 (the
model and batch of bench_real_model.py), GRPO against VCPO at the whole batch and at micro-batches of 8 and 4.
bench/conftest.py prints each VCPO/GRPO ratio after pytest-benchmark's tables. The cases run one after another,
so a slow spell of a shared machine lands on one of them: for the ratio itself bench_real_model.py, which
interleaves them, is the measurement of record.

    .venv/bin/python -m pytest bench/bench_real_model_step.py --benchmark-only                 # about 10 minutes
    .venv/bin/python -m pytest bench/bench_real_model_step.py --benchmark-only -k m4            # one pair
"""

import pytest
import torch

import vcpo
from bench_real_model import CASES, build

ROUNDS = 3  # each after one warm-up step (AdamW's state, the first step's one-off work)
SIZES = {"whole": ("grpo", "vcpo"), "m8": ("grpo m=8", "vcpo m=8"), "m4": ("grpo m=4", "vcpo m=4")}  # -k ids


@pytest.fixture(scope="module")
def model_and_batch():
    return build(False)


@pytest.mark.parametrize("rule", ["grpo", "vcpo"])
@pytest.mark.parametrize("size", [pytest.param(s, id=s, marks=pytest.mark.benchmark(group=f"smollm2 {s}"))
                                  for s in SIZES])
def test_real_model_step(benchmark, model_and_batch, size, rule):
    model, batch = model_and_batch
    options, micro, _ = CASES[SIZES[size][rule == "vcpo"]]
    config = vcpo.VCPOConfig(micro_batch_size=micro, **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    benchmark.extra_info.update(case=rule, layout=f"smollm2 {size}")
    benchmark.pedantic(vcpo.step, args=(model, optimizer, batch, config), rounds=ROUNDS, warmup_rounds=1)
