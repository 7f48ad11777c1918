"""Trainer ranks (docs/trainer.md, "Trainer ranks"): `torchrun --nproc-per-node N -m vcpo.trainer ...` or
`vcpo train --trainer-ranks N`. Rank 0 alone talks to the engine and writes the run folder; every consumed
batch goes from rank 0 to the ranks by whole prompt groups (the same number of sequences each), as tensors
(`torch.distributed` broadcast of a header, then scatter: no pickled objects over the wire); every rank then
takes the same `vcpo.step` with the data-parallel process group, whose ESS, lr scale, baselines and loss
normalisation are the whole batch's. The replicas stay identical, so a checkpoint is one rank's state and
resumes with any number of ranks."""

from __future__ import annotations

import datetime
import gc
import os
from typing import Optional

import torch
import torch.distributed as dist

from vcpo.distributed import init_process_group
from vcpo.step import RolloutBatch

# header[0] of each message from rank 0
STOP, BATCH, SAVE = 0, 1, 2


def launched_ranks() -> int:
    """The number of trainer ranks this process was launched among (torchrun's WORLD_SIZE), 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class TrainerRanks:
    """This process's place among the trainer ranks, and the messages of rank 0 to the others."""

    def __init__(self, expected: int, groups: int, timeout_s: float) -> None:
        self.world = launched_ranks()
        if self.world != expected:
            raise ValueError(f"trainer_ranks is {expected} but this process was launched among {self.world} "
                             "(torchrun --nproc-per-node): set --trainer-ranks to the number launched")
        self.groups_per_rank = groups // self.world
        self.group = None
        self.rank, self.local_rank = 0, 0
        self.on_save = None  # FSDP2: what every rank does for rank 0's checkpoint (gather the optimizer state)
        if self.world > 1:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if backend == "nccl":
                torch.cuda.set_device(self.local_rank)
            # collectives wait for rank 0's next batch, which may take as long as the engine's generation
            init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
            self.rank = dist.get_rank()
            self.group = dist.group.WORLD

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device(f"cuda:{self.local_rank}") if torch.cuda.is_available() else torch.device("cpu")

    def same_weights(self, model: torch.nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP does at construction)."""
        if self.world == 1:
            return
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0, group=self.group)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    # -- rank 0 -------------------------------------------------------------------------------------------------------
    def scatter(self, batch: RolloutBatch) -> RolloutBatch:
        """Rank 0: send each rank its prompt groups of `batch` (groups in order, `groups_per_rank` each);
        returns rank 0's own share."""
        if self.world == 1:
            return batch
        b, t = batch.input_ids.shape
        self._header(BATCH, b // self.world, t)
        return self._receive_share(_split(batch, self.world, self._wire), b // self.world, t)

    def save(self) -> None:
        """Rank 0, about to checkpoint: the other ranks run `on_save` (each message waits for all ranks)."""
        if self.world > 1:
            self._header(SAVE, 0, 0)

    def stop(self) -> None:
        """Rank 0: the other ranks leave their loop (the run ended, was interrupted or failed)."""
        if self.world > 1:
            self._header(STOP, 0, 0)

    def _header(self, kind: int, rows: int, width: int) -> None:
        dist.broadcast(torch.tensor([kind, rows, width], dtype=torch.long, device=self._wire), src=0, group=self.group)

    # -- every rank ---------------------------------------------------------------------------------------------------
    def receive(self) -> Optional[RolloutBatch]:
        """A rank > 0: its share of the next batch, or None when rank 0 says stop (`on_save` for each save
        message before them)."""
        header = torch.empty(3, dtype=torch.long, device=self._wire)
        while True:
            dist.broadcast(header, src=0, group=self.group)
            kind, rows, width = header.tolist()
            if kind != SAVE:
                return None if kind == STOP else self._receive_share(None, rows, width)
            self.on_save()

    def _receive_share(self, parts: Optional[list], rows: int, width: int) -> RolloutBatch:
        """Scatter (rank 0 sends `parts`, one packed tuple per rank) and unpack this rank's share."""
        ints = torch.empty(3, rows, width, dtype=torch.long, device=self._wire)
        floats = torch.empty(rows, width + 1, dtype=torch.float32, device=self._wire)
        dist.scatter(ints, None if parts is None else [p[0] for p in parts], src=0, group=self.group)
        dist.scatter(floats, None if parts is None else [p[1] for p in parts], src=0, group=self.group)
        first = self.rank * self.groups_per_rank
        group = first + torch.arange(self.groups_per_rank).repeat_interleave(rows // self.groups_per_rank)
        ids, attn, loss_mask = (x.to(self.device) for x in ints)
        floats = floats.to(self.device)
        return RolloutBatch(ids, attn, loss_mask, floats[:, :width], floats[:, width],
                            group_index=group.to(self.device), num_groups=self.groups_per_rank * self.world)

    @property
    def _wire(self) -> torch.device:
        """Where the messages live: NCCL moves CUDA tensors, gloo CPU ones."""
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def close(self, ended: bool = True) -> None:
        """Every rank, at the end: free the process group while Python still runs, after the others have `ended`
        too (a barrier: only after a run that ended, as a failed rank's peers may be inside another collective).
        A gloo group still referenced when the interpreter exits aborts its process now and then ("terminate
        called without an active exception"), most often on a rank that leaves while rank 0 is still stopping
        the engine."""
        if self.world > 1 and dist.is_initialized():
            if ended:
                dist.barrier(group=self.group)
            self.group, self.on_save = None, None  # on_save holds the Policy, which holds the group
            dist.destroy_process_group()
            gc.collect()


def _split(batch: RolloutBatch, world: int, wire: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r's rows of `batch`, packed on `wire`: ([3, rows, T] ids / attention mask / loss mask, [rows, T + 1]
    behaviour log-probs with the reward in the last column)."""
    ints = torch.stack([batch.input_ids, batch.attention_mask.long(), batch.loss_mask.long()]).to(wire)
    floats = torch.cat([batch.behavior_logp.float(), batch.rewards.float()[:, None]], 1).to(wire)
    rows = batch.input_ids.shape[0] // world
    return [(ints[:, r * rows:(r + 1) * rows].contiguous(), floats[r * rows:(r + 1) * rows].contiguous())
            for r in range(world)]


def launch_ranks(count: int, argv: list) -> None:
    """`vcpo train --trainer-ranks N ARGS` on one machine: this process becomes `torchrun --standalone
    --nproc-per-node N -m vcpo.trainer ARGS` (a signal to it reaches every rank through torchrun)."""
    import sys

    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={count}", "-m", "vcpo.trainer", *argv])
