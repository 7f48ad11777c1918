"""Models sharded by FSDP2 (DTensor parameters): during a module's forward FSDP2 swaps in unsharded copies of its
parameters, which stand for the sharded ones; after it frees them, so a module replayed later uses copies; and an
assembled gradient is reduce-scattered into each rank's shard (docs/grad_norms.md)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial


def accumulate(p: Tensor, update: Tensor) -> None:
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


class ShardedParameters:
    """The sharded parameters of a model and the unsharded ones FSDP2 swaps in for them (empty, and false, for a
    model that is not sharded)."""

    def __init__(self, model: nn.Module):
        # (id(module), name) -> the sharded parameter; id(unsharded parameter) -> the sharded one
        self._by_module = {(id(m), n): p for m in model.modules() for n, p in m.named_parameters(recurse=False)
                           if isinstance(p, DTensor)}
        self._of: dict = {}

    def __bool__(self) -> bool:
        return bool(self._by_module)

    def swapped_in(self, module: nn.Module) -> list:
        """[(unsharded, sharded)]: the parameters FSDP2 swapped into `module` for its forward (its hooks run
        before ours) that were not seen before; each stands for its sharded one from now on."""
        new = []
        if not self._by_module:
            return new
        for n, p in module.named_parameters(recurse=False):
            sharded = self._by_module.get((id(module), n))
            if sharded is not None and id(p) not in self._of:
                self._of[id(p)] = sharded
                new.append((p, sharded))
        return new

    def for_replay(self, module: nn.Module, adopted: dict) -> tuple:
        """(copies of the unsharded values a call of `module` used, by name, its adopted parameters as the sharded
        ones): FSDP2 frees the unsharded weights after the forward, before the call is replayed."""
        used = {**dict(module.named_parameters(recurse=False)), **adopted}
        return ({n: p.detach().clone() for n, p in used.items()},
                {n: self._of.get(id(p), p) for n, p in adopted.items()})
