"""vcpo.step on a model sharded by FSDP2 (torch.distributed.fsdp.fully_shard) over 2 gloo processes on the CPU,
each holding half of the batch: the same per-sequence gradient norms and the same steps as one process with the
unsharded model and the whole batch (tied and untied Llama, Qwen2; book-keeping, the two-pass path and
micro-batches; grad_clip on), all computed in one launch of the two ranks."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import vcpo
from support.ranks import on_ranks
from support.tiny_models import TINY_SHAPE, tiny_llama
from vcpo.grad_norms import PerSequenceGradients
from vcpo.step import token_logp

transformers = pytest.importorskip("transformers")

WORLD = 2
MODELS = ("llama", "llama-tied", "qwen2")
# assembly, micro_batch_size: book-keeping assembled then reduce-scattered; FSDP2's own backward; micro-batches
# (tied Llama only), whose groups span the ranks: a second forward and backward per micro-batch through FSDP2
STEPS = {"bookkeeping": ("bookkeeping", None), "two_pass": ("two_pass", None), "micro": ("auto", 2)}
CASES = [(n, s) for n in MODELS for s in STEPS if n == "llama-tied" or s != "micro"]
MIXED = ("bookkeeping", "two_pass")  # the steps run in bf16-mixed too
LENGTHS = [8, 6, 7, 5, 8, 8, 4, 7]  # rank 0 holds rows 0-3, rank 1 rows 4-7: unequal token counts


def _model(name):
    """The tiny Llama (tied or not) in float32, or a Qwen2 of its shape; 16 positions."""
    if name != "qwen2":
        return tiny_llama(tied=name == "llama-tied", dtype=torch.float32, max_position_embeddings=16)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**TINY_SHAPE, "max_position_embeddings": 16}, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return transformers.Qwen2ForCausalLM(config).eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    b, t = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(1, 40, (b, t), generator=g)
    attention = (torch.arange(t) < torch.tensor(LENGTHS)[:, None]).long()
    loss_mask = attention * (torch.arange(t) >= 2)
    behavior = -torch.rand(b, t, generator=g) * 3 - 2
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 1.0, 0.0, 2.0])
    return vcpo.RolloutBatch(ids, attention, loss_mask, behavior, rewards,
                             group_index=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), num_groups=4)


def _rows(batch, rows):
    cut = lambda x: x[rows]  # noqa: E731
    return vcpo.RolloutBatch(cut(batch.input_ids), cut(batch.attention_mask), cut(batch.loss_mask),
                             cut(batch.behavior_logp), batch.rewards[rows], batch.group_index[rows],
                             num_groups=batch.num_groups)


def _norms(model, batch):
    """Per-sequence squared norms of sum_t log pi(y_t) over the counted tokens."""
    ids = batch.input_ids
    with PerSequenceGradients(model, num_seqs=ids.shape[0], seq_len=ids.shape[1]) as psg:
        logp = token_logp(model(input_ids=ids, attention_mask=batch.attention_mask).logits[:, :-1], ids[:, 1:])
        psg.backward(torch.where(batch.loss_mask[:, 1:] != 0, logp, 0).sum())
    return psg.sq_norms()


def _steps(model, batch, step, group=None, gather=lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()},
           autocast=None):
    """Two ESS-scaled AdamW steps (the second one uses the optimizer state of the first): metrics and parameters
    after each."""
    assembly, micro = STEPS[step]
    config = vcpo.VCPOConfig(grad_clip=0.05, assembly=assembly, micro_batch_size=micro, autocast=autocast)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    out = []
    for _ in range(2):
        metrics = vcpo.step(model, opt, batch, config, process_group=group)
        out.append((metrics, gather(model)))
    return out


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _trainer_shard(model, compute_dtype):
    """The trainer's own sharding (vcpo.trainer.placement.fsdp.shard), with its mixed precision."""
    from vcpo.trainer.placement.fsdp import shard

    shard(model, SimpleNamespace(device=torch.device("cpu"), world=WORLD), compute_dtype)
    model.seen_dtypes = set()  # the dtype of a layer's weight as its forward sees it: the gathered unit's
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda module, args: model.seen_dtypes.add(module.weight.dtype))
    return model


