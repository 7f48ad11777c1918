"""FSDP2 start-up (`--fsdp`): only rank 0 reads the weights; every other rank builds the model on the meta device
and receives its shard from rank 0, so no rank but 0 ever holds the whole model. On 2 gloo ranks: the sharded
model's full weights, gathered back, equal the files' bit for bit; every rank's buffers (the rotary embedding's
inverse frequencies, in no state dict) equal rank 0's; rank 1's model was on the meta device until then."""

import os
import types

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from support.ranks import on_ranks
from support.tiny_models import save_tiny_model


def _start(rank, folder):
    from vcpo.trainer.placement.fsdp import full_weights
    from vcpo.trainer.policy import FullModel, Sharded

    ranks = types.SimpleNamespace(main=rank == 0, device=torch.device("cpu"), world=2, group=dist.group.WORLD)
    model = FullModel(torch.float32).load(folder) if rank == 0 else FullModel(torch.float32).skeleton(folder)
    meta_before = all(p.is_meta for p in model.parameters())
    placement = Sharded(model, ranks)
    gathered = full_weights(model, ranks)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return {"meta_before": meta_before, "gathered": gathered, "buffers": buffers,
            "local": sum(p.to_local().numel() for p in model.parameters()),
            "total": sum(p.numel() for p in model.parameters()), "first": placement.full_weights() is not None}


def test_only_rank_0_reads_the_weights_and_every_rank_gets_its_shard(tmp_path):
    folder = save_tiny_model(tmp_path / "model")
    rank0, rank1 = on_ranks(_start, folder)
    assert not rank0["meta_before"] and rank1["meta_before"]  # rank 1 never had the weights
    files = load_file(os.path.join(folder, "model.safetensors"))
    gathered = rank0["gathered"]
    assert rank1["gathered"] is None and set(files) <= set(gathered)
    for name, tensor in files.items():
        assert torch.equal(gathered[name], tensor), name
    assert rank0["buffers"].keys() == rank1["buffers"].keys() and rank0["buffers"]
    for name, b in rank0["buffers"].items():
        assert torch.equal(rank1["buffers"][name], b) and torch.isfinite(b).all(), name
    for r in (rank0, rank1):  # each rank holds about half the parameters
        assert r["local"] < 0.6 * r["total"]
    assert rank0["first"] and not rank1["first"]  # rank 0 keeps the engine's first weights
