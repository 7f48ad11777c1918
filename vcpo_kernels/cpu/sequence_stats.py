import torch

from .. import _C  # noqa: F401  (loads the library: registers torch.ops.vcpo.*)
from ..inputs import TokenBatch, acc_dtype


@torch.library.register_fake("vcpo::sequence_stats")
def _fake(logp, behavior_logp, old_logp, mask, cu_seqlens):
    b = cu_seqlens.shape[0] - 1
    dtype = acc_dtype(logp.dtype)
    return tuple(logp.new_empty((b,), dtype=dtype) for _ in range(3))


def sequence_stats(tokens: TokenBatch):
    t = tokens
    return torch.ops.vcpo.sequence_stats(
        t.logp.detach(), t.behavior_logp.detach(), None if t.old_logp is None else t.old_logp.detach(), t.mask,
        t.cu_seqlens,
    )
