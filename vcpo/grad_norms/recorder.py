"""The recorder: hooks on every module with trainable parameters keep each call's inputs and output gradients,
and a watch refuses a parameter used where the hooks cannot see it; from the records, each kind of layer's rule
(linear.py, embedding.py, experts.py, replay.py, tied.py; fsdp.py for sharded models) forms the per-sequence squared
norms and the gradient sum_i c_i g_i (docs/grad_norms.md)."""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from . import embedding, experts, linear, replay, tied
from .fsdp import ShardedParameters, accumulate
from .layout import SequenceLayout
from .records import Call, Record, UnsupportedModuleError, acc, call_params, floats

# A closed-form rule is used only where the module's forward is exactly the op of that rule: the class's forward
# is nn.Linear's / nn.Embedding's / transformers' Conv1D's, a registered scaled embedding, or transformers'
# mixture-of-experts dispatcher. Every other module with parameters is replayed per sequence ("generic").


def rule(module: nn.Module) -> str:
    if type(module).forward is nn.Linear.forward:
        return "linear"
    if embedding.embedding_scale(module) is not None:
        return "embedding"
    if linear.is_conv1d(module):
        return "conv1d"
    if experts.is_experts(module):
        return "experts"
    return "generic"


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


def _recomputing() -> bool:
    """Whether this forward is a non-reentrant torch.utils.checkpoint segment recomputed in the backward: its graph
    only refills the saved tensors of the first forward's, through which the gradients flow (and are recorded), so
    a record of it would never receive one and would hold the segment's inputs a second time until release()."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)  # private: absent, record as before
    hooks = top(True) if top is not None else None
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook.")


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
                or not floats(out)):
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
        self.model = model
        self.layout = SequenceLayout(num_seqs, cu_seqlens, seq_len)
        self.ghost = ghost  # None: cheaper of ghost and materialised per layer; True/False forces one
        self.modules = None if modules is None else list(modules)  # None: every module with parameters
        # freeze_parameters: inside the block trainable parameters do not require grad, so the forward keeps
        # only what activation gradients need (not the inputs of weight gradients) and module outputs start
        # the graph; for a norm pass followed by assemble(), never by a backward to the parameters.
        self.freeze_parameters = freeze_parameters
        self._frozen: list = []
        self._records: list[Record] = []
        self._handles = []
        self._replaying_now = False  # see _replaying
        self._paused = False
        self._owners: dict = {}  # id(param) -> the recorded modules that own it
        self._param_names: dict = {}  # id(param) -> its name in the model
        self._active: dict = defaultdict(int)  # id(module) -> calls of it in progress
        self._outside: list = []  # (parameter, op): uses seen outside their modules' forward, not adopted
        self._stack: list = []  # the recorded modules whose forward is in progress, outermost first
        self._watch: Optional[_ParameterWatch] = None
        self._sharded: Optional[ShardedParameters] = None  # FSDP2's, from __enter__

    # -- recording ---------------------------------------------------------------------------------------
    def __enter__(self) -> "PerSequenceGradients":
        self._param_names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        self._sharded = ShardedParameters(self.model)
        owned = defaultdict(list)  # id(param) -> every module that has it as its own parameter
        for name, module in self.model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            for p in params:
                owned[id(p)].append(module)
            if not params or (self.modules is not None and not any(module is m for m in self.modules)):
                continue
            name = name or type(module).__name__
            kind = rule(module)
            if kind == "embedding" and (module.scale_grad_by_freq or module.sparse):
                raise UnsupportedModuleError(name, "an embedding with scale_grad_by_freq or sparse gradients")
            record = Record(module, name, kind, path=name if module is not self.model else "")
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
        for p, sharded in self._sharded.swapped_in(module):  # FSDP2's unsharded parameters stand for the sharded
            self._owners[id(p)] = self._owners.get(id(sharded), [])
            self._param_names[id(p)] = self._param_names[id(sharded)]

    def _exit_hook(self, module, args, output):
        self._active[id(module)] -= 1

    def _forward_hook(self, record: Record):
        def hook(module, args, kwargs, output):
            adopted, record.adopted = record.adopted, {}
            if self._replaying_now or not torch.is_grad_enabled() or _recomputing():
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
            if (kind in ("embedding", "generic") and self.layout.cu_seqlens is None and self.layout.num_seqs > 1
                    and all(leaves[j].dim() >= 2 and leaves[j].shape[0] == 1 for j in slots)):
                # An output shared by every row (GPT-2's or BART's position embeddings of [1, T] positions) is
                # broadcast by the add that follows; broadcasting it here keeps each row's gradient apart.
                # Same values, a view.
                for j in slots:
                    leaves[j] = leaves[j].expand(self.layout.num_seqs, *leaves[j].shape[1:])
                if kind == "embedding":
                    args = (args[0].expand(self.layout.num_seqs, *args[0].shape[1:]),)
            detach = lambda t: t.detach() if isinstance(t, Tensor) else t  # noqa: E731
            outs = [leaves[j] for j in slots]
            call = Call(kind, tree_map(detach, tuple(args)), tree_map(detach, dict(kwargs)), [None] * len(outs),
                         [o.detach() for o in outs] if kind in ("experts", "generic") else [], [None] * len(outs),
                         adopted)
            # A kept tensor the model later modifies in place (XLM masks its embeddings with *=) no longer holds
            # what the module saw: checked before use (detached tensors share the version counter).
            call.versions = [(t, t._version) for t in tree_flatten((call.args, call.kwargs, call.values))[0]
                             if isinstance(t, Tensor)]
            if self._sharded and kind in ("generic", "experts"):
                if kind == "experts":
                    raise UnsupportedModuleError(record.name, "experts weights sharded by FSDP2")
                call.weights, call.adopted = self._sharded.for_replay(module, adopted)
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
    def _grad_hook(call: Call, k: int):
        def hook(grad):
            # The first gradient is the recorded one (a second backward through a kept graph must not replace
            # it); the output itself is no longer needed.
            if grad is not None and call.grads[k] is None:
                call.grads[k] = grad.detach()
                call.outputs[k] = None

        return hook

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

    @contextmanager
    def _replaying(self):
        """A replay of a module (for its per-sequence gradients) must not record again."""
        self._replaying_now = True
        try:
            yield
        finally:
            self._replaying_now = False

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
        if coefficients.shape != (self.layout.num_seqs,):
            raise ValueError(f"coefficients must have shape [num_seqs] = [{self.layout.num_seqs}]")
        for rec, call in self._uses():
            if call.kind == "experts":
                experts.assemble(self.layout, rec, call, coefficients)
            elif call.kind == "generic":
                params = call_params(rec, call)
                for n, update in replay.weighted(self.layout, rec, call, coefficients, self._replaying).items():
                    accumulate(params[n], update)
            elif call.kind == "embedding":
                embedding.assemble(self.layout, rec, call, coefficients)
            else:
                linear.assemble(self.layout, rec, call, coefficients)

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
                kinds = [(call.kind, p) for p in call_params(rec, call).values()]
            else:
                kinds = [(call.kind, p) for p in m.parameters(recurse=False)]
            for kind, p in kinds:
                if p is not None and p.requires_grad:
                    params[id(p)] = p
                    uses[id(p)].append((kind, rec, call))
        device = next(iter(params.values())).device if params else torch.device("cpu")
        total = torch.zeros(self.layout.num_seqs, dtype=torch.float64, device=device)
        replayed = {}  # id(call) -> its per-sequence gradients, formed once for all its parameters
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
                    total += experts.sq_norms(self.layout, rec, call, self.ghost)
            elif len(use_list) == 1 and kind == "bias":
                total += linear.bias_sq_norms(self.layout, rec, call).double()
            elif all(u[0] in ("linear", "conv1d", "embedding") for u in use_list):
                total += tied.sq_norms(self.layout, use_list, self.ghost).double()  # one use, or a tied weight
            else:  # materialise each use's per-sequence gradient and add them before the norm
                g = sum(tied.per_seq(self.layout, u, p, replayed, self._replaying) for u in use_list)
                total += acc(g).flatten(1).pow(2).sum(1).double()
        return total

    def forms(self) -> list:
        """[(module name, form)] per recorded call that reached the objective, in call order: how sq_norms()
        forms its weight's norm. "ghost" or "materialised" (linear layers, by linear.ghost_form over its rows),
        "same-token" (embeddings), "per-expert" (experts: ghost or materialised per expert), "replayed" (vjp)."""
        out = []
        for rec, call in self._uses():
            if call.kind in ("linear", "conv1d"):
                out.append((rec.name, linear.form(self.layout, rec, call, self.ghost)))
            else:
                out.append((rec.name, {"embedding": "same-token", "experts": "per-expert"}.get(call.kind, "replayed")))
        return out

    def embedding_inner(self, module: nn.Embedding, rows: Tensor) -> Tensor:
        """[B] float64: <g_i, M_i> for the per-sequence gradient g_i of the recorded embedding `module`'s
        weight and matrices M_i given by their rows at the embedding's input ids, rows[i, t] = M_i[ids[i, t]]
        (padded layout): sum_t <d out_it, rows[i, t]>. With M_i another use's per-sequence gradient of a shared
        weight this is their cross term, e.g. for an LM head computed outside the recorded modules."""
        self._check_unfrozen()
        total = torch.zeros(self.layout.num_seqs, dtype=torch.float64, device=rows.device)
        for rec, call in self._uses():
            if rec.module is not module:
                continue
            if call.kind != "embedding":
                raise UnsupportedModuleError(rec.name, "the cross term with a fused LM head needs a plain or scaled "
                                                       "embedding called with the input ids")
            total += embedding.inner(self.layout, rec, call, rows).double()
        return total
