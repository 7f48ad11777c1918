"""The micro-batch size from a memory budget: `MicroBatchFit` runs `vcpo.step` at one and two prompt groups per
micro-batch, fits the step's peak memory as a fixed part plus a cost per padded token, and from then on picks the
largest whole number of groups per micro-batch that the budget holds (docs/grad_norms.md, "Choosing `m` for a
memory budget")."""

from __future__ import annotations

import ctypes
import math
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .config import VCPOConfig
from .step import RolloutBatch, step

GIB = 2 ** 30


def peak_reset(device: torch.device) -> int:
    """Start a new peak (the CUDA allocator's, or the process's resident set peak, VmHWM, on a CPU); returns the
    bytes in use now, by the same measure."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the present resident set (Linux)
            f.write("5")
    except OSError as e:
        raise RuntimeError(f"MicroBatchFit measures a CPU step's peak by resetting /proc/self/clear_refs, which "
                           f"failed here ({e}): on this system give micro_batch_size instead") from None
    return _status_bytes("VmRSS")


def _trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's malloc_trim), so that the resident set is what
    is in use: memory freed earlier and kept by the allocator would otherwise hide a step's growth."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return
    trim(0)


def peak_bytes(device: torch.device) -> int:
    """The peak since peak_reset: the memory CUDA tensors took on `device`, or the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status: MicroBatchFit cannot measure a CPU step's memory here")


class MicroBatchFit:
    """`vcpo.step` with the micro-batch size a memory budget holds.

        fit = vcpo.MicroBatchFit(budget_gib=70)
        metrics = fit.step(model, optimizer, batch, config)   # in place of vcpo.step(...)

    Steps 1 and 2 run one prompt group per micro-batch (step 1 warms up: the optimizer's state and the gradients
    are made in it), step 3 two groups, unless step 2 predicts that two would not fit (what it added to the memory
    it started with, twice): then one again. The peaks of steps 2 and 3 give the fixed part F and the cost c of a
    padded token (from step 2 alone, F its starting memory, when both ran one group). From step 4 on, a batch
    padded to T columns gets the largest multiple of its largest group that keeps F + c m T within (1 - margin)
    of the budget: the whole batch if it fits, one group with a warning if even that does not; with no cost
    measured (the peaks did not grow), the larger measured size whose peak kept within. Every step is an exact
    `vcpo.step`: micro-batches change the summation order, not the update. The peak is the CUDA allocator's on
    the parameters' device (`torch.cuda.max_memory_allocated`; the caching allocator reserves more, hence the
    margin), or the process's peak resident set on a CPU. With a process_group the ranks take the smallest of
    their sizes."""

    def __init__(self, budget_gib: float, margin: float = 0.1) -> None:
        if isinstance(budget_gib, bool) or not isinstance(budget_gib, (int, float)) or not budget_gib > 0:
            raise ValueError(f"budget_gib must be a number > 0, got {budget_gib!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        self.budget = float(budget_gib) * GIB
        self.margin = float(margin)
        # steps 2 and 3: (sequences of a micro-batch, its padded tokens, bytes in use at the start, peak bytes)
        self.points: list[tuple[int, int, int, int]] = []
        self.steps = 0
        self.fixed: Optional[float] = None  # F and c, once fitted
        self.per_token: Optional[float] = None
        self.size: Optional[int] = None  # the micro_batch_size of the last step (None: the whole batch)

    @property
    def room(self) -> float:
        """The bytes a step may take: the budget less its margin."""
        return self.budget * (1 - self.margin)

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
             config: Optional[VCPOConfig] = None, process_group=None) -> dict:
        """vcpo.step(model, optimizer, batch, config, process_group) at the fitted micro-batch size."""
        config = config if config is not None else VCPOConfig()
        if config.micro_batch_size is not None:
            raise ValueError(f"MicroBatchFit chooses micro_batch_size; the config sets it to "
                             f"{config.micro_batch_size}: give one or the other")
        device = next(model.parameters()).device
        group, count, width = self._shape(batch)
        size = self._choose(group, count, width, device, process_group)
        self.size = size
        measured = self.steps in (1, 2)
        if measured:
            start = peak_reset(device)
        metrics = step(model, optimizer, batch, config.replace(micro_batch_size=size), process_group=process_group)
        if measured:
            self.points.append((size or count, (size or count) * width, start, peak_bytes(device)))
        self.steps += 1
        if self.steps == 3:
            self._fit()
        return metrics

    @staticmethod
    def _shape(batch: RolloutBatch) -> tuple[int, int, int]:
        """(sequences in the largest prompt group, sequences, padded columns) of a batch."""
        count, width = batch.input_ids.shape
        if batch.group_index is None or count == 0:
            return count, count, width
        return int(torch.bincount(batch.group_index.long()).max()), count, width

    def _choose(self, group: int, count: int, width: int, device: torch.device, process_group) -> Optional[int]:
        if self.steps < 2:
            size = group
        elif self.steps == 2:  # two groups, unless step 2 says they would not fit
            _, tokens, start, peak = self.points[0]
            size = 2 * group if peak + (peak - start) / tokens * (2 * group * width - tokens) <= self.room else group
        elif self.per_token is None:
            within = [n for n, _, _, peak in self.points if peak <= self.room]
            size = max(within, default=group)
        else:
            size = group * max(0, math.floor((self.room - self.fixed) / (self.per_token * width * group)))
            if size == 0:
                warnings.warn(f"MicroBatchFit: one prompt group ({group} sequences x {width} columns) needs about "
                              f"{(self.fixed + self.per_token * group * width) / GIB:.2f} GiB, over the budget of "
                              f"{self.budget / GIB:.2f} GiB less its {self.margin:.0%} margin; running one group per "
                              "micro-batch", stacklevel=3)
                size = group
        if process_group is not None:
            agreed = torch.tensor([size], dtype=torch.long, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=process_group)
            size = int(agreed)
        return None if size >= count else size

    def _fit(self) -> None:
        """F and c from the peaks of steps 2 and 3, or from step 2 alone (F its starting memory) when both ran as
        many tokens; none when the peak did not grow."""
        (_, t1, s1, p1), (_, t2, _, p2) = self.points
        if t2 > t1 and p2 > p1:
            self.per_token = (p2 - p1) / (t2 - t1)
            self.fixed = p1 - self.per_token * t1
        elif t2 <= t1 and p1 > s1:
            self.per_token, self.fixed = (p1 - s1) / t1, float(s1)

    def describe(self) -> str:
        """The fit in words, for a log."""
        if self.steps < 3:
            return f"measuring (step {self.steps} of 3)"
        size = self.size if self.size is not None else "the whole batch"
        if self.per_token is None:
            return (f"no cost per token measured (peaks {[p for *_, p in self.points]} bytes): micro_batch_size "
                    f"{size}")
        return (f"{self.fixed / GIB:.2f} GiB fixed + {self.per_token / 2 ** 20:.3f} MiB a padded token; budget "
                f"{self.budget / GIB:.2f} GiB, margin {self.margin:.0%}: micro_batch_size {size}")
