"""Gloo ranks on the CPU for a test: `on_ranks(fn, *args)` runs `fn(rank, *args)` in `world` processes
(torch.multiprocessing.spawn), each with torch.distributed's default group initialised, and returns what each rank
returned, in rank order. A launch costs seconds (every process imports torch and vcpo), so a test file launches once,
from a module-scoped fixture, computes all its cases there and asserts on the results. `fn` must be a module-level
function (the processes import it by name)."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vcpo.distributed import init_process_group


def _rank_main(rank: int, world: int, folder: str, fn, args: tuple) -> None:
    init_process_group(backend="gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, *args), os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while its peer is still in a collective
    finally:
        dist.destroy_process_group()


def on_ranks(fn, *args, world: int = 2) -> list:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank_main, args=(world, folder, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]
