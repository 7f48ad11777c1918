import torch

from .. import _C  # noqa: F401
from .. import head_chunks


@torch.library.register_fake("vcpo::logit_rows_forward")
def _fake(logits, targets, ignore_index, softcap):
    n = logits.shape[0]
    return tuple(logits.new_empty((n,)) for _ in range(4))


@torch.library.register_fake("vcpo::logit_rows_backward")
def _fake_backward(logits, lse, targets, ignore_index, g_logp, g_entropy, g_sum_p2, entropy, sum_p2, scale,
                   softcap):
    return None


def _backward_(z, lse, targets, ignore_index, g_logp, g_entropy, g_sum_p2, entropy, sum_p2, scale, cap):
    torch.ops.vcpo.logit_rows_backward(z, lse, targets, ignore_index, g_logp, g_entropy, g_sum_p2, entropy, sum_p2,
                                       scale, cap)
    return z


ROWS = head_chunks.RowPasses(torch.ops.vcpo.logit_rows_forward, _backward_)


def linear_logprobs(*args):
    """The shared chunk loop around torch's GEMMs with the C++ passes over each chunk of logits
    (csrc/cpu/logit_rows.h)."""
    return head_chunks.linear_logprobs(ROWS, *args)
