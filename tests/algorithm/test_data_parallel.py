"""Two gloo processes on the CPU (one launch for the file), each holding half of a batch whose prompt groups span
both ranks: both get the same ESS ratio, lr scale and baselines, equal to one process on the whole batch; M2PO's
mask is the whole batch's; and vcpo.step on the two ranks takes one process's whole-batch step for every
loss_agg_mode and with M2PO's mask, with and without micro-batches."""

import functools

import pytest
import torch
import torch.distributed as dist

import vcpo
from support.batches import random_batch
from support.ranks import on_ranks
from vcpo.step import token_logp

WORLD = 2


def _rank_slice(batch, rank, b_local, t):
    rows = slice(rank * b_local, (rank + 1) * b_local)
    return dict(logp=batch.logp[rows], behavior_logp=batch.behavior_logp[rows], mask=batch.mask[rows],
                rewards=batch.rewards[rows], group_index=batch.group_index[rows],
                grad_sq_norm=batch.grad_sq_norm[rows])


def _loss_on_rank(rank, backend, options):
    batch = random_batch(21, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3)
    local = _rank_slice(batch, rank, 4, 12)
    logp, mu = local.pop("logp"), local.pop("behavior_logp")
    out = vcpo.policy_loss(logp, mu, num_groups=batch.num_groups, config=vcpo.VCPOConfig(backend=backend, **options),
                           process_group=dist.group.WORLD, **local)
    return {k: getattr(out, k) for k in ("ess", "ess_ratio", "lr_scale", "baseline", "opob_max_share", "advantages")}


def _on_rank(rank):
    """Everything this file computes on two ranks, in one launch: the loss for every case of LOSS_CASES, the step of
    _step_setup, and the steps of every DP case, mode and micro-batch size."""
    rows = slice(4 * rank, 4 * rank + 4)
    return {"loss": [_loss_on_rank(rank, backend, options) for backend, options in LOSS_CASES],
            "m2po": {backend: _m2po_loss_on_rank(rank, backend) for backend in M2PO_BACKENDS},
            "m2po_step": {micro: _dp_step("unequal", "token-mean", micro, rows, dist.group.WORLD, options=M2PO)
                          for micro in DP_MICRO},
            "step": _step_on_rank(rank),
            "dp": {(case, mode, micro): _dp_step(case, mode, micro, rows, dist.group.WORLD)
                   for case in DP_CASES for mode in MODES for micro in DP_MICRO}}


@pytest.fixture(scope="module")
def ranks():
    return on_ranks(_on_rank, world=WORLD)


LOSS_CASES = [
    ("cpu", {}),
    ("torch", {}),
    ("cpu", dict(advantage="grpo", ess_on_corrected=True, is_threshold=1.5)),
    ("cpu", dict(opob_scope="batch", lr_rule="linear", ess_base_ratio=0.55)),
    ("cpu", dict(opob_leave_one_out=True)),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(LOSS_CASES)), ids=[f"{b}-{o}" for b, o in LOSS_CASES])
def test_two_ranks_agree_with_one_process(ranks, case):
    backend, options = LOSS_CASES[case]
    ranks = [r["loss"][case] for r in ranks]

    batch = random_batch(21, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3)
    whole = vcpo.policy_loss(batch.logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                             group_index=batch.group_index, num_groups=batch.num_groups,
                             grad_sq_norm=batch.grad_sq_norm, config=vcpo.VCPOConfig(backend=backend, **options))
    for key in ("ess", "ess_ratio", "lr_scale", "baseline", "opob_max_share"):
        torch.testing.assert_close(ranks[0][key], ranks[1][key], rtol=0, atol=0)  # identical on every rank
        torch.testing.assert_close(ranks[0][key], getattr(whole, key), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), whole.advantages, rtol=1e-5, atol=1e-6)
    assert 0 < ranks[0]["lr_scale"].item() < 1
    if whole.opob_max_share.item() > 0:  # the OPOB cases: a share the ranks form from every rank's sequences
        assert 1 / 3 < ranks[0]["opob_max_share"].item() <= 1  # groups of up to 3: some share is above 1/3


def test_process_group_without_distributed_is_an_error():
    batch = random_batch(22, "padded")
    with pytest.raises(ValueError, match="not initialised"):
        vcpo.policy_loss(batch.logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                         process_group=object())


def _step_on_rank(rank):
    model, batch = _step_setup()
    rows = slice(rank * 3, (rank + 1) * 3)
    local = vcpo.RolloutBatch(batch.input_ids[rows], batch.attention_mask[rows], batch.loss_mask[rows],
                              batch.behavior_logp[rows], batch.rewards[rows], batch.group_index[rows],
                              num_groups=batch.num_groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics = vcpo.step(model, opt, local, vcpo.VCPOConfig(grad_clip=0.05), process_group=dist.group.WORLD)
    return {"params": [p.detach() for p in model.parameters()], "metrics": metrics}


def _step_setup():
    pytest.importorskip("transformers")
    from support.tiny_models import tiny_llama

    model = tiny_llama(num_hidden_layers=1, max_position_embeddings=16)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (6, 8), generator=g)
    attention = torch.ones(6, 8, dtype=torch.long)
    loss_mask = (torch.arange(8) >= 2).long().expand(6, 8)
    behavior = -torch.rand(6, 8, generator=g, dtype=torch.float64) * 3 - 2
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 1.0]),
                              group_index=torch.tensor([0, 1, 2, 0, 1, 2]), num_groups=3)
    return model, batch


