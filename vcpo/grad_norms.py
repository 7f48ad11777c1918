"""Exact per-sequence squared gradient norms, and the gradient sum_i k_i g_i, from one batched backward pass:
ghost norms of linear layers, same-token norms of embeddings, materialised gradients of small modules,
tied weights with their cross term. Math, layouts and exactness conditions: docs/grad_norms.md."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["PerSequenceGradients"]


def _accumulate(p: Tensor, update: Tensor) -> None:
    """p.grad += update, as autograd accumulates."""
    update = update.to(p.dtype)
    if p.grad is None:
        p.grad = update.clone()
    else:
        p.grad.add_(update)


def _acc(x: Tensor) -> Tensor:
    """x in its accumulation dtype: fp32 for fp32/bf16/fp16 records, fp64 for fp64 ones."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# Per-sequence temporaries ([chunk, d_out, d_in] or [chunk, T, T]) are formed a few sequences at a time.
_CHUNK_ELEMENTS = 1 << 24


def _chunked(fn, *tensors: Tensor, per_seq_elements: int) -> Tensor:
    """fn over slices of the leading (sequence) dimension, concatenated: bounds the temporaries' memory."""
    step = max(1, _CHUNK_ELEMENTS // max(per_seq_elements, 1))
    n = tensors[0].shape[0]
    return torch.cat([fn(*(t[i:i + step] for t in tensors)) for i in range(0, n, step)]) if n else fn(*tensors)


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: y = x @ W + b with W [in, out]; matched by name to avoid the import.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


@dataclass
class _Record:
    module: nn.Module
    name: str
    inputs: list = field(default_factory=list)  # one entry per call of the module in the forward
    grads: list = field(default_factory=list)
    outputs: list = field(default_factory=list)  # held until their gradient arrives (see backward())


class PerSequenceGradients:
    """Context manager: `with PerSequenceGradients(model, num_seqs=B) as psg: loss.backward()`, then
    `psg.sq_norms()` gives [B] float64 per-sequence squared gradient norms over every trainable parameter.

    Pass `cu_seqlens` for the packed layout (modules see all N tokens in one row). The backward must be of a
    sum of per-sequence terms (e.g. sum_i sum_t log pi(y_it)); scale a sequence's term by u_i and its
    squared norm scales by u_i^2. `modules` restricts the norms to those modules' parameters (e.g. the LM
    head alone, a cheaper proxy)."""

    def __init__(self, model: nn.Module, *, num_seqs: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
                 ghost: Optional[bool] = None, modules: Optional[list] = None, freeze_parameters: bool = False):
        if (num_seqs is None) == (cu_seqlens is None):
            raise ValueError("pass num_seqs (padded layout) or cu_seqlens (packed layout), not both")
        if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1):
            raise ValueError("cu_seqlens must be a 1-D tensor of B+1 offsets")
        self.model = model
        self.cu_seqlens = None if cu_seqlens is None else cu_seqlens.to(torch.int64)
        self.num_seqs = int(num_seqs) if num_seqs is not None else self.cu_seqlens.numel() - 1
        # Packed: the token count and the longest sequence size the per-sequence rows (one host read).
        if self.cu_seqlens is not None:
            lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
            self._num_tokens = int(self.cu_seqlens[-1])
            self._max_len = int(lengths.max()) if self.num_seqs > 0 else 0
        self.ghost = ghost  # None: cheaper of ghost and materialised per layer; True/False forces one
        self.modules = None if modules is None else list(modules)  # None: every module with parameters
        # freeze_parameters: inside the block trainable parameters do not require grad, so the forward keeps
        # only what activation gradients need (not the inputs of weight gradients) and module outputs start
        # the graph; for a norm pass followed by assemble(), never by a backward to the parameters.
        self.freeze_parameters = freeze_parameters
        self._frozen: list = []
        self._records: list[_Record] = []
        self._handles = []

    # -- recording ---------------------------------------------------------------------------------------
    def __enter__(self) -> "PerSequenceGradients":
        for name, module in self.model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not params or (self.modules is not None and not any(module is m for m in self.modules)):
                continue
            if isinstance(module, nn.Embedding) and (module.scale_grad_by_freq or module.sparse):
                raise ValueError(f"embedding {name!r} uses scale_grad_by_freq or sparse gradients: its "
                                 "per-sequence gradients are not supported")
            record = _Record(module, name or type(module).__name__)
            self._records.append(record)
            self._handles.append(module.register_forward_hook(self._forward_hook(record), with_kwargs=True))
        if self.freeze_parameters:
            self._frozen = [p for p in self.model.parameters() if p.requires_grad]
            for p in self._frozen:
                p.requires_grad_(False)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    def _check_unfrozen(self) -> None:
        if self._frozen:
            raise ValueError("leave the PerSequenceGradients block first: its parameters are frozen inside it")

    def backward(self, objective: Tensor, retain_graph: bool = False) -> None:
        """Backpropagate `objective` to the recorded module outputs only: their gradients are recorded and the
        parameters' own gradients are not computed (nor accumulated into .grad, nor seen by DDP's hooks);
        `objective.backward()` records the same, at the cost of the parameter gradients."""
        outputs = [o for rec in self._records for o in rec.outputs if o is not None]
        if outputs:
            torch.autograd.grad(objective, outputs, retain_graph=retain_graph, allow_unused=True)

    def release(self) -> None:
        """Drop the records (layer inputs and output gradients): call once the norms and gradient are formed."""
        for rec in self._records:
            rec.inputs.clear()
            rec.grads.clear()
            rec.outputs.clear()

    def _forward_hook(self, record: _Record):
        def hook(module, args, kwargs, output):
            if not torch.is_grad_enabled():
                return
            if not isinstance(output, Tensor):
                raise ValueError(f"module {record.name!r} returns {type(output).__name__}; per-sequence norms "
                                 "need modules with parameters to return one tensor")
            special = isinstance(module, (nn.Linear, nn.Embedding)) or _is_conv1d(module)
            if not special and (kwargs or sum(isinstance(a, Tensor) for a in args) != 1):
                raise ValueError(f"module {record.name!r} ({type(module).__name__}) was called with keyword or "
                                 "several tensor arguments; its per-sequence gradients cannot be replayed")
            if not output.requires_grad:
                if not self._frozen:
                    return
                output.requires_grad_()  # parameters frozen: the graph starts at the module outputs
            if (isinstance(module, nn.Embedding) and self.cu_seqlens is None and output.shape[0] == 1
                    and self.num_seqs > 1):
                # An embedding of ids shared by every row (GPT-2's positions, [1, T]) is broadcast by the add
                # that follows; broadcasting it here keeps each row's gradient apart. Same values, a view.
                output = output.expand(self.num_seqs, *output.shape[1:])
                args = (args[0].expand(self.num_seqs, *args[0].shape[1:]),) + tuple(args[1:])
            slot = len(record.inputs)
            record.inputs.append(tuple(a.detach() if isinstance(a, Tensor) else a for a in args))
            record.grads.append(None)
            record.outputs.append(output)

            def grad_hook(grad):
                # The first gradient is the recorded one (a second backward through a kept graph must not
                # replace or add records); the output itself is no longer needed.
                if slot < len(record.grads) and record.grads[slot] is None:
                    record.grads[slot] = grad.detach()
                    record.outputs[slot] = None

            output.register_hook(grad_hook)
            return output

        return hook

    # -- per-sequence rows -------------------------------------------------------------------------------
    def _rows(self, x: Tensor, ids: bool = False) -> Tensor:
        """Per-sequence rows of a module tensor: [B, L, d] for activations (every vector along the last
        dimension is a row, so [B, d] gives L = 1 and [B, T, H, d] gives L = T H), [B, L] for token ids.
        Packed tokens, seen as [1, N, ...] or [N, ...], are scattered into zero-padded rows."""
        b = self.num_seqs
        if self.cu_seqlens is None:
            if x.shape[0] != b:
                raise ValueError(f"a module saw batch size {x.shape[0]}, expected num_seqs = {b}")
            rows = x
        else:
            n = self._num_tokens
            flat = x[0] if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == n else x
            if flat.shape[0] != n:
                raise ValueError(f"a module saw shape {tuple(x.shape)}, expected {n} packed tokens")
            cu = self.cu_seqlens.to(flat.device)
            seq = self._token_seq(flat.device)
            pos = torch.arange(n, device=flat.device) - cu[seq]
            rows = flat.new_zeros((b, self._max_len, *flat.shape[1:]))
            rows[seq, pos] = flat
        return rows.reshape(b, -1) if ids else rows.reshape(b, -1, x.shape[-1])

    def _row_weights(self, coefficients: Tensor, like: Tensor) -> Tensor:
        """Each sequence's coefficient for every row of like.reshape(-1, like.shape[-1]) (tokens in the order
        the module saw them)."""
        c = coefficients.to(device=like.device, dtype=torch.promote_types(like.dtype, torch.float32))
        if self.cu_seqlens is None:
            return c.repeat_interleave(like[0].numel() // like.shape[-1] if like.shape[0] else 0)
        return c[self._token_seq(like.device)]

    def _token_seq(self, device) -> Tensor:
        """Sequence index of each packed token."""
        cu = self.cu_seqlens.to(device)
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=device), cu[1:] - cu[:-1],
                                       output_size=self._num_tokens)

    # -- gradient assembly ("book-keeping") -------------------------------------------------------------
    @torch.no_grad()
    def assemble(self, coefficients: Tensor) -> None:
        """Accumulate sum_i c_i g_i into every trainable parameter's .grad, where g_i is sequence i's gradient
        in the recorded backward: the gradient of sum_i c_i (sequence i's recorded objective), from the
        stored layer inputs and output gradients, without a second backward through the model.
        Exact when the loss to be optimised is sum_i c_i sum_t log pi(y_it), i.e. its gradient with respect
        to each token's log-prob is constant within a sequence (see vcpo.step for when that holds)."""
        self._check_unfrozen()
        if coefficients.shape != (self.num_seqs,):
            raise ValueError(f"coefficients must have shape [num_seqs] = [{self.num_seqs}]")
        for rec, x, grad, args in self._uses():
            m = rec.module
            w = self._row_weights(coefficients, grad)  # one weight per token row
            g2 = grad.reshape(-1, grad.shape[-1])
            if isinstance(m, nn.Embedding):
                if m.weight.requires_grad:
                    update = torch.zeros_like(m.weight).index_add_(0, x.reshape(-1), (g2 * w[:, None]).to(m.weight.dtype))
                    if m.padding_idx is not None:
                        update[m.padding_idx] = 0
                    _accumulate(m.weight, update)
            elif isinstance(m, nn.Linear) or _is_conv1d(m):
                a2 = x.reshape(-1, x.shape[-1])
                if m.weight.requires_grad:
                    # B^T diag(w) A: scale whichever of A and B is narrower (the LM head's B is V wide)
                    if a2.shape[1] <= g2.shape[1]:
                        a2w, g2w = a2 * w[:, None].to(a2.dtype), g2
                    else:
                        a2w, g2w = a2, g2 * w[:, None].to(g2.dtype)
                    _accumulate(m.weight, a2w.T @ g2w if _is_conv1d(m) else g2w.T @ a2w)
                if m.bias is not None and m.bias.requires_grad:
                    _accumulate(m.bias, w.to(g2.dtype) @ g2)
            else:
                from torch.func import functional_call, vjp

                names = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
                params = {n: getattr(m, n).detach() for n in names}
                _, pullback = vjp(lambda ps: functional_call(m, ps, args), params)
                scaled = (g2 * w[:, None].to(g2.dtype)).reshape(grad.shape)
                for n, update in pullback(scaled)[0].items():
                    _accumulate(getattr(m, n), update)

    def _uses(self):
        """(record, first input, output gradient, all inputs) for every call of a recorded module."""
        for rec in self._records:
            for args, grad in zip(rec.inputs, rec.grads):
                if grad is not None:  # None: this output did not reach the loss
                    yield rec, args[0] if args else None, grad, args

    def sq_norms(self) -> Tensor:
        """[B] float64: sum over trainable parameters of ||per-sequence gradient||^2, tied weights exact."""
        self._check_unfrozen()
        uses = defaultdict(list)  # id(param) -> [(kind, record, input rows, grad rows, args)]
        params = {}
        for rec, x, grad, args in self._uses():
            m = rec.module
            if isinstance(m, nn.Embedding):
                kinds = [("embedding", m.weight)]
            elif isinstance(m, nn.Linear) or _is_conv1d(m):
                kinds = [("linear", m.weight)] + ([("bias", m.bias)] if m.bias is not None else [])
            else:
                kinds = [("generic", p) for p in m.parameters(recurse=False)]
            for kind, p in kinds:
                if p is None or not p.requires_grad:
                    continue
                params[id(p)] = p
                uses[id(p)].append((kind, rec, x, grad, args))
        device = next(iter(params.values())).device if params else torch.device("cpu")
        total = torch.zeros(self.num_seqs, dtype=torch.float64, device=device)
        for pid, use_list in uses.items():
            p = params[pid]
            if len(use_list) == 1 and use_list[0][0] == "bias":
                total += self._single_use_norm(use_list[0])
            elif all(u[0] in ("linear", "embedding") for u in use_list):
                total += self._tied_norm(use_list)  # one use, or a weight shared by embedding and head
            else:  # materialise each use's per-sequence gradient and add them before the norm
                g = sum(self._materialised(u, p) for u in use_list)
                total += _acc(g).flatten(1).pow(2).sum(1).double()
        return total

    def embedding_inner(self, module: nn.Embedding, rows: Tensor) -> Tensor:
        """[B] float64: <g_i, M_i> for the per-sequence gradient g_i of the recorded embedding `module`'s
        weight and matrices M_i given by their rows at the embedding's input ids, rows[i, t] = M_i[ids[i, t]]
        (padded layout): sum_t <d out_it, rows[i, t]>. With M_i another use's per-sequence gradient of a shared
        weight this is their cross term, e.g. for an LM head computed outside the recorded modules."""
        self._check_unfrozen()
        total = torch.zeros(self.num_seqs, dtype=torch.float64, device=rows.device)
        for rec, ids, grad, _ in self._uses():
            if rec.module is not module:
                continue
            ids = self._rows(ids, ids=True)
            if rows.shape[:2] != ids.shape:
                raise ValueError(f"rows must be [B, T, d] over the embedding's {tuple(ids.shape)} ids, got "
                                 f"{tuple(rows.shape)}")
            b = _acc(self._rows(grad))
            if module.padding_idx is not None:
                b = b * (ids != module.padding_idx).unsqueeze(-1)
            total += (b * rows.to(b.dtype)).sum((1, 2)).double()
        return total

    def _single_use_norm(self, use) -> Tensor:
        kind, rec, x, grad, _ = use
        b = _acc(self._rows(grad))
        if kind == "bias":
            return b.sum(1).pow(2).sum(1)
        if kind == "embedding":
            return self._embedding_norm(rec.module, x, b)
        a = _acc(self._rows(x))
        t, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
        ghost = self.ghost if self.ghost is not None else t * (d_in + d_out) <= d_in * d_out
        if ghost:  # <A A^T, B B^T>: O(T^2 (d_in + d_out)) per sequence
            return _chunked(lambda a, b: (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(b, b.transpose(1, 2)))
                            .sum((1, 2)), a, b, per_seq_elements=2 * t * t)
        # ||B^T A||^2 materialised: O(T d_in d_out) per sequence
        return _chunked(lambda a, b: torch.bmm(b.transpose(1, 2), a).pow(2).sum((1, 2)), a, b,
                        per_seq_elements=d_in * d_out)

    def _embedding_norm(self, module: nn.Embedding, ids: Tensor, b: Tensor) -> Tensor:
        ids = self._rows(ids, ids=True)
        keep = torch.ones_like(ids, dtype=torch.bool)
        if module.padding_idx is not None:
            keep = ids != module.padding_idx  # the padding row receives no gradient
        b = b * keep.unsqueeze(-1)
        t = ids.shape[1]
        return _chunked(lambda ids, b: ((ids.unsqueeze(2) == ids.unsqueeze(1)) * torch.bmm(b, b.transpose(1, 2)))
                        .sum((1, 2)), ids, b, per_seq_elements=2 * t * t)

    def _tied_norm(self, use_list) -> Tensor:
        """||sum_u g_u||^2 over the uses of one weight by embeddings and linear layers (e.g. a tied LM head)."""
        total = sum(self._single_use_norm(u) for u in use_list)
        for i in range(len(use_list)):
            for j in range(i + 1, len(use_list)):
                total = total + 2 * self._cross_term(use_list[i], use_list[j])
        return total

    def _cross_term(self, u, v) -> Tensor:
        """<g_u,i, g_v,i> per sequence, for two uses of one weight."""
        if u[0] == "linear" and v[0] == "embedding":
            u, v = v, u
        if u[0] == "embedding" and v[0] == "linear":
            # g_emb = sum_t e_{x_t} B^emb_t^T; g_lin = B^lin^T A^lin (weight [V, d] as [out, in]):
            # <g_emb, g_lin> = sum_{t,s} B^lin_{s, x_t} <A^lin_s, B^emb_t>.
            _, rec_e, ids, grad_e, _ = u
            _, rec_l, x_l, grad_l, _ = v
            if _is_conv1d(rec_l.module):
                raise ValueError(f"weight shared by embedding {rec_e.name!r} and Conv1D {rec_l.name!r}: unsupported")
            ids = self._rows(ids, ids=True)
            b_e = _acc(self._rows(grad_e))
            if rec_e.module.padding_idx is not None:
                b_e = b_e * (ids != rec_e.module.padding_idx).unsqueeze(-1)
            a_l = _acc(self._rows(x_l))
            b_l = _acc(self._rows(grad_l))
            inner = torch.bmm(a_l, b_e.transpose(1, 2))  # [B, T_l, T_e]: <A_s, B^emb_t>
            picked = torch.gather(b_l, 2, ids.unsqueeze(1).expand(-1, b_l.shape[1], -1))  # B^lin_{s, x_t}
            return (inner * picked).sum((1, 2))
        gu, gv = self._materialised(u, None), self._materialised(v, None)
        return (_acc(gu) * _acc(gv)).flatten(1).sum(1)

    def _materialised(self, use, p: Optional[Tensor]) -> Tensor:
        """[B, *param.shape]: the per-sequence gradient of `p` through this one use."""
        kind, rec, x, grad, args = use
        m = rec.module
        if kind == "linear":
            g = torch.bmm(self._rows(grad).transpose(1, 2), self._rows(x))
            return g.transpose(1, 2) if _is_conv1d(m) else g
        if kind == "bias":
            return self._rows(grad).sum(1)
        if kind == "embedding":
            ids = self._rows(x, ids=True)
            b = self._rows(grad)
            out = b.new_zeros((self.num_seqs, *m.weight.shape))
            out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, b.shape[-1]), b)
            if m.padding_idx is not None:
                out[:, m.padding_idx] = 0
            return out
        return self._generic_gradients(rec, args, grad)[id(p)]

    def _generic_gradients(self, rec: _Record, args, grad: Tensor) -> dict:
        """Per-sequence gradients of a module's own parameters, by vmap over sequences (padded) or over tokens
        (packed, which assumes the module acts on each token separately, as normalisation layers do)."""
        from torch.func import functional_call, vjp, vmap

        m = rec.module
        names = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
        params = {n: getattr(m, n).detach() for n in names}
        x = args[0]

        def one(xi, gi):
            def f(ps):
                return functional_call(m, ps, (xi,))

            _, pullback = vjp(f, params)
            return pullback(gi)[0]

        if self.cu_seqlens is None:
            per = vmap(one)(x, grad)  # {name: [B, *shape]}
        else:
            n = self._num_tokens
            packed = lambda t: t[0] if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == n else t  # noqa: E731
            flat_x, flat_g = packed(x), packed(grad)  # [N, ...]: one entry per token
            per_token = vmap(one)(flat_x, flat_g)
            seq = self._token_seq(x.device)
            per = {n: t.new_zeros((self.num_seqs, *t.shape[1:])).index_add_(0, seq, t) for n, t in per_token.items()}
        return {id(getattr(m, n)): per[n] for n in names}
