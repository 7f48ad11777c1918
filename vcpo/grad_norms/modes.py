"""What a step asks of this package: the recorder of G_i for a VCPOConfig.grad_norms mode (vcpo/config.py)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from .recorder import PerSequenceGradients

# The modes whose G_i come from the recorded layers ("length" and "uniform" need no backward; "auto" resolves to
# "exact" or "lm_head" before a recorder is asked for).
RECORDED = ("exact", "lm_head")


def recorder(model: nn.Module, how: str, *, num_seqs: int, seq_len: int, freeze_parameters: bool,
             head_outside: bool = False) -> Optional[PerSequenceGradients]:
    """The recorder of a padded [num_seqs, seq_len] batch's G_i for mode `how`: every layer ("exact") or the LM
    head alone ("lm_head"; nothing when `head_outside`: a fused LM head forms its own norm); None for a mode
    that records nothing. `freeze_parameters` as in PerSequenceGradients."""
    if how not in RECORDED or (how == "lm_head" and head_outside):
        return None
    modules = None if how == "exact" else [model.get_output_embeddings()]
    return PerSequenceGradients(model, num_seqs=num_seqs, seq_len=seq_len, modules=modules,
                                freeze_parameters=freeze_parameters)