def _optimizer_round_trip(mesh, local, ranks):
    """The sharded AdamW state after one step, gathered in torch.optim's layout (what a checkpoint holds), then
    loaded into a fresh sharded optimizer and gathered again: (first gather, second gather), rank 0's."""
    from vcpo.trainer.placement.fsdp import full_optimizer_state, load_full_optimizer_state

    model = _shard(_model("llama-tied"), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    vcpo.step(model, opt, local, vcpo.VCPOConfig(grad_clip=0.05), process_group=dist.group.WORLD)
    saved = full_optimizer_state(model, opt, ranks)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    fresh.zero_grad(set_to_none=True)  # as a resumed run's Policy loads it: before any gradient
    load_full_optimizer_state(model, fresh, saved, ranks)
    return saved, full_optimizer_state(model, fresh, ranks)


def _on_rank(rank):
    """Everything this file computes on the two ranks, in one launch."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    local = _rows(_batch(), slice(4 * rank, 4 * rank + 4))
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    results = {}
    for name in MODELS:
        results[name, "norms"] = _norms(_shard(_model(name), mesh), local)
        for step in (s for n, s in CASES if n == name):
            results[name, step] = _steps(_shard(_model(name), mesh), local, step, dist.group.WORLD,
                                         gather=lambda m: get_model_state_dict(m, options=full))
    for step in MIXED:  # bf16-mixed: FSDP2's bf16 units under the step's autocast
        model = _trainer_shard(_model("llama-tied"), "bfloat16")
        results["mixed", step] = _steps(model, local, step, dist.group.WORLD,
                                        gather=lambda m: get_model_state_dict(m, options=full), autocast="bfloat16")
        results["mixed dtypes", step] = model.seen_dtypes
    results["optimizer"] = _optimizer_round_trip(mesh, local, SimpleNamespace(main=rank == 0))
    errors = []
    model = _shard(_model("llama"), mesh)
    for config, group in ((vcpo.VCPOConfig(), None), (vcpo.VCPOConfig(fused_lm_head=True), dist.group.WORLD)):
        try:
            vcpo.step(model, torch.optim.SGD(model.parameters(), lr=0.1), local, config, process_group=group)
        except ValueError as err:
            errors.append(str(err))
    results["errors"] = errors
    return results


@pytest.fixture(scope="module")
def ranks():
    return on_ranks(_on_rank, world=WORLD)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_sharded_per_sequence_norms_equal_the_unsharded_ones(ranks, name):
    want = _norms(_model(name), _batch()).double()
    got = torch.cat([r[name, "norms"] for r in ranks]).double()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name, step", CASES)
def test_sharded_step_equals_the_one_process_step(ranks, name, step):
    whole = _steps(_model(name), _batch(), step)
    assert ranks[1][name, step][0][1] == {}  # the full state dict (cpu_offload) is rank 0's only
    for i, (want_metrics, want) in enumerate(whole):
        metrics, params = ranks[0][name, step][i]
        assert ranks[1][name, step][i][0] == metrics  # every rank reports the same whole-batch metrics
        assert want_metrics["grad_norm"] > 0.05  # clipping is on
        for key in ("ess_ratio", "lr_scale", "grad_norm", "grad_sq_norm_mean", "baseline_mean", "loss"):
            assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5), key
        assert params.keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(params[key], value, rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("step", MIXED)
def test_a_bf16_mixed_sharded_step_equals_the_float64_step_to_bf16_accuracy(ranks, step):
    """FSDP2's MixedPrecisionPolicy (bf16 units, fp32 reductions) with the step's autocast, the exact norms over the
    bf16 units: the two steps of one float64 process within bf16's accuracy; the shards stay fp32."""
    whole = _steps(_model("llama-tied").double(), _batch(), step)
    before = _model("llama-tied").state_dict()
    for i, (want_metrics, want) in enumerate(whole):
        metrics, params = ranks[0]["mixed", step][i]
        for key in ("ess_ratio", "lr_scale", "grad_norm", "grad_sq_norm_mean", "loss"):
            assert metrics[key] == pytest.approx(want_metrics[key], rel=2e-2), key
        assert all(params[key].dtype == torch.float32 for key in want)
        assert ranks[0]["mixed dtypes", step] == {torch.bfloat16}  # the units are gathered in bf16
        # AdamW's m / sqrt(v) turns bf16 noise on a tiny gradient into a whole step, so the update is compared as a
        # whole (measured: 10% off float64 here, 6% for one process's autocast alone; fp32: 1e-5)
        moved, want_moved = (torch.cat([(p[k].double() - before[k].double()).reshape(-1) for k in want])
                             for p in (params, want))
        assert torch.linalg.vector_norm(moved - want_moved) <= 0.15 * torch.linalg.vector_norm(want_moved)


@pytest.mark.slow
def test_the_sharded_optimizer_state_round_trips_in_torch_optims_layout(ranks):
    """What a checkpoint holds is a plain AdamW state dict, the one-process optimizer's after the same step, and
    loading it into a sharded optimizer gives it back."""
    saved, again = ranks[0]["optimizer"]
    assert ranks[1]["optimizer"] == (None, None)
    model = _model("llama-tied")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    vcpo.step(model, opt, _batch(), vcpo.VCPOConfig(grad_clip=0.05))
    want = opt.state_dict()
    for got in (saved, again):
        # (betas come back as a list: the same hyperparameters)
        assert [{**g, "betas": tuple(g["betas"])} for g in got["param_groups"]] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for i, state in want["state"].items():
            for key, value in state.items():
                torch.testing.assert_close(got["state"][i][key], value, rtol=1e-4, atol=1e-9, msg=f"{i} {key}")


@pytest.mark.slow
def test_a_sharded_step_refuses_what_it_cannot_do(ranks):
    no_group, fused = ranks[0]["errors"]
    assert "needs process_group" in no_group
    assert "fused_lm_head=True" in fused


@pytest.mark.parametrize("settings, message", [
    ({"fsdp": True}, "it needs trainer_ranks >= 2"),
    ({"fsdp": True, "trainer_ranks": 2, "vcpo": {"fused_lm_head": True}}, "use fused_lm_head false"),
    ({"fsdp": "yes", "trainer_ranks": 2}, "fsdp must be true or false"),
])
def test_fsdp_settings_are_checked(settings, message):
    from vcpo.trainer.config import make_config

    with pytest.raises(ValueError, match=message):
        make_config(**settings).validate()
