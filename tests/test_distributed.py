"""Two gloo processes on the CPU, each holding half of a batch whose prompt groups span both ranks: both get
the same ESS ratio, lr scale and baselines, equal to one process on the whole batch."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import vcpo
from batches import random_batch

WORLD = 2


def _rank_slice(batch, rank, b_local, t):
    rows = slice(rank * b_local, (rank + 1) * b_local)
    return dict(logp=batch.logp[rows], behavior_logp=batch.behavior_logp[rows], mask=batch.mask[rows],
                rewards=batch.rewards[rows], group_index=batch.group_index[rows],
                grad_sq_norm=batch.grad_sq_norm[rows])


def _worker(rank, init_file, out_dir, backend, options):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        batch = random_batch(21, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3)
        local = _rank_slice(batch, rank, 4, 12)
        logp, mu = local.pop("logp"), local.pop("behavior_logp")
        out = vcpo.policy_loss(logp, mu, num_groups=batch.num_groups, config=vcpo.VCPOConfig(backend=backend,
                               **options), process_group=dist.group.WORLD, **local)
        torch.save({k: getattr(out, k) for k in ("ess", "ess_ratio", "lr_scale", "baseline", "advantages")},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,options", [
    ("cpu", {}),
    ("torch", {}),
    ("cpu", dict(advantage="grpo", ess_on_corrected=True, is_threshold=1.5)),
    ("cpu", dict(opob_scope="batch", lr_rule="linear", ess_base_ratio=0.55)),
])
def test_two_ranks_agree_with_one_process(tmp_path, backend, options):
    init_file = tmp_path / "init"
    mp.spawn(_worker, args=(str(init_file), str(tmp_path), backend, options), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    batch = random_batch(21, "padded", num_seqs=8, max_len=12, spread=0.6, groups=3)
    whole = vcpo.policy_loss(batch.logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                             group_index=batch.group_index, num_groups=batch.num_groups,
                             grad_sq_norm=batch.grad_sq_norm, config=vcpo.VCPOConfig(backend=backend, **options))
    for key in ("ess", "ess_ratio", "lr_scale", "baseline"):
        torch.testing.assert_close(ranks[0][key], ranks[1][key], rtol=0, atol=0)  # identical on every rank
        torch.testing.assert_close(ranks[0][key], getattr(whole, key), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), whole.advantages, rtol=1e-5, atol=1e-6)
    assert 0 < ranks[0]["lr_scale"].item() < 1


def test_process_group_without_distributed_is_an_error():
    batch = random_batch(22, "padded")
    with pytest.raises(ValueError, match="not initialised"):
        vcpo.policy_loss(batch.logp, batch.behavior_logp, mask=batch.mask, rewards=batch.rewards,
                         process_group=object())
