"""A step whose loss, gradient norm or lr scale is not finite is skipped whole: one response token with a behaviour
log-prob of -inf or NaN made the loss NaN, and AdamW's step at lr 0 still added 0 x NaN to every weight and moved
its moments and step count (issue 24). Now the weights and the optimizer's state stay bitwise as they were, the
gradients are cleared, the metrics say so, and the next finite step is the one it would have been without the bad
batch. On two data-parallel ranks, a bad token on one rank makes both skip."""

import copy
import math

import pytest
import torch
import torch.distributed as dist

import vcpo
from support.ranks import on_ranks
from support.tiny_models import rollout_batch, tiny_llama
from vcpo.step import SKIP_REASONS, skip_names, skip_reason

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.1),
}


def bits(t):
    """A tensor's bits, so that -0.0 != 0.0 and NaN == NaN of the same payload."""
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]).clone()


def snapshot(model, optimizer):
    """Every parameter's bits and the optimizer's state (moments, momentum buffers, step counts), copied."""
    state = optimizer.state_dict()
    tensors = {f"state.{i}.{k}": bits(v) for i, s in state["state"].items() for k, v in s.items()
               if torch.is_tensor(v)}
    scalars = {f"state.{i}.{k}": v for i, s in state["state"].items() for k, v in s.items() if not torch.is_tensor(v)}
    return ({n: bits(p) for n, p in model.named_parameters()}, tensors, scalars,
            copy.deepcopy(state["param_groups"]))


def assert_same(a, b):
    (pa, ta, sa, ga), (pb, tb, sb, gb) = a, b
    assert pa.keys() == pb.keys() and ta.keys() == tb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name
    assert sa == sb and ga == gb


def batch_of(model, dtype, seed=1):
    b = rollout_batch(model, seed=seed)
    b.behavior_logp = b.behavior_logp.to(dtype)
    b.rewards = b.rewards.to(dtype)
    return b


