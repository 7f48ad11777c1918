"""Embeddings (nn.Embedding and the scaled embeddings of transformers): a sequence's weight gradient has one row
per distinct token id, so its squared norm sums <b_t, b_s> over the pairs of its positions with the same id
(docs/grad_norms.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .fsdp import accumulate
from .layout import SequenceLayout
from .records import Call, Record, acc, chunked

# Subclasses of nn.Embedding in transformers whose forward is `super().forward(input_ids) * self.embed_scale`
# (True: `* self.embed_scale.to(self.weight.dtype)`): the weight's gradient is scale times the lookup's.
_SCALED_EMBEDDINGS = {
    **{(f"transformers.models.{pkg}.modeling_{pkg}", cls): True for pkg, cls in (
        ("diffusion_gemma", "DiffusionGemmaTextScaledWordEmbedding"), ("gemma", "GemmaTextScaledWordEmbedding"),
        ("gemma2", "Gemma2TextScaledWordEmbedding"), ("gemma3", "Gemma3TextScaledWordEmbedding"),
        ("gemma3n", "Gemma3nTextScaledWordEmbedding"), ("gemma4", "Gemma4TextScaledWordEmbedding"),
        ("gemma4_unified", "Gemma4UnifiedTextScaledWordEmbedding"), ("minicpm3", "MiniCPM3ScaledWordEmbedding"),
        ("vaultgemma", "VaultGemmaTextScaledWordEmbedding"))},
    **{(f"transformers.models.{pkg}.modeling_{pkg}", cls): False for pkg, cls in (
        ("bart", "BartScaledWordEmbedding"), ("bigbird_pegasus", "BigBirdPegasusScaledWordEmbedding"),
        ("biogpt", "BioGptScaledWordEmbedding"), ("blenderbot", "BlenderbotScaledWordEmbedding"),
        ("m2m_100", "M2M100ScaledWordEmbedding"), ("mbart", "MBartScaledWordEmbedding"),
        ("nllb_moe", "NllbMoeScaledWordEmbedding"), ("pegasus_x", "PegasusXScaledWordEmbedding"),
        ("plbart", "PLBartScaledWordEmbedding"), ("trocr", "TrOCRScaledWordEmbedding"),
        ("xglm", "XGLMScaledWordEmbedding"))},
}


def embedding_scale(module: nn.Module):
    """1 for a plain nn.Embedding, the output scale of a registered scaled embedding, None for anything else."""
    forward = type(module).forward
    if forward is nn.Embedding.forward:
        return 1
    cast = _SCALED_EMBEDDINGS.get((type(module).__module__, type(module).__qualname__))
    if cast is None or "forward" not in type(module).__dict__:
        return None
    scale = module.embed_scale
    return scale.to(module.weight.dtype) if cast else scale


def looked_up_ids(layout: SequenceLayout, rec: Record, call: Call) -> Tensor:
    """[B, T]: the ids an embedding call looked up, per sequence."""
    return layout.rows(call.args[0], rec.name, ids=True)


def grad_rows(layout: SequenceLayout, rec: Record, call: Call, ids: Tensor) -> Tensor:
    """[B, T, d]: the gradient reaching each looked-up row of the weight (scaled, padding rows zeroed)."""
    b = acc(layout.rows(call.grads[0], rec.name)) * embedding_scale(rec.module)
    if rec.module.padding_idx is not None:
        b = b * (ids != rec.module.padding_idx).unsqueeze(-1)
    return b


def sq_norms(layout: SequenceLayout, rec: Record, call: Call) -> Tensor:
    """[B]: sum over the pairs of a sequence's positions with the same id of <b_t, b_s>."""
    ids = looked_up_ids(layout, rec, call)
    b = grad_rows(layout, rec, call, ids)
    t = ids.shape[1]
    return chunked(lambda ids, b: ((ids.unsqueeze(2) == ids.unsqueeze(1)) * torch.bmm(b, b.transpose(1, 2)))
                   .sum((1, 2)), ids, b, per_seq_elements=2 * t * t)


def per_seq(layout: SequenceLayout, rec: Record, call: Call) -> Tensor:
    """[B, *weight.shape]: an embedding call's per-sequence weight gradients."""
    ids = looked_up_ids(layout, rec, call)
    b = grad_rows(layout, rec, call, ids)
    out = b.new_zeros((layout.num_seqs, *rec.module.weight.shape))
    out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, b.shape[-1]), b)
    return out


def inner(layout: SequenceLayout, rec: Record, call: Call, rows: Tensor) -> Tensor:
    """[B]: <g_i, M_i> for the call's per-sequence weight gradient g_i and M_i given by its rows at the looked-up
    ids (rows [B, T, d]): sum_t <d out_it, rows[i, t]>."""
    ids = looked_up_ids(layout, rec, call)
    if rows.shape[:2] != ids.shape:
        raise ValueError(f"rows must be [B, T, d] over the embedding's {tuple(ids.shape)} ids, got "
                         f"{tuple(rows.shape)}")
    b = grad_rows(layout, rec, call, ids)
    return (b * rows.to(b.dtype)).sum((1, 2))


def assemble(layout: SequenceLayout, rec: Record, call: Call, coefficients: Tensor) -> None:
    """sum_i c_i g_i into an embedding's weight: each row's gradient scaled by its sequence's c_i, added at its id."""
    m = rec.module
    x, grad = call.args[0], call.grads[0]
    w = layout.row_weights(coefficients, grad, rec.name)  # one weight per row
    g2 = grad.reshape(-1, grad.shape[-1]) * embedding_scale(m)
    if m.weight.requires_grad:
        # the full weight's shape (a sharded one's too: accumulate scatters it)
        update = torch.zeros(m.weight.shape, dtype=m.weight.dtype, device=g2.device).index_add_(
            0, x.reshape(-1), (g2 * w[:, None]).to(m.weight.dtype))
        if m.padding_idx is not None:
            update[m.padding_idx] = 0
        accumulate(m.weight, update)
