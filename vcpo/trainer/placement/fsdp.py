"""FSDP2 over the trainer ranks (`--fsdp`; docs/scale.md, "FSDP2"): the model sharded, its full weights and optimizer
state gathered to rank 0 for the engine and the checkpoints, and a checkpoint's optimizer state scattered back on
resume. The optimizer state is kept in torch.optim's own layout, so a checkpoint resumes with or without FSDP."""

from __future__ import annotations

from typing import Optional

import torch

from .ranks import TrainerRanks


def shard(model: torch.nn.Module, ranks: TrainerRanks, compute_dtype: Optional[str] = None) -> None:
    """FSDP2 over the trainer ranks' 1-D mesh: each decoder layer (the classes a Hugging Face model lists in
    `_no_split_modules`) is one unit, all-gathered for its forward and backward, then the rest of the model (the
    embeddings, final norm and LM head, a tied head with its embedding). The shards keep the parameters' dtype;
    with `compute_dtype` ("bfloat16": bf16-mixed) the units are gathered in it and the gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ranks.device.type, (ranks.world,))
    policy = MixedPrecisionPolicy() if compute_dtype is None else \
        MixedPrecisionPolicy(param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32)
    units = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in units:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def load_full_weights(model: torch.nn.Module, weights: Optional[dict], ranks: TrainerRanks) -> None:
    """Every rank, after shard(): rank 0's full `weights` (its state dict; None on the others) into the sharded
    model, each tensor broadcast from rank 0 and cut to the ranks' shards, and rank 0's buffers (a rotary
    embedding's inverse frequencies are in no state dict). A rank whose model is on the meta device (it read no
    weights) first gets its shards' storage on its device."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=ranks.device)
    set_model_state_dict(model, weights if ranks.main else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0, group=ranks.group)


def _full(trainable_only: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # every rank takes part; each tensor is gathered, moved to the CPU of rank 0 alone, and freed on the device
    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)


def full_weights(model: torch.nn.Module, ranks: TrainerRanks, trainable_only: bool = False) -> Optional[dict]:
    """Every rank: the sharded model's full state dict (`trainable_only`: its trainable parameters alone, a LoRA
    adapter), gathered one tensor at a time; on rank 0 (CPU tensors), None on the others."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = get_model_state_dict(model, options=_full(trainable_only))
    return weights if ranks.main else None


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         ranks: TrainerRanks) -> Optional[dict]:
    """Every rank: the sharded optimizer's state gathered to rank 0 in torch.optim's own layout (parameters by
    their index in model.parameters()), which a run without FSDP loads as it is; None on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer, options=_full())
    if not ranks.main:
        return None
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    return {"state": {index[name]: v for name, v in state["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]]}


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Optional[dict],
                              ranks: TrainerRanks) -> None:
    """Every rank: rank 0's `state` (torch.optim's layout, as full_optimizer_state gives it) into the sharded
    optimizer, each tensor broadcast from rank 0 and cut to the ranks' shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = [name for name, _ in model.named_parameters()]
    named = {} if not ranks.main else {
        "state": {names[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, named,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