@pytest.mark.slow
def test_two_rank_step_equals_one_process_step(ranks):
    """Groups span the ranks; each rank holds 3 of the 6 sequences (all of the same length, so the mean of
    the ranks' per-sequence means is the whole batch's mean): both ranks take the one-process step."""
    ranks = [r["step"] for r in ranks]
    model, batch = _step_setup()
    metrics = vcpo.step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, vcpo.VCPOConfig(grad_clip=0.05))
    for key in ("ess_ratio", "lr_scale", "grad_norm"):
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key]
        assert ranks[0]["metrics"][key] == pytest.approx(metrics[key], rel=1e-9)
    for a, b, p in zip(ranks[0]["params"], ranks[1]["params"], model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, p.detach(), rtol=1e-9, atol=1e-12)


def test_distributed_argument_errors(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        batch = random_batch(23, "padded")
        with pytest.raises(ValueError, match="num_groups"):
            vcpo.policy_loss(batch.logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                             group_index=batch.group_index, process_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


# -- vcpo.step on 2 ranks against one process: every loss_agg_mode, ranks that hold different token and
# sequence counts (issue 14's defect: each rank normalised by its own counts) --------------------------------

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# Rows 0-3 go to rank 0, rows 4-7 to rank 1. unequal: whole groups per rank of sizes 2, 1, 1 | 1, 2, 1, and
# unequal token counts; empty: rank 1 holds only sequences without a counted token; spanning: groups cut across
# the ranks. Micro-batches of at most 2 sequences: 2 on rank 0 and 3 on rank 1, or 3 and 2 (spanning).
DP_CASES = {
    "unequal": ([0, 0, 1, 2, 3, 4, 4, 5], [10, 7, 9, 4, 8, 5, 6, 8], [3] * 8),
    "empty": ([0, 0, 1, 2, 3, 4, 4, 5], [10, 7, 9, 4, 8, 5, 6, 8], [3, 3, 3, 3, 8, 5, 6, 8]),
    "spanning": ([0, 1, 1, 2, 0, 2, 3, 3], [10, 7, 9, 4, 8, 5, 6, 8], [3, 2, 4, 3, 3, 3, 2, 5]),
}
DP_MICRO = (None, 2)


def _dp_setup(case):
    """A tiny float64 Llama and 8 rollouts; `prompt` tokens of each row do not count (a row whose prompt fills it
    counts none); rank 1's rows are padded to their own longest, shorter than rank 0's."""
    pytest.importorskip("transformers")
    from support.tiny_models import tiny_llama

    groups, lengths, prompt = DP_CASES[case]
    # sdpa: the eager path's softmax runs in float32, so rows padded to other widths (the ranks', the micro-batches')
    # differed from the whole batch by float32 rounding (2e-6 relative with transformers 5.19), not float64's.
    model = tiny_llama(num_hidden_layers=1, max_position_embeddings=16, attention="sdpa")
    g = torch.Generator().manual_seed(2)
    b, t = 8, 10
    ids = torch.randint(1, 40, (b, t), generator=g)
    cols = torch.arange(t)
    attention = (cols < torch.tensor(lengths)[:, None]).long()
    loss_mask = attention * (cols >= torch.tensor(prompt)[:, None])
    with torch.no_grad():
        current = torch.zeros(b, t, dtype=torch.float64)
        current[:, 1:] = token_logp(model(input_ids=ids, attention_mask=attention).logits[:, :-1], ids[:, 1:])
    behavior = current + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64)
    rewards = torch.rand(b, generator=g, dtype=torch.float64).round(decimals=1)
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, behavior, rewards, group_index=torch.tensor(groups),
                              num_groups=max(groups) + 1)
    return model, batch


def _rows(batch, rows):
    """The batch's rows, padded to their own longest sequence."""
    width = int(batch.attention_mask[rows].sum(1).max())
    cut = lambda x: x[rows, :width]  # noqa: E731
    return vcpo.RolloutBatch(cut(batch.input_ids), cut(batch.attention_mask), cut(batch.loss_mask),
                             cut(batch.behavior_logp), batch.rewards[rows], batch.group_index[rows],
                             num_groups=batch.num_groups)


def _dp_step(case, mode, micro, rows=None, group=None, assembly="auto", options=None):
    model, batch = _dp_setup(case)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # No clipping: a wrong gradient scale would be hidden by clipping to the same norm.
    config = vcpo.VCPOConfig(loss_agg_mode=mode, grad_clip=None, micro_batch_size=micro, assembly=assembly,
                             **(options or {}))
    metrics = vcpo.step(model, opt, batch if rows is None else _rows(batch, rows), config, process_group=group)
    return {"update": [p.detach() - q for p, q in zip(model.parameters(), before)], "metrics": metrics}