def poisoned(batch, value):
    """The batch with one response token's behaviour log-prob set to `value` (row 0, a counted position)."""
    bad = copy.deepcopy(batch)
    row, col = 0, int(batch.loss_mask[0].nonzero()[1])
    bad.behavior_logp[row, col] = value
    return bad


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("value", [-math.inf, math.nan], ids=["-inf", "nan"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_nonfinite_behaviour_logprob_skips_the_step_whole(dtype, value, optimizer):
    config = vcpo.VCPOConfig(grad_norms="length")  # the norms' method does not matter here (the next test: exact)
    model = tiny_llama().to(dtype)
    opt = OPTIMIZERS[optimizer](model.parameters())
    first = vcpo.step(model, opt, batch_of(model, dtype, seed=1), config)  # the optimizer now has state
    assert first["skipped"] == 0.0 and first["skip_reason"] == 0.0
    twin = copy.deepcopy(model)
    twin_opt = OPTIMIZERS[optimizer](twin.parameters())
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may keep the tensors it is given
    before = snapshot(model, opt)
    good = batch_of(model, dtype, seed=2)

    m = vcpo.step(model, opt, poisoned(good, value), config)

    assert m["skipped"] == 1.0 and int(m["skip_reason"]) & 1  # the loss is NaN
    assert not math.isfinite(m["loss"])
    assert_same(snapshot(model, opt), before)  # weights, moments, momentum buffers, step counts: bitwise
    assert all(p.grad is None for p in model.parameters())
    # the next finite step is the step the model would have taken without the bad batch
    after = vcpo.step(model, opt, good, config)
    reference = vcpo.step(twin, twin_opt, good, config)
    assert after["skipped"] == 0.0 and after == reference
    assert_same(snapshot(model, opt), snapshot(twin, twin_opt))
    assert any(not torch.equal(bits(p), before[0][n]) for n, p in model.named_parameters())  # it did step


def test_exact_norms_and_micro_batches_skip_too():
    """The default config (exact per-sequence norms, book-keeping), in micro-batches of two prompt groups' worth."""
    config = vcpo.VCPOConfig(micro_batch_size=2)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    vcpo.step(model, opt, batch_of(model, torch.float64, seed=1), config)
    before = snapshot(model, opt)
    m = vcpo.step(model, opt, poisoned(batch_of(model, torch.float64, seed=2), math.nan), config)
    assert m["skipped"] == 1.0 and int(m["skip_reason"]) & 1
    assert_same(snapshot(model, opt), before)
    assert all(p.grad is None for p in model.parameters())


def test_a_fresh_optimizer_keeps_no_state_after_a_skipped_step():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = {n: bits(p) for n, p in model.named_parameters()}
    m = vcpo.step(model, opt, poisoned(batch_of(model, torch.float64), -math.inf))
    assert m["skipped"] == 1.0 and opt.state_dict()["state"] == {}
    assert all(torch.equal(bits(p), weights[n]) for n, p in model.named_parameters())


def test_skip_reason_bits():
    nan, inf = math.nan, math.inf
    assert skip_reason(loss=1.0, grad_norm=2.0, lr_scale=0.5, ess_ratio=0.3) == 0
    assert skip_reason(loss=nan) == 1 and skip_reason(loss=-inf) == 1
    assert skip_reason(grad_norm=inf) == 2 and skip_reason(grad_norm=nan) == 2
    assert skip_reason(lr_scale=nan) == 4 and skip_reason(lr_scale=inf) == 4
    assert skip_reason(lr_scale=0.0, ess_ratio=nan) == 4  # the loss's "skip": a NaN ESS gives lr scale 0
    assert skip_reason(lr_scale=0.0, ess_ratio=0.0) == 0  # no valid sequence: a zero step, not a fault
    assert skip_reason(loss=nan, grad_norm=nan, lr_scale=0.0, ess_ratio=nan) == 7
    assert skip_names(7) == "loss, grad_norm, lr_scale" and skip_names(2.0) == "grad_norm" and skip_names(0) == ""
    assert list(SKIP_REASONS) == [1, 2, 4]


# -- two data-parallel ranks (one launch) ------------------------------------------------------------------------------
def _dp_rank(rank):
    """Rank r holds sequences 3r..3r+2 of the batch (a group spans the ranks); one response token of rank 0's is -inf,
    rank 1's sequences are all finite."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    batch = batch_of(model, torch.float64)
    rows = slice(3 * rank, 3 * rank + 3)

    def share(b):
        return vcpo.RolloutBatch(b.input_ids[rows], b.attention_mask[rows], b.loss_mask[rows], b.behavior_logp[rows],
                                 b.rewards[rows], group_index=b.group_index[rows], num_groups=b.num_groups)

    group = dist.group.WORLD
    first = vcpo.step(model, opt, share(batch), process_group=group)
    before = snapshot(model, opt)
    bad = poisoned(batch, -math.inf)  # row 0: rank 0's
    m = vcpo.step(model, opt, share(bad), process_group=group)
    return {"first": first, "metrics": m, "unchanged": _same(snapshot(model, opt), before),
            "grads": [p.grad for p in model.parameters()]}


def _same(a, b):
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


@pytest.mark.slow
def test_data_parallel_ranks_skip_together():
    ranks = on_ranks(_dp_rank, world=2)
    for r in ranks:
        assert r["first"]["skipped"] == 0.0
        assert r["metrics"]["skipped"] == 1.0 and int(r["metrics"]["skip_reason"]) & 1
        assert r["unchanged"] and all(g is None for g in r["grads"])
    assert ranks[0]["metrics"]["skip_reason"] == ranks[1]["metrics"]["skip_reason"]


def test_the_trainer_stops_after_max_skipped_steps_in_a_row():
    """vcpo train's count (vcpo/trainer/run.py): a warning per skipped step, then at the limit a checkpoint (once, not
    a second one of the same step) and NonFiniteError naming the steps, batches and reasons (the slow tier runs it
    in a whole run: tests/trainer/test_train_end_to_end.py)."""
    from vcpo.trainer.errors import NonFiniteError
    from vcpo.trainer.run import _skipped_step

    logged, checkpoints = [], []
    rows = [{"step": s, "batch": s - 1, "skip_reason": float(r)} for s, r in ((5, 1), (6, 4), (7, 3))]
    for n in (1, 2):
        _skipped_step(rows[:n], 3, lambda **kw: checkpoints.append(kw), "runs/x", logged.append)
    assert checkpoints == [] and len(logged) == 2
    assert "step 6 skipped (batch 5): not finite: lr_scale; the weights stay those of step 4 (2 skipped" in logged[1]
    with pytest.raises(NonFiniteError, match=r"3 steps in a row were skipped \(steps 5-7, batches 4-6: not finite: "
                                             r"loss, grad_norm, lr_scale\).*step 7 with the weights of step 4"):
        _skipped_step(rows, 3, lambda **kw: checkpoints.append(kw), "runs/x", logged.append)
    assert checkpoints == [{"again": False}]
