"""Random test batches in both layouts, with the awkward cases built in: an all-masked sequence, a one-token
sequence, a one-member group, non-contiguous groups, and NaN poison in every token that does not count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from support.oracle import Seq


@dataclass
class Batch:
    logp: torch.Tensor
    behavior_logp: torch.Tensor
    old_logp: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    rewards: torch.Tensor
    group_index: torch.Tensor
    num_groups: int
    grad_sq_norm: torch.Tensor
    extra: dict = field(default_factory=dict)

    def kwargs(self, *, with_grad_sq: bool = True) -> dict:
        kw = dict(
            mask=self.mask,
            cu_seqlens=self.cu_seqlens,
            old_logp=self.old_logp,
            rewards=self.rewards,
            group_index=self.group_index,
            num_groups=self.num_groups,
        )
        if with_grad_sq:
            kw["grad_sq_norm"] = self.grad_sq_norm
        return kw

    def to(self, dtype: torch.dtype, *, logp_only: bool = False) -> "Batch":
        """Same values at another dtype (the logp-like tensors; per-sequence tensors are cast by the ops)."""
        cast = lambda t: None if t is None else t.detach().to(dtype)  # noqa: E731
        ref = (lambda t: t) if logp_only else cast
        return Batch(cast(self.logp), ref(self.behavior_logp), ref(self.old_logp), self.mask, self.cu_seqlens,
                     self.rewards, self.group_index, self.num_groups, self.grad_sq_norm, dict(self.extra))

    def counted(self) -> torch.Tensor:
        flat = self.logp.reshape(-1)
        return torch.ones_like(flat, dtype=torch.bool) if self.mask is None else self.mask.reshape(-1) != 0

    def cu(self) -> torch.Tensor:
        if self.cu_seqlens is not None:
            return self.cu_seqlens
        b, t = self.logp.shape
        return torch.arange(b + 1) * t

    def oracle_seqs(self, advantages: Optional[torch.Tensor] = None) -> list[Seq]:
        cu, counted = self.cu().tolist(), self.counted()
        flat = lambda t: None if t is None else t.reshape(-1).double()  # noqa: E731
        lp, mu, old = flat(self.logp), flat(self.behavior_logp), flat(self.old_logp)
        seqs = []
        for i in range(len(cu) - 1):
            idx = [j for j in range(cu[i], cu[i + 1]) if counted[j]]
            seqs.append(Seq(
                lp=[lp[j].item() for j in idx],
                mu=[mu[j].item() for j in idx],
                old=None if old is None else [old[j].item() for j in idx],
                reward=self.rewards[i].item(),
                group=int(self.group_index[i]),
                grad_sq=self.grad_sq_norm[i].item(),
                advantage=None if advantages is None else advantages[i].item(),
            ))
        return seqs

    def token_grads(self, grad: torch.Tensor) -> list[list[float]]:
        """Per-sequence lists of the gradient at counted tokens, for comparison with the oracle."""
        cu, counted, g = self.cu().tolist(), self.counted(), grad.reshape(-1).double()
        return [[g[j].item() for j in range(cu[i], cu[i + 1]) if counted[j]] for i in range(len(cu) - 1)]


def random_batch(
    seed: int,
    layout: str = "padded",
    *,
    num_seqs: int = 7,
    max_len: int = 12,
    dtype: torch.dtype = torch.float32,
    spread: float = 0.3,
    with_old: bool = False,
    groups: int = 3,
    packed_mask: bool = True,
) -> Batch:
    """`spread` is the std of the per-token log ratio log pi - log mu."""
    g = torch.Generator().manual_seed(seed)
    b, t = num_seqs, max_len
    if layout == "padded":
        counted = torch.rand(b, t, generator=g) < 0.75
        counted[1] = False  # an all-masked sequence
        counted[2] = False
        counted[2, 3] = True  # a one-token sequence
        shape, cu = (b, t), None
    elif layout == "packed":
        lengths = torch.randint(0, t + 1, (b,), generator=g)
        lengths[1], lengths[2] = 0, 1  # an empty and a one-token sequence
        cu = torch.zeros(b + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(lengths, 0)
        n = int(cu[-1])
        counted = torch.rand(n, generator=g) < (0.85 if packed_mask else 1.0)  # tool output does not count
        counted[int(cu[2])] = True
        shape = (n,)
    else:
        raise ValueError(layout)
    logp = -torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 0.05
    behavior = logp + spread * torch.randn(shape, generator=g, dtype=torch.float64)
    old = logp + spread * torch.randn(shape, generator=g, dtype=torch.float64) if with_old else None
    poison = lambda x: None if x is None else torch.where(counted, x, torch.nan)  # noqa: E731
    group_index = torch.randint(0, groups, (b,), generator=g)
    group_index[0] = groups  # a one-member group, its index not contiguous with the others
    return Batch(
        logp=poison(logp).to(dtype),
        behavior_logp=poison(behavior).to(dtype),
        old_logp=None if old is None else poison(old).to(dtype),
        mask=counted if layout == "padded" or packed_mask else None,
        cu_seqlens=cu,
        # Integer rewards: ties and constant groups occur, and no group std is tiny (a tiny std amplifies
        # fp32 rounding of the log weights into the advantages, a conditioning effect, not an error).
        rewards=torch.randint(0, 4, (b,), generator=g).double(),
        group_index=group_index,
        num_groups=groups + 1,
        grad_sq_norm=torch.rand(b, generator=g, dtype=torch.float64) * 3 + 0.1,
    )
