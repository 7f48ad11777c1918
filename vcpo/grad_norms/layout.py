"""Where each sequence's rows lie in a recorded module's tensors: padded ([B, ...], or [B T, ...] flattened by
mixture-of-experts layers) or packed (all N tokens along one dimension, cut by cu_seqlens)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .records import UnsupportedModuleError


class SequenceLayout:
    """The sequences of a batch: `num_seqs` padded ones (with `seq_len` T for modules that see [B T, ...]), or
    the packed ones of `cu_seqlens`."""

    def __init__(self, num_seqs: Optional[int], cu_seqlens: Optional[Tensor], seq_len: Optional[int]):
        if (num_seqs is None) == (cu_seqlens is None):
            raise ValueError("pass num_seqs (padded layout) or cu_seqlens (packed layout), not both")
        if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1):
            raise ValueError("cu_seqlens must be a 1-D tensor of B+1 offsets")
        self.cu_seqlens = None if cu_seqlens is None else cu_seqlens.to(torch.int64)
        self.num_seqs = int(num_seqs) if num_seqs is not None else self.cu_seqlens.numel() - 1
        # padded: the sequence length T, for modules that see the tokens flattened to [B T, ...] (MoE layers)
        self.seq_len = None if seq_len is None else int(seq_len)
        # Packed: the token count and the longest sequence size the per-sequence rows (one host read).
        if self.cu_seqlens is not None:
            lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
            self.num_tokens = int(self.cu_seqlens[-1])
            self.max_len = int(lengths.max()) if self.num_seqs > 0 else 0
            self.lengths = lengths.tolist()

    def token_dim(self, x: Tensor) -> Optional[int]:
        """Packed: the dimension of x that runs over the N tokens ([1, N, ...] or [N, ...]), else None."""
        n = self.num_tokens
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == n:
            return 1
        return 0 if x.dim() >= 1 and x.shape[0] == n else None

    def per_seq(self, x: Tensor) -> Optional[int]:
        """Padded: the number of leading rows per sequence of x, or None when x is not laid out by sequence.
        x is [B, ...]; with seq_len = T given, also [B T k, d] or [B T k] (tokens, or tokens x heads, flattened
        batch-major, as MoE layers see them). With B = T > 1 a 1-D x or 2-D floating-point x of leading dimension
        B is not taken as laid out by sequence: it may be a [T, d] tensor shared by all sequences, not one row
        each ([B, T] ids are)."""
        b, t = self.num_seqs, self.seq_len
        if x.dim() == 0 or b == 0:
            return None
        if x.dim() <= 2 and t is not None:
            if x.shape[0] % (b * t) == 0 and x.shape[0]:  # [B T, d], or [B T H, d] (per head: Qwen3-Next)
                return x.shape[0] // b
            ambiguous = b == t > 1 and (x.dim() == 1 or x.is_floating_point())
            return 1 if x.shape[0] == b and not ambiguous else None
        return 1 if x.shape[0] == b else None

    def seq_major(self, x: Tensor, name: str) -> Tensor:
        """Padded: x as [B, r, ...] (sequence i's rows at [i]). Packed: x as [N, ...] (tokens first)."""
        if self.cu_seqlens is None:
            r = self.per_seq(x)
            if r is None:
                raise UnsupportedModuleError(name, f"it saw shape {tuple(x.shape)}, not laid out by sequence "
                                                   f"(num_seqs = {self.num_seqs})")
            return x.reshape(self.num_seqs, r, *x.shape[1:]) if r > 1 or x.shape[0] != self.num_seqs else \
                x.unsqueeze(1)
        d = self.token_dim(x)
        if d is None:
            raise UnsupportedModuleError(name, f"it saw shape {tuple(x.shape)}, expected {self.num_tokens} packed "
                                               "tokens")
        return x[0] if d == 1 else x

    def rows(self, x: Tensor, name: str, ids: bool = False) -> Tensor:
        """Per-sequence rows of a module tensor: [B, L, d] for activations (every vector along the last
        dimension is a row, so [B, d] gives L = 1 and [B, T, H, d] gives L = T H), [B, L] for token ids.
        Packed tokens are scattered into zero-padded rows."""
        b = self.num_seqs
        flat = self.seq_major(x, name)
        if self.cu_seqlens is None:
            rows = flat
        else:
            n = self.num_tokens
            cu = self.cu_seqlens.to(flat.device)
            seq = self.token_seq(flat.device)
            pos = torch.arange(n, device=flat.device) - cu[seq]
            rows = flat.new_zeros((b, self.max_len, *flat.shape[1:]))
            rows[seq, pos] = flat
        return rows.reshape(b, -1) if ids else rows.reshape(b, -1, x.shape[-1])

    def row_seq(self, x: Tensor, name: str) -> Tensor:
        """The sequence of each leading row of seq_major(x) flattened over its first two (padded) or first
        (packed) dimensions."""
        flat = self.seq_major(x, name)
        if self.cu_seqlens is None:
            return torch.arange(self.num_seqs, device=x.device).repeat_interleave(flat.shape[1])
        return self.token_seq(x.device)

    def row_weights(self, coefficients: Tensor, like: Tensor, name: str) -> Tensor:
        """Each sequence's coefficient for every row of like.reshape(-1, like.shape[-1]) (rows are batch-major:
        sequence by sequence, padded; token by token, packed)."""
        c = coefficients.to(device=like.device, dtype=torch.promote_types(like.dtype, torch.float32))
        self.seq_major(like, name)  # checks the layout
        rows = like.numel() // like.shape[-1] if like.shape[-1] else 0
        if self.cu_seqlens is None:
            return c.repeat_interleave(rows // self.num_seqs if self.num_seqs else 0)
        return c[self.token_seq(like.device)].repeat_interleave(rows // self.num_tokens if self.num_tokens else 0)

    def token_seq(self, device) -> Tensor:
        """Sequence index of each packed token."""
        cu = self.cu_seqlens.to(device)
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=device), cu[1:] - cu[:-1],
                                       output_size=self.num_tokens)

    def slice(self, x: Tensor, i: int) -> Tensor:
        """Sequence i's part of a batched tensor, with x's rank."""
        if self.cu_seqlens is None:
            r = self.per_seq(x)
            return x.narrow(0, i * r, r)
        start = sum(self.lengths[:i])
        return x.narrow(self.token_dim(x), start, self.lengths[i])
