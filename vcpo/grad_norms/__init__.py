"""Exact per-sequence squared gradient norms, and the gradient sum_i k_i g_i, from one batched backward pass:
ghost norms of linear layers, same-token norms of embeddings, per-expert norms of mixture-of-experts layers,
per-sequence vjp replays of any other module, tied weights with their cross term. Math, layouts and exactness
conditions: docs/grad_norms.md.

recorder.py records the forward and backward; one module per kind of layer forms its part (linear.py,
embedding.py, experts.py, replay.py for any other module, tied.py for a weight used more than once, fsdp.py for
sharded models); layout.py says where each sequence's rows lie; modes.py is what vcpo.step asks."""

from .modes import RECORDED, recorder
from .recorder import PerSequenceGradients
from .records import UnsupportedModuleError

__all__ = ["PerSequenceGradients", "RECORDED", "UnsupportedModuleError", "recorder"]