@functools.lru_cache(maxsize=None)
def _dp_whole(case, mode, assembly):
    return _dp_step(case, mode, None, assembly=assembly)


@pytest.mark.slow
@pytest.mark.parametrize("micro", DP_MICRO)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(DP_CASES))
def test_two_rank_step_equals_one_process_for_every_aggregation(ranks, case, mode, micro):
    # One process, the whole batch, no micro-batches. Groups across ranks: the micro-batches' coefficients wait
    # for every norm pass, then each micro-batch's gradient comes from a second backward; compared with the
    # whole batch's second backward, as book-keeping agrees with it only to float32 rounding (Llama's RMSNorm
    # computes in float32 in a float64 model).
    whole = _dp_whole(case, mode, "two_pass" if case == "spanning" and micro else "auto")
    ranks = [r["dp"][(case, mode, micro)] for r in ranks]
    scale = max(u.abs().max() for u in whole["update"])
    for a, b, want in zip(ranks[0]["update"], ranks[1]["update"], whole["update"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, want, rtol=1e-8, atol=1e-10 * scale)
    assert ranks[0]["metrics"] == ranks[1]["metrics"]  # every rank reports the same, whole-batch metrics
    for key, value in whole["metrics"].items():
        assert ranks[0]["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


# M2PO's mask: an order statistic of every rank's tokens. Rank 1's sequences are shorter, so the ranks hold
# different numbers of counted tokens (the all_gather pads them).
M2PO_BOUND = 0.1
M2PO = dict(rejection=(("batch_m2", None, M2PO_BOUND),), is_level="token")
M2PO_BACKENDS = ("cpu", "torch")


def _m2po_batch():
    batch = random_batch(24, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3)
    batch.mask[4:, 8:] = False
    return batch


def _m2po_loss_on_rank(rank, backend):
    batch = _m2po_batch()
    local = _rank_slice(batch, rank, 4, 12)
    logp = local.pop("logp").requires_grad_()
    out = vcpo.policy_loss(logp, local.pop("behavior_logp"), num_groups=batch.num_groups, config=vcpo.VCPOConfig(
        backend=backend, **M2PO), process_group=dist.group.WORLD, **local)
    (grad,) = torch.autograd.grad(out.loss / WORLD, logp)
    return {"loss": out.loss.detach(), "grad": grad, "rejected": out.rejected_fraction * out.num_tokens}


@pytest.mark.slow
@pytest.mark.parametrize("backend", M2PO_BACKENDS)
def test_m2po_mask_over_two_ranks_is_the_whole_batch_mask(ranks, backend):
    """Each rank's loss over the world size sums to one process's loss on the whole batch, its gradient is that
    loss's gradient on the rank's rows, and the ranks reject the whole batch's tokens between them; a rank's own
    threshold would reject others (checked: the whole-batch threshold differs from each half's)."""
    ranks = [r["m2po"][backend] for r in ranks]
    batch = _m2po_batch()
    logp = batch.logp.clone().requires_grad_()
    whole = vcpo.policy_loss(logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                             group_index=batch.group_index, num_groups=batch.num_groups,
                             grad_sq_norm=batch.grad_sq_norm, config=vcpo.VCPOConfig(backend=backend, **M2PO))
    (grad,) = torch.autograd.grad(whole.loss, logp)
    torch.testing.assert_close(sum(r["loss"] for r in ranks) / WORLD, whole.loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks]), grad, rtol=1e-5, atol=1e-7)
    rejected = sum(float(r["rejected"]) for r in ranks)
    assert rejected == pytest.approx(float(whole.rejected_fraction * whole.num_tokens)) and rejected > 0
    delta = (batch.logp - batch.behavior_logp).double()
    square = torch.where(batch.mask, delta * delta, torch.nan)
    from vcpo_kernels.reference.policy_loss import second_moment_threshold
    halves = [second_moment_threshold(square[rows], batch.mask[rows], M2PO_BOUND) for rows in (slice(0, 4), slice(4, 8))]
    assert all(h != second_moment_threshold(square, batch.mask, M2PO_BOUND) for h in halves)


@pytest.mark.slow
@pytest.mark.parametrize("micro", DP_MICRO)
def test_m2po_step_on_two_ranks_equals_one_process(ranks, micro):
    """vcpo.step with M2PO's mask on two ranks of unequal token counts, whole and in micro-batches: the
    one-process step."""
    whole = _dp_step("unequal", "token-mean", None, options=M2PO)
    ranks = [r["m2po_step"][micro] for r in ranks]
    scale = max(u.abs().max() for u in whole["update"])
    for a, b, want in zip(ranks[0]["update"], ranks[1]["update"], whole["update"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, want, rtol=1e-8, atol=1e-10 * scale)
    assert whole["metrics"]["rejected_fraction"] > 0
    for key, value in whole["metrics"].items():
        assert ranks[0]["metrics"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
