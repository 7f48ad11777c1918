"""Exact per-sequence squared gradient norms, and the gradient sum_i k_i g_i, from one batched backward pass:
ghost norms of linear layers, same-token norms of embeddings, per-expert norms of mixture-of-experts layers,
per-sequence vjp replays of any other module, tied weights with their cross term. Math, layouts and exactness
conditions: docs/grad_norms.md."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["PerSequenceGradients", "UnsupportedModuleError"]


class UnsupportedModuleError(ValueError):
    """The per-sequence gradients of `module` (its name in the model) cannot be formed exactly."""

    def __init__(self, module: str, reason: str):
        super().__init__(f"module {module!r}: {reason}. Exact per-sequence norms are not available for this model: "
                         "use grad_norms='auto' (the LM head's norm, with a warning) or 'lm_head', 'length', 'uniform'")
        self.module = module


def _accumulate(p: Tensor, update: Tensor) -> None:
    """p.grad += update, as autograd accumulates. A sharded (FSDP2, DTensor) parameter gets its shard of the
    mean of the ranks' full updates (a reduce-scatter over its mesh), as FSDP2's own backward would give it."""
    update = update.to(p.dtype)
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        update = DTensor.from_local(update / mesh.size(), mesh, [Partial()] * mesh.ndim).redistribute(
            mesh, p.placements)
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


def _ghost_form(t: int, d_in: int, d_out: int, ghost: Optional[bool]) -> bool:
    """Whether a linear layer's norm takes the ghost form: the forced one, else the cheaper in FLOPs."""
    return ghost if ghost is not None else t * (d_in + d_out) <= d_in * d_out


def _linear_sq_norms(a: Tensor, b: Tensor, ghost: Optional[bool]) -> Tensor:
    """[B]: ||B_i^T A_i||_F^2 for rows a [B, T, d_in], b [B, T, d_out] (zero rows contribute nothing)."""
    t, d_in, d_out = a.shape[1], a.shape[2], b.shape[2]
    if _ghost_form(t, d_in, d_out, ghost):  # <A A^T, B B^T>: O(T^2 (d_in + d_out))
        return _chunked(lambda a, b: (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(b, b.transpose(1, 2))).sum((1, 2)),
                        a, b, per_seq_elements=2 * t * t)
    return _chunked(lambda a, b: torch.bmm(b.transpose(1, 2), a).pow(2).sum((1, 2)), a, b,  # O(T d_in d_out)
                    per_seq_elements=d_in * d_out)


# -- which rule a module gets ----------------------------------------------------------------------------
# A closed-form rule is used only where the module's forward is exactly the op of that rule: the class's forward
# is nn.Linear's / nn.Embedding's / transformers' Conv1D's, a registered scaled embedding, or transformers'
# mixture-of-experts dispatcher. Every other module with parameters is replayed per sequence ("generic").

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


def _embedding_scale(module: nn.Module):
    """1 for a plain nn.Embedding, the output scale of a registered scaled embedding, None for anything else."""
    forward = type(module).forward
    if forward is nn.Embedding.forward:
        return 1
    cast = _SCALED_EMBEDDINGS.get((type(module).__module__, type(module).__qualname__))
    if cast is None or "forward" not in type(module).__dict__:
        return None
    scale = module.embed_scale
    return scale.to(module.weight.dtype) if cast else scale


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: y = x @ W + b with W [in, out]
    if type(module).__name__ != "Conv1D" or not type(module).__module__.startswith("transformers"):
        return False
    from transformers.pytorch_utils import Conv1D

    return type(module).forward is Conv1D.forward


@functools.cache
def _experts_dispatch_code():
    """The code of the forward that transformers' `use_experts_implementation` gives an experts class."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return None

    class _Probe(nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError

    return use_experts_implementation(_Probe).forward.__code__


def _is_experts(module: nn.Module) -> bool:
    """A transformers experts module: forward(hidden [N, H], expert ids [N, k], routing weights [N, k]) with
    3-D expert weights, dispatched to eager / grouped_mm / batched_mm implementations of one computation."""
    forward = type(module).forward
    if not type(module).__module__.startswith("transformers") or not hasattr(forward, "__wrapped__"):
        return False
    code = _experts_dispatch_code()
    return code is not None and forward.__code__ is code


def _rule(module: nn.Module) -> str:
    if type(module).forward is nn.Linear.forward:
        return "linear"
    if _embedding_scale(module) is not None:
        return "embedding"
    if _is_conv1d(module):
        return "conv1d"
    if _is_experts(module):
        return "experts"
    return "generic"


# A replay of a module on one sequence must reproduce what it output on the batch (same parameters, same
# inputs): a looser match means it mixes sequences or is random, and its per-sequence gradients are refused.
_REPLAY_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def _replay_matches(got: Tensor, want: Tensor, call: "_Call") -> bool:
    """got == want to the precision of the call's least precise floating-point tensor (a float64 module may take
    float32 routing weights and round its output to them, as NemotronH's experts do)."""
    if got.shape != want.shape:
        return False
    if want.numel() == 0:
        return True
    dtypes = [t.dtype for t, _ in call.versions if t.is_floating_point()] + [want.dtype]
    rtol = max(_REPLAY_RTOL.get(d, 3e-2) for d in dtypes)
    got, want = _acc(got.detach()), _acc(want.detach())
    tol = rtol * float(want.abs().max()) + 1e-30
    return float((got - want).abs().max()) <= tol


def _reentrant_checkpoint_in(root) -> bool:
    """Whether the autograd graph below `root` holds a reentrant torch.utils.checkpoint segment (Hugging Face's
    gradient_checkpointing_enable() default): torch.autograd.grad cannot backpropagate through one."""
    seen, stack = set(), [root]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return False


def _floats(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor) and t.is_floating_point()]


@dataclass
class _Call:
    """One call of a recorded module in the forward."""

    kind: str  # "linear" | "conv1d" | "embedding" | "experts" | "generic"
    args: tuple  # detached
    kwargs: dict
    outputs: list  # where each floating-point output's gradient arrives (see backward()), until it does
    values: list  # their detached values (replayed modules: the replay is checked against them)
    grads: list  # their gradients, None until (unless) one arrives
    adopted: dict = field(default_factory=dict)  # relative name -> a descendant's parameter this call used itself
    weights: dict = field(default_factory=dict)  # sharded model: name -> a copy of the unsharded value it used
    versions: list = field(default_factory=list)  # (tensor, version) of the kept inputs and outputs
    terms: Optional[list] = None  # experts: the per-expert terms, shared by the norms and the assembly


@dataclass
class _Record:
    module: nn.Module
    name: str
    rule: str
    path: str  # the module's name in the model ("" for the model itself)
    calls: list = field(default_factory=list)
    adopted: dict = field(default_factory=dict)  # adopted by the call in progress


class _ParameterWatch(TorchFunctionMode):
    """Flags a trainable parameter used by a differentiable op outside the forward of every module that owns it
    (e.g. `F.linear(h, embedding.weight)` in a parent's forward): the hooks would not see that use."""

    _VIEWS = {"T", "mT", "H", "mH", "real", "imag"}  # differentiable property reads (others: dtype, shape, data...)

    def __init__(self, psg: "PerSequenceGradients"):
        super().__init__()
        self.psg = psg

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        psg, name = self.psg, getattr(func, "__name__", "")
        if (psg._paused or not torch.is_grad_enabled() or name == "detach"
                or (name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") not in self._VIEWS)
                or not _floats(out)):
            return out
        for a in (*args, *kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                owners = psg._owners.get(id(t)) if isinstance(t, Tensor) else None
                if owners and not any(psg._active[id(m)] for m in owners) and not psg._adopt(t):
                    psg._outside.append((psg._param_names[id(t)], name))
        return out


class PerSequenceGradients:
    """Context manager: `with PerSequenceGradients(model, num_seqs=B) as psg: loss.backward()`, then
    `psg.sq_norms()` gives [B] float64 per-sequence squared gradient norms over every trainable parameter.

    Pass `cu_seqlens` for the packed layout (modules see all N tokens in one row), `seq_len` (T) with num_seqs
    for models that flatten [B, T] to [B T] tokens (mixture-of-experts layers). The backward must be of a
    sum of per-sequence terms (e.g. sum_i sum_t log pi(y_it)); scale a sequence's term by u_i and its
    squared norm scales by u_i^2. `modules` restricts the norms to those modules' parameters (e.g. the LM
    head alone, a cheaper proxy). A module whose per-sequence gradients cannot be formed exactly raises
    UnsupportedModuleError naming it (at the forward, or when the norms or gradient are formed)."""

    def __init__(self, model: nn.Module, *, num_seqs: Optional[int] = None, cu_seqlens: Optional[Tensor] = None,
                 seq_len: Optional[int] = None, ghost: Optional[bool] = None, modules: Optional[list] = None,
                 freeze_parameters: bool = False):
        if (num_seqs is None) == (cu_seqlens is None):
            raise ValueError("pass num_seqs (padded layout) or cu_seqlens (packed layout), not both")
        if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1):
            raise ValueError("cu_seqlens must be a 1-D tensor of B+1 offsets")
        self.model = model
        self.cu_seqlens = None if cu_seqlens is None else cu_seqlens.to(torch.int64)
        self.num_seqs = int(num_seqs) if num_seqs is not None else self.cu_seqlens.numel() - 1
        # padded: the sequence length T, for modules that see the tokens flattened to [B T, ...] (MoE layers)
        self.seq_len = None if seq_len is None else int(seq_len)
        # Packed: the token count and the longest sequence size the per-sequence rows (one host read).
        if self.cu_seqlens is not None:
            lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
            self._num_tokens = int(self.cu_seqlens[-1])
            self._max_len = int(lengths.max()) if self.num_seqs > 0 else 0
            self._lengths = lengths.tolist()
        self.ghost = ghost  # None: cheaper of ghost and materialised per layer; True/False forces one
        self.modules = None if modules is None else list(modules)  # None: every module with parameters
        # freeze_parameters: inside the block trainable parameters do not require grad, so the forward keeps
        # only what activation gradients need (not the inputs of weight gradients) and module outputs start
        # the graph; for a norm pass followed by assemble(), never by a backward to the parameters.
        self.freeze_parameters = freeze_parameters
        self._frozen: list = []
        self._records: list[_Record] = []
        self._handles = []
        self._replaying = False  # a replay of a module must not record again
        self._paused = False
        self._owners: dict = {}  # id(param) -> the recorded modules that own it
        self._param_names: dict = {}  # id(param) -> its name in the model
        self._active: dict = defaultdict(int)  # id(module) -> calls of it in progress
        self._outside: list = []  # (parameter, op): uses seen outside their modules' forward, not adopted
        self._stack: list = []  # the recorded modules whose forward is in progress, outermost first
        self._watch: Optional[_ParameterWatch] = None
        # FSDP2: (id(module), name) -> the sharded parameter; id(unsharded parameter) -> the sharded one
        self._sharded: dict = {}
        self._sharded_of: dict = {}

    # -- recording ---------------------------------------------------------------------------------------
    def __enter__(self) -> "PerSequenceGradients":
        self._param_names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        self._sharded = {(id(m), n): p for m in self.model.modules() for n, p in m.named_parameters(recurse=False)
                         if isinstance(p, DTensor)}
        owned = defaultdict(list)  # id(param) -> every module that has it as its own parameter
        for name, module in self.model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            for p in params:
                owned[id(p)].append(module)
            if not params or (self.modules is not None and not any(module is m for m in self.modules)):
                continue
            name = name or type(module).__name__
            rule = _rule(module)
            if rule == "embedding" and (module.scale_grad_by_freq or module.sparse):
                raise UnsupportedModuleError(name, "an embedding with scale_grad_by_freq or sparse gradients")
            record = _Record(module, name, rule, path=name if module is not self.model else "")
            self._records.append(record)
            self._handles.append(module.register_forward_pre_hook(lambda m, a, rec=record: self._stack.append(rec)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._stack.pop() and None,
                                                                always_call=True))
            self._handles.append(module.register_forward_hook(self._forward_hook(record), with_kwargs=True))
        # The recorded parameters are watched: a use outside the forward of every module owning it is refused.
        for rec in self._records:
            for p in rec.module.parameters(recurse=False):
                self._owners[id(p)] = owned[id(p)]
        for module in {id(m): m for ms in self._owners.values() for m in ms}.values():
            self._handles.append(module.register_forward_pre_hook(self._enter_hook))
            self._handles.append(module.register_forward_hook(self._exit_hook, always_call=True))
        if self.freeze_parameters:
            self._frozen = [p for p in self.model.parameters() if p.requires_grad]
            for p in self._frozen:
                p.requires_grad_(False)
        self._watch = _ParameterWatch(self)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._watch is not None:
            self._watch.__exit__(*exc)
            self._watch = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for p in self._frozen:
            p.requires_grad_(True)
        self._frozen = []

    @contextmanager
    def pause(self):
        """Uses of recorded parameters inside this block (e.g. an LM head computed by a fused op from the head's
        weight) are not checked; the caller accounts for their part of the norms."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _check_unfrozen(self) -> None:
        if self._frozen:
            raise ValueError("leave the PerSequenceGradients block first: its parameters are frozen inside it")

    def _check_complete(self) -> None:
        """Refuse when a recorded parameter was used outside its modules' forward (its gradient is not seen)."""
        for rec, call in self._uses():
            for p in call.adopted.values():
                if any(r.calls and any(r.module is m for m in self._owners[id(p)]) for r in self._records):
                    raise UnsupportedModuleError(rec.name, f"the parameter {self._param_names[id(p)]!r} is used both "
                                                           "by its module and directly by this one")
        if self._outside:
            param, op = self._outside[0]
            raise UnsupportedModuleError(param.rpartition(".")[0] or param, f"its parameter {param!r} is used by "
                                         f"{op!r} outside the module's forward, where the hooks cannot see it")

    def backward(self, objective: Tensor, retain_graph: bool = False) -> None:
        """Backpropagate `objective` to the recorded module outputs only: their gradients are recorded and the
        parameters' own gradients are not computed (nor accumulated into .grad, nor seen by DDP's hooks);
        `objective.backward()` records the same, at the cost of the parameter gradients."""
        self._check_complete()
        if _reentrant_checkpoint_in(objective.grad_fn):
            raise ValueError("the model uses reentrant activation checkpointing (Hugging Face's "
                             "gradient_checkpointing_enable() default), which cannot backpropagate to the recorded "
                             "layers only: enable it with gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                             "{'use_reentrant': False}) (the per-sequence norms are exact with it)")
        waiting = [(c, k) for rec in self._records for c in rec.calls for k, o in enumerate(c.outputs) if o is not None]
        if waiting:
            grads = torch.autograd.grad(objective, [c.outputs[k] for c, k in waiting], retain_graph=retain_graph,
                                        allow_unused=True)
            for (c, k), g in zip(waiting, grads):
                self._grad_hook(c, k)(g)

    def release(self) -> None:
        """Drop the records (layer inputs and output gradients): call once the norms and gradient are formed."""
        for rec in self._records:
            rec.calls.clear()

    def _adopt(self, p: Tensor) -> bool:
        """A parameter used outside its module's forward but inside the forward of a recorded ancestor replayed
        per sequence (Mamba's and Qwen3-Next's mixers use their conv1d's weight themselves) is replayed with that
        ancestor's call: True when such an ancestor is running."""
        name = self._param_names[id(p)]
        for rec in reversed(self._stack):
            if name.startswith(rec.path + "." if rec.path else ""):
                if rec.rule != "generic":
                    return False
                rec.adopted[name[len(rec.path) + 1 if rec.path else 0:]] = p
                return True
        return False

    def _enter_hook(self, module, args):
        self._active[id(module)] += 1
        if self._sharded:  # FSDP2 swapped in the unsharded parameters (its hooks run first): they stand for the
            for n, p in module.named_parameters(recurse=False):  # sharded ones
                sharded = self._sharded.get((id(module), n))
                if sharded is not None and id(p) not in self._sharded_of:
                    self._sharded_of[id(p)] = sharded
                    self._owners[id(p)] = self._owners.get(id(sharded), [])
                    self._param_names[id(p)] = self._param_names[id(sharded)]

    def _exit_hook(self, module, args, output):
        self._active[id(module)] -= 1

    def _forward_hook(self, record: _Record):
        def hook(module, args, kwargs, output):
            adopted, record.adopted = record.adopted, {}
            if self._replaying or not torch.is_grad_enabled():
                return
            kind = record.rule
            if adopted and kind != "generic":
                raise UnsupportedModuleError(record.name, "a child's parameter is used in its forward and it is not "
                                                          "replayed per sequence")
            if kind != "experts" and kind != "generic" and (kwargs or len(args) != 1 or not isinstance(output, Tensor)):
                kind = "generic"  # the closed forms are for the plain one-argument call
            leaves, spec = tree_flatten(output)
            if any(not isinstance(t, (Tensor, int, float, bool, str, type(None))) for t in leaves):
                raise UnsupportedModuleError(record.name, f"it returns {type(output).__name__}, not tensors")
            slots = [j for j, t in enumerate(leaves) if isinstance(t, Tensor) and t.is_floating_point()]
            for j in slots:
                if not leaves[j].requires_grad and self._frozen and leaves[j].grad_fn is None:
                    # parameters frozen: the graph starts here (a copy, which the model may modify in place)
                    leaves[j] = leaves[j].detach().requires_grad_().clone()
                elif leaves[j].requires_grad and len(slots) > 1:
                    # A copy receives only the gradient from outside the module (a router computes its scores
                    # from the logits it also returns: their own gradient must not count twice).
                    leaves[j] = leaves[j].clone()
            if not any(leaves[j].requires_grad for j in slots):
                return
            if (kind in ("embedding", "generic") and self.cu_seqlens is None and self.num_seqs > 1
                    and all(leaves[j].dim() >= 2 and leaves[j].shape[0] == 1 for j in slots)):
                # An output shared by every row (GPT-2's or BART's position embeddings of [1, T] positions) is
                # broadcast by the add that follows; broadcasting it here keeps each row's gradient apart.
                # Same values, a view.
                for j in slots:
                    leaves[j] = leaves[j].expand(self.num_seqs, *leaves[j].shape[1:])
                if kind == "embedding":
                    args = (args[0].expand(self.num_seqs, *args[0].shape[1:]),)
            detach = lambda t: t.detach() if isinstance(t, Tensor) else t  # noqa: E731
            outs = [leaves[j] for j in slots]
            call = _Call(kind, tree_map(detach, tuple(args)), tree_map(detach, dict(kwargs)), [None] * len(outs),
                         [o.detach() for o in outs] if kind in ("experts", "generic") else [], [None] * len(outs),
                         adopted)
            # A kept tensor the model later modifies in place (XLM masks its embeddings with *=) no longer holds
            # what the module saw: checked before use (detached tensors share the version counter).
            call.versions = [(t, t._version) for t in tree_flatten((call.args, call.kwargs, call.values))[0]
                             if isinstance(t, Tensor)]
            if self._sharded and kind in ("generic", "experts"):
                if kind == "experts":
                    raise UnsupportedModuleError(record.name, "experts weights sharded by FSDP2")
                # FSDP2 frees the unsharded weights after the forward: the replays use copies (docs/grad_norms.md)
                used = {**dict(module.named_parameters(recurse=False)), **adopted}
                call.weights = {n: p.detach().clone() for n, p in used.items()}
                call.adopted = {n: self._sharded_of.get(id(p), p) for n, p in adopted.items()}
            record.calls.append(call)
            for k, o in enumerate(outs):
                if not o.requires_grad:
                    continue
                # The gradient of the value the module returned, even if the model then modifies it in place
                # (CTRL scales its embeddings with *=): taken where the node that made it receives it.
                if o.grad_fn is None:
                    o.register_hook(self._grad_hook(call, k))
                    call.outputs[k] = o
                else:
                    nr = o.output_nr
                    o.grad_fn.register_prehook(lambda grads, hook=self._grad_hook(call, k), nr=nr: hook(grads[nr]))
                    call.outputs[k] = torch.autograd.graph.get_gradient_edge(o)
            return tree_unflatten(leaves, spec)

        return hook

    @staticmethod
    def _grad_hook(call: _Call, k: int):
        def hook(grad):
            # The first gradient is the recorded one (a second backward through a kept graph must not replace
            # it); the output itself is no longer needed.
            if grad is not None and call.grads[k] is None:
                call.grads[k] = grad.detach()
                call.outputs[k] = None

        return hook

    # -- per-sequence layout -----------------------------------------------------------------------------
    def _token_dim(self, x: Tensor) -> Optional[int]:
        """Packed: the dimension of x that runs over the N tokens ([1, N, ...] or [N, ...]), else None."""
        n = self._num_tokens
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == n:
            return 1
        return 0 if x.dim() >= 1 and x.shape[0] == n else None

    def _per_seq(self, x: Tensor) -> Optional[int]:
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

    def _seq_major(self, x: Tensor, name: str) -> Tensor:
        """Padded: x as [B, r, ...] (sequence i's rows at [i]). Packed: x as [N, ...] (tokens first)."""
        if self.cu_seqlens is None:
            r = self._per_seq(x)
            if r is None:
                raise UnsupportedModuleError(name, f"it saw shape {tuple(x.shape)}, not laid out by sequence "
                                                   f"(num_seqs = {self.num_seqs})")
            return x.reshape(self.num_seqs, r, *x.shape[1:]) if r > 1 or x.shape[0] != self.num_seqs else \
                x.unsqueeze(1)
        d = self._token_dim(x)
        if d is None:
            raise UnsupportedModuleError(name, f"it saw shape {tuple(x.shape)}, expected {self._num_tokens} packed "
                                               "tokens")
        return x[0] if d == 1 else x

    def _rows(self, x: Tensor, name: str, ids: bool = False) -> Tensor:
        """Per-sequence rows of a module tensor: [B, L, d] for activations (every vector along the last
        dimension is a row, so [B, d] gives L = 1 and [B, T, H, d] gives L = T H), [B, L] for token ids.
        Packed tokens are scattered into zero-padded rows."""
        b = self.num_seqs
        flat = self._seq_major(x, name)
        if self.cu_seqlens is None:
            rows = flat
        else:
            n = self._num_tokens
            cu = self.cu_seqlens.to(flat.device)
            seq = self._token_seq(flat.device)
            pos = torch.arange(n, device=flat.device) - cu[seq]
            rows = flat.new_zeros((b, self._max_len, *flat.shape[1:]))
            rows[seq, pos] = flat
        return rows.reshape(b, -1) if ids else rows.reshape(b, -1, x.shape[-1])

    def _row_seq(self, x: Tensor, name: str) -> Tensor:
        """The sequence of each leading row of _seq_major(x) flattened over its first two (padded) or first
        (packed) dimensions."""
        flat = self._seq_major(x, name)
        if self.cu_seqlens is None:
            return torch.arange(self.num_seqs, device=x.device).repeat_interleave(flat.shape[1])
        return self._token_seq(x.device)

    def _row_weights(self, coefficients: Tensor, like: Tensor, name: str) -> Tensor:
        """Each sequence's coefficient for every row of like.reshape(-1, like.shape[-1]) (rows are batch-major:
        sequence by sequence, padded; token by token, packed)."""
        c = coefficients.to(device=like.device, dtype=torch.promote_types(like.dtype, torch.float32))
        self._seq_major(like, name)  # checks the layout
        rows = like.numel() // like.shape[-1] if like.shape[-1] else 0
        if self.cu_seqlens is None:
            return c.repeat_interleave(rows // self.num_seqs if self.num_seqs else 0)
        return c[self._token_seq(like.device)].repeat_interleave(rows // self._num_tokens if self._num_tokens else 0)

    def _token_seq(self, device) -> Tensor:
        """Sequence index of each packed token."""
        cu = self.cu_seqlens.to(device)
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=device), cu[1:] - cu[:-1],
                                       output_size=self._num_tokens)

    # -- the records ---------------------------------------------------------------------------------------
    def _uses(self):
        """(record, call) for every call of a recorded module whose output reached the objective."""
        for rec in self._records:
            for call in rec.calls:
                if any(g is not None for g in call.grads):
                    if any(t._version != v for t, v in call.versions):
                        raise UnsupportedModuleError(rec.name, "an input or output of it was modified in place after "
                                                               "the call, so what it saw is no longer known")
                    yield rec, call

    @staticmethod
    def _call_params(rec: _Record, call: _Call) -> dict:
        """{name relative to the module: trainable parameter} replayed for a call: its own and adopted ones."""
        own = {n: p for n, p in rec.module.named_parameters(recurse=False) if p.requires_grad}
        return {**own, **{n: p for n, p in call.adopted.items() if p.requires_grad}}

    @staticmethod
    def _grad(call: _Call, k: int = 0) -> Tensor:
        g = call.grads[k]
        return g if g is not None else torch.zeros_like(call.values[k])

    # -- gradient assembly ("book-keeping") -------------------------------------------------------------
    @torch.no_grad()
    def assemble(self, coefficients: Tensor) -> None:
        """Accumulate sum_i c_i g_i into every trainable parameter's .grad, where g_i is sequence i's gradient
        in the recorded backward: the gradient of sum_i c_i (sequence i's recorded objective), from the
        stored layer inputs and output gradients, without a second backward through the model.
        Exact when the loss to be optimised is sum_i c_i sum_t log pi(y_it), i.e. its gradient with respect
        to each token's log-prob is constant within a sequence (see vcpo.step for when that holds)."""
        self._check_unfrozen()
        self._check_complete()
        if coefficients.shape != (self.num_seqs,):
            raise ValueError(f"coefficients must have shape [num_seqs] = [{self.num_seqs}]")
        for rec, call in self._uses():
            m = rec.module
            if call.kind == "experts":
                self._experts_assemble(rec, call, coefficients)
                continue
            if call.kind == "generic":
                params = self._call_params(rec, call)
                for n, update in self._generic_weighted(rec, call, coefficients).items():
                    _accumulate(params[n], update)
                continue
            x, grad = call.args[0], call.grads[0]
            w = self._row_weights(coefficients, grad, rec.name)  # one weight per row
            g2 = grad.reshape(-1, grad.shape[-1])
            if call.kind == "embedding":
                g2 = g2 * _embedding_scale(m)
                if m.weight.requires_grad:
                    # the full weight's shape (a sharded one's too: _accumulate scatters it)
                    update = torch.zeros(m.weight.shape, dtype=m.weight.dtype, device=g2.device).index_add_(
                        0, x.reshape(-1), (g2 * w[:, None]).to(m.weight.dtype))
                    if m.padding_idx is not None:
                        update[m.padding_idx] = 0
                    _accumulate(m.weight, update)
            else:
                a2 = x.reshape(-1, x.shape[-1])
                if m.weight.requires_grad:
                    # B^T diag(w) A: scale whichever of A and B is narrower (the LM head's B is V wide)
                    if a2.shape[1] <= g2.shape[1]:
                        a2w, g2w = a2 * w[:, None].to(a2.dtype), g2
                    else:
                        a2w, g2w = a2, g2 * w[:, None].to(g2.dtype)
                    _accumulate(m.weight, a2w.T @ g2w if call.kind == "conv1d" else g2w.T @ a2w)
                if m.bias is not None and m.bias.requires_grad:
                    _accumulate(m.bias, w.to(g2.dtype) @ g2)

    # -- norms -----------------------------------------------------------------------------------------------
    @torch.no_grad()  # (the vjp replays ignore it; the experts rule enables grad for its gate)
    def sq_norms(self) -> Tensor:
        """[B] float64: sum over trainable parameters of ||per-sequence gradient||^2, tied weights exact."""
        self._check_unfrozen()
        self._check_complete()
        uses = defaultdict(list)  # id(param) -> [(kind, record, call)]
        params = {}
        for rec, call in self._uses():
            m = rec.module
            if call.kind == "embedding":
                kinds = [("embedding", m.weight)]
            elif call.kind in ("linear", "conv1d"):
                kinds = [(call.kind, m.weight)] + ([("bias", m.bias)] if m.bias is not None else [])
            elif call.kind == "generic":
                kinds = [(call.kind, p) for p in self._call_params(rec, call).values()]
            else:
                kinds = [(call.kind, p) for p in m.parameters(recurse=False)]
            for kind, p in kinds:
                if p is not None and p.requires_grad:
                    params[id(p)] = p
                    uses[id(p)].append((kind, rec, call))
        device = next(iter(params.values())).device if params else torch.device("cpu")
        total = torch.zeros(self.num_seqs, dtype=torch.float64, device=device)
        generic = {}  # id(call) -> its per-sequence gradients, formed once for all its parameters
        experts_done = set()
        for pid, use_list in uses.items():
            p = params[pid]
            kind, rec, call = use_list[0]
            if kind == "experts":
                if len(use_list) > 1 or any(len(uses[id(q)]) > 1 for q in rec.module.parameters(recurse=False)
                                            if q.requires_grad):
                    raise UnsupportedModuleError(rec.name, "experts weights used by more than one call")
                if id(call) not in experts_done:
                    experts_done.add(id(call))
                    total += self._experts_sq_norms(rec, call)
            elif len(use_list) == 1 and kind == "bias":
                total += self._single_use_norm(use_list[0]).double()
            elif all(u[0] in ("linear", "conv1d", "embedding") for u in use_list):
                total += self._tied_norm(use_list).double()  # one use, or a weight shared by embedding and head
            else:  # materialise each use's per-sequence gradient and add them before the norm
                g = sum(self._materialised(u, p, generic) for u in use_list)
                total += _acc(g).flatten(1).pow(2).sum(1).double()
        return total

    def forms(self) -> list:
        """[(module name, form)] per recorded call that reached the objective, in call order: how sq_norms()
        forms its weight's norm. "ghost" or "materialised" (linear layers, by _ghost_form over its rows),
        "same-token" (embeddings), "per-expert" (experts: ghost or materialised per expert), "replayed" (vjp)."""
        out = []
        for rec, call in self._uses():
            if call.kind in ("linear", "conv1d"):
                t = self._rows(call.args[0], rec.name).shape[1]
                ghost = _ghost_form(t, call.args[0].shape[-1], call.grads[0].shape[-1], self.ghost)
                out.append((rec.name, "ghost" if ghost else "materialised"))
            else:
                out.append((rec.name, {"embedding": "same-token", "experts": "per-expert"}.get(call.kind, "replayed")))
        return out

    def embedding_inner(self, module: nn.Embedding, rows: Tensor) -> Tensor:
        """[B] float64: <g_i, M_i> for the per-sequence gradient g_i of the recorded embedding `module`'s
        weight and matrices M_i given by their rows at the embedding's input ids, rows[i, t] = M_i[ids[i, t]]
        (padded layout): sum_t <d out_it, rows[i, t]>. With M_i another use's per-sequence gradient of a shared
        weight this is their cross term, e.g. for an LM head computed outside the recorded modules."""
        self._check_unfrozen()
        total = torch.zeros(self.num_seqs, dtype=torch.float64, device=rows.device)
        for rec, call in self._uses():
            if rec.module is not module:
                continue
            if call.kind != "embedding":
                raise UnsupportedModuleError(rec.name, "the cross term with a fused LM head needs a plain or scaled "
                                                       "embedding called with the input ids")
            ids = self._rows(call.args[0], rec.name, ids=True)
            if rows.shape[:2] != ids.shape:
                raise ValueError(f"rows must be [B, T, d] over the embedding's {tuple(ids.shape)} ids, got "
                                 f"{tuple(rows.shape)}")
            b = self._embedding_grad_rows(rec, call, ids)
            total += (b * rows.to(b.dtype)).sum((1, 2)).double()
        return total

    def _embedding_grad_rows(self, rec: _Record, call: _Call, ids: Tensor) -> Tensor:
        """[B, T, d]: the gradient reaching each looked-up row of the weight (scaled, padding rows zeroed)."""
        b = _acc(self._rows(call.grads[0], rec.name)) * _embedding_scale(rec.module)
        if rec.module.padding_idx is not None:
            b = b * (ids != rec.module.padding_idx).unsqueeze(-1)
        return b

    def _single_use_norm(self, use) -> Tensor:
        kind, rec, call = use
        if kind == "bias":
            return _acc(self._rows(call.grads[0], rec.name)).sum(1).pow(2).sum(1)
        if kind == "embedding":
            ids = self._rows(call.args[0], rec.name, ids=True)
            b = self._embedding_grad_rows(rec, call, ids)
            t = ids.shape[1]
            return _chunked(lambda ids, b: ((ids.unsqueeze(2) == ids.unsqueeze(1)) * torch.bmm(b, b.transpose(1, 2)))
                            .sum((1, 2)), ids, b, per_seq_elements=2 * t * t)
        return _linear_sq_norms(_acc(self._rows(call.args[0], rec.name)), _acc(self._rows(call.grads[0], rec.name)),
                                self.ghost)

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
            _, rec_e, call_e = u
            _, rec_l, call_l = v
            ids = self._rows(call_e.args[0], rec_e.name, ids=True)
            b_e = self._embedding_grad_rows(rec_e, call_e, ids)
            a_l = _acc(self._rows(call_l.args[0], rec_l.name))
            b_l = _acc(self._rows(call_l.grads[0], rec_l.name))
            inner = torch.bmm(a_l, b_e.transpose(1, 2))  # [B, T_l, T_e]: <A_s, B^emb_t>
            picked = torch.gather(b_l, 2, ids.unsqueeze(1).expand(-1, b_l.shape[1], -1))  # B^lin_{s, x_t}
            return (inner * picked).sum((1, 2))
        gu, gv = self._materialised(u, u[1].module.weight, {}), self._materialised(v, v[1].module.weight, {})
        return (_acc(gu) * _acc(gv)).flatten(1).sum(1)

    def _materialised(self, use, p: Tensor, cache: dict) -> Tensor:
        """[B, *param.shape]: the per-sequence gradient of `p` through this one use."""
        kind, rec, call = use
        m = rec.module
        if kind in ("linear", "conv1d"):
            g = torch.bmm(_acc(self._rows(call.grads[0], rec.name)).transpose(1, 2),
                          _acc(self._rows(call.args[0], rec.name)))
            return g.transpose(1, 2) if kind == "conv1d" else g
        if kind == "bias":
            return _acc(self._rows(call.grads[0], rec.name)).sum(1)
        if kind == "embedding":
            ids = self._rows(call.args[0], rec.name, ids=True)
            b = self._embedding_grad_rows(rec, call, ids)
            out = b.new_zeros((self.num_seqs, *m.weight.shape))
            out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, b.shape[-1]), b)
            return out
        if kind == "experts":
            raise UnsupportedModuleError(rec.name, "experts weights shared with another module")
        if id(call) not in cache:
            cache[id(call)] = self._generic_per_seq(rec, call)
        return cache[id(call)][id(p)]

    # -- any other module: per-sequence replays ------------------------------------------------------------
    def _replayable(self, rec: _Record, call: _Call):
        """(params, run, leaves, batched, live) to replay a module: run(params, inputs) calls it with the recorded
        arguments, the tensors at positions `batched` of the flattened arguments replaced by `inputs`, and returns
        its floating-point outputs that received a gradient, those at positions `live` of call.values."""
        m = rec.module
        params = {n: call.weights.get(n, p).detach() for n, p in self._call_params(rec, call).items()}
        leaves, spec = tree_flatten((call.args, call.kwargs))
        if self.cu_seqlens is None:
            batched = [j for j, t in enumerate(leaves) if isinstance(t, Tensor) and self._per_seq(t) is not None]
        else:
            batched = [j for j, t in enumerate(leaves) if isinstance(t, Tensor) and self._token_dim(t) is not None]

        def run(ps, inputs):
            full = list(leaves)
            for j, t in zip(batched, inputs):
                full[j] = t
            args, kwargs = tree_unflatten(full, spec)
            # tie_weights=False: a parameter also owned by a child (BERT's decoder bias) is replaced only where this
            # module uses it itself (or as an adopted child's parameter); the child's uses are its own record's
            outs = _floats(torch.func.functional_call(m, ps, args, kwargs, tie_weights=False))
            return tuple(outs[k] for k in live) if len(outs) == len(call.values) else tuple(outs)

        live = [k for k, g in enumerate(call.grads) if g is not None]  # the others add nothing to the vjp
        return params, run, leaves, batched, live

    def _per_seq_parts(self, x: Tensor, rec: _Record):
        """Padded: (x as [B, r, ...], vmap dim 0). Packed: (x with a unit dimension after the token one, so each
        token keeps x's rank, and the token dimension to vmap over)."""
        if self.cu_seqlens is None:
            return self._seq_major(x, rec.name), 0
        d = self._token_dim(x)
        if d is None:
            raise UnsupportedModuleError(rec.name, f"it returned shape {tuple(x.shape)}, not laid out by packed token")
        return x.unsqueeze(d + 1), d

    def _generic_per_seq(self, rec: _Record, call: _Call) -> dict:
        """{id(param): [B, *shape]}: the per-sequence gradients of a module's own parameters, by a vjp of the
        module replayed under vmap over sequences (padded) or tokens (packed, for modules that act on each token
        separately), else in a loop over sequences; every replay must reproduce the module's recorded output."""
        from torch.func import vjp, vmap

        params, run, leaves, batched, live = self._replayable(rec, call)
        values, cotangents = [call.values[k] for k in live], [call.grads[k] for k in live]
        ins = [self._per_seq_parts(leaves[j], rec) for j in batched]
        outs = [self._per_seq_parts(v, rec) for v in values]

        def one(inputs, cots):
            replay, pullback = vjp(lambda ps: run(ps, inputs), params)
            return replay, pullback(tuple(cots))[0]

        self._replaying = True
        try:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # vmap's "no batching rule, falling back" performance warnings
                    replay, grads = vmap(one, in_dims=([d for _, d in ins], [d for _, d in outs]), out_dims=(
                        tuple(d for _, d in outs), 0))([t for t, _ in ins],
                                                        [self._per_seq_parts(c, rec)[0] for c in cotangents])
                ok = len(replay) == len(outs) and all(_replay_matches(r, t, call) for r, (t, _) in zip(replay, outs))
            except Exception:  # data-dependent control flow, ops vmap cannot batch: replay sequence by sequence
                ok = False
            if ok and self.cu_seqlens is not None:  # per token: sum each sequence's tokens
                seq = self._token_seq(next(iter(grads.values())).device) if grads else None
                grads = {n: g.new_zeros((self.num_seqs, *g.shape[1:])).index_add_(0, seq, g) for n, g in grads.items()}
            if not ok:
                grads = self._generic_loop(rec, call, params, run, leaves, batched, values, cotangents)
        finally:
            self._replaying = False
        objs = self._call_params(rec, call)
        return {id(objs[n]): g for n, g in grads.items()}

    def _slice(self, x: Tensor, i: int) -> Tensor:
        """Sequence i's part of a batched tensor, with x's rank."""
        if self.cu_seqlens is None:
            r = self._per_seq(x)
            return x.narrow(0, i * r, r)
        start = sum(self._lengths[:i])
        return x.narrow(self._token_dim(x), start, self._lengths[i])

    def _generic_loop(self, rec, call, params, run, leaves, batched, values, cotangents) -> dict:
        from torch.func import vjp

        per = defaultdict(list)
        for i in range(self.num_seqs):
            try:
                replay, pullback = vjp(lambda ps: run(ps, [self._slice(leaves[j], i) for j in batched]), params)
            except Exception as err:  # e.g. a packed attention mask over all tokens, given one sequence's rows
                raise UnsupportedModuleError(rec.name, f"replaying {type(rec.module).__name__} on one sequence "
                                                       f"failed ({type(err).__name__}: {err})") from err
            if len(replay) != len(values) or not all(
                    _replay_matches(r, self._slice(v, i), call) for r, v in zip(replay, values)):
                raise UnsupportedModuleError(rec.name, f"{type(rec.module).__name__} replayed on one sequence does "
                                                       "not reproduce its output on the batch (it mixes sequences, is "
                                                       "random, e.g. dropout in train mode, or its inputs are not "
                                                       "laid out by sequence)")
            for n, g in pullback(tuple(self._slice(c, i) for c in cotangents))[0].items():
                per[n].append(g)
        return {n: torch.stack(gs) for n, gs in per.items()}

    def _generic_weighted(self, rec: _Record, call: _Call, coefficients: Tensor) -> dict:
        """{name: sum_i c_i g_i} for a module's own parameters: one vjp of the whole call, each output row's
        gradient scaled by its sequence's coefficient."""
        from torch.func import vjp

        params, run, leaves, batched, live = self._replayable(rec, call)
        values, cots = [call.values[k] for k in live], []
        for k in live:
            g = call.grads[k]
            c = coefficients.to(g.device, g.dtype)
            if self.cu_seqlens is None:  # [B r, ...]: r leading rows per sequence
                self._seq_major(g, rec.name)
                w = c.repeat_interleave(g.shape[0] // self.num_seqs).view(-1, *[1] * (g.dim() - 1))
            else:  # tokens along one dimension
                d = self._token_dim(g)
                self._seq_major(g, rec.name)
                w = c[self._token_seq(g.device)].view(*[1] * d, -1, *[1] * (g.dim() - d - 1))
            cots.append(g * w)
        self._replaying = True
        try:
            replay, pullback = vjp(lambda ps: run(ps, [leaves[j] for j in batched]), params)
        finally:
            self._replaying = False
        # an output broadcast to every row by the forward hook is replayed as the module's one shared row
        cots = [c.sum(0, keepdim=True) if r.shape[0] == 1 and c.shape[0] > 1 else c for r, c in zip(replay, cots)]
        if not all(_replay_matches(r, v[:1] if r.shape[0] == 1 else v, call) for r, v in zip(replay, values)):
            raise UnsupportedModuleError(rec.name, "replaying it does not reproduce its output (random?)")
        return pullback(tuple(cots))[0]

    # -- mixture-of-experts layers --------------------------------------------------------------------------
    def _expert_terms(self, rec: _Record, call: _Call) -> list:
        """A transformers experts module's per-expert terms, formed once per call: [(e, seq, parts)] with parts
        [(weight, dz, input rows, bias)] for its two projections over the (token, expert) pairs routed to e, and
        seq the sequence of each pair.

        Token t routed to expert e with weight r: z1 = W1[e] x + b1[e], a = gate(z1), z2 = W2[e] a + b2[e],
        out_t += r z2. So dW2[e] = sum dz2 a^T with dz2 = r dout_t, and dW1[e] = sum dz1 x^T with dz1 the
        gate's vjp of da = W2[e]^T dz2: each expert is two linear layers over its pairs. The output recomputed
        from these terms must match the module's."""
        if call.terms is not None:
            return call.terms
        m = rec.module
        if getattr(m, "_is_expert_parallel", False):
            raise UnsupportedModuleError(rec.name, "expert-parallel experts")
        try:
            names = list(inspect.signature(type(m).forward.__wrapped__).parameters)[1:4]
            bound = inspect.signature(type(m).forward.__wrapped__).bind(m, *call.args, **call.kwargs).arguments
            x, index, weight = (bound[n] for n in names)
        except (TypeError, KeyError, ValueError):
            raise UnsupportedModuleError(rec.name, "experts called with arguments other than (hidden states, expert "
                                                   "ids, routing weights)") from None
        gated = m.has_gate
        w1 = m.gate_up_proj if gated else m.up_proj
        b1 = (m.gate_up_proj_bias if gated else m.up_proj_bias) if m.has_bias else None
        w2, b2 = m.down_proj, (m.down_proj_bias if m.has_bias else None)
        transposed = m.is_transposed  # weights [E, in, out] rather than [E, out, in]
        x, dout = _acc(x), _acc(self._grad(call))
        seq_of_token = self._row_seq(x, rec.name)
        n, k = index.shape
        flat_e = index.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=w1.shape[0]).tolist()  # one host read
        token = torch.arange(n, device=x.device).repeat_interleave(k)
        route = _acc(weight).reshape(-1)
        replay = torch.zeros_like(x)
        terms, start = [], 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            sel = order[start:start + count]
            start += count
            tok, r = token[sel], route[sel, None]
            xe = x[tok]
            W1, W2 = _acc(w1[e].detach()), _acc(w2[e].detach())
            W1, W2 = (W1.T, W2.T) if transposed else (W1, W2)  # as [out, in]
            z1 = xe @ W1.T + (_acc(b1[e].detach()) if b1 is not None else 0)
            with torch.enable_grad():
                z1 = z1.detach().requires_grad_()
                a_graph = m._apply_gate(z1) if gated else m.act_fn(z1)
            a = a_graph.detach()
            z2 = a @ W2.T + (_acc(b2[e].detach()) if b2 is not None else 0)
            replay.index_add_(0, tok, z2 * r)
            dz2 = dout[tok] * r
            (dz1,) = torch.autograd.grad(a_graph, z1, dz2 @ W2)
            terms.append((e, seq_of_token[tok], [(w1, dz1, xe, b1), (w2, dz2, a, b2)]))
        if not _replay_matches(replay, call.values[0], call):
            raise UnsupportedModuleError(rec.name, f"{type(m).__name__} computes something other than the standard "
                                                   "routed experts (gate/up, activation, down, routing weight)")
        call.terms = terms
        return terms

    def _experts_sq_norms(self, rec: _Record, call: _Call) -> Tensor:
        """[B]: per-sequence squared norms of an experts module's weights, per expert ghost or materialised."""
        total = torch.zeros(self.num_seqs, dtype=torch.float64, device=call.values[0].device)
        for _, seq, parts in self._expert_terms(rec, call):
            # rows of each sequence's pairs, zero-padded: [B, L, d] with L the most pairs a sequence sent here
            per = torch.bincount(seq, minlength=self.num_seqs)
            pos = torch.arange(seq.numel(), device=seq.device) - (torch.cumsum(per, 0) - per)[seq]
            length = int(per.max())
            for w, dz, inp, bias in parts:
                if w.requires_grad:
                    rows_a = inp.new_zeros(self.num_seqs, length, inp.shape[1]).index_put_((seq, pos), inp)
                    rows_b = dz.new_zeros(self.num_seqs, length, dz.shape[1]).index_put_((seq, pos), dz)
                    total += _linear_sq_norms(rows_a, rows_b, self.ghost).double()
                if bias is not None and bias.requires_grad:
                    total += dz.new_zeros(self.num_seqs, dz.shape[1]).index_add_(0, seq, dz).pow(2).sum(1).double()
        return total

    def _experts_assemble(self, rec: _Record, call: _Call, coefficients: Tensor) -> None:
        """sum_i c_i g_i into an experts module's weights: (c dz)^T x per expert."""
        transposed = rec.module.is_transposed
        for e, seq, parts in self._expert_terms(rec, call):
            for w, dz, inp, bias in parts:
                c = coefficients.to(dz.device, dz.dtype)[seq, None]
                if w.requires_grad:
                    gw = (dz * c).T @ inp
                    w.grad = torch.zeros_like(w) if w.grad is None else w.grad
                    w.grad[e] += (gw.T if transposed else gw).to(w.dtype)
                if bias is not None and bias.requires_grad:
                    bias.grad = torch.zeros_like(bias) if bias.grad is None else bias.grad
                    bias.grad[e] += (c * dz).sum(0).to(bias.dtype)
