"""What the bench scripts share: the memory of this process, the CPU time of the whole machine (how much other work
ran during a measurement), the options of a plain GRPO step, the forms the per-sequence norms took in a step, and
a rank's share of a batch.

The scripts run as `.venv/bin/python bench/X.py` from the repository root, so their own folder comes first on
sys.path and `import common` finds this file (bench/conftest.py imports it the same way under pytest). Only the
standard library is imported here at import time: a script's parent process stays light, and torch and vcpo are
imported where they are used.
"""

from __future__ import annotations

import contextlib
import os
import resource

# VCPOConfig options of a plain GRPO step: group-mean advantages, no per-sequence norms, no lr rule, no IS correction
GRPO = dict(advantage="grpo", grad_norms="uniform", lr_rule=None, is_correction="none")

# layer kind -> the last part of the names of its linear layers (a Llama's), for form_counts
LAYER_KINDS = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj"),
               "head": ("lm_head",)}


def status_mib(field: str) -> float:
    """A memory line of /proc/self/status in MiB: VmRSS (resident now) or VmHWM (its peak); NaN if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib() -> float:
    """Current resident set size of this process in MiB."""
    return status_mib("VmRSS")


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds():
    """(CPU seconds all processes were busy, CPU seconds of this process and its children), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except OSError:
        return None
    t = os.times()  # children too: torch.compile runs the C++ compiler as a subprocess, scripts run cases in them
    own = t.user + t.system + t.children_user + t.children_system
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own


def other_cpu_seconds(start, end) -> float:
    """CPU seconds that other processes used between two cpu_seconds() readings; NaN where either is None."""
    if not start or not end:
        return float("nan")
    return (end[0] - start[0]) - (end[1] - start[1])


@contextlib.contextmanager
def norm_forms():
    """Inside the block, the forms (ghost or materialised) in which vcpo.PerSequenceGradients computes each recorded
    call's norm, as (layer name, form) pairs appended to the list this yields as the step forms its norms."""
    import vcpo

    forms, sq_norms = [], vcpo.PerSequenceGradients.sq_norms

    def spy(psg):
        out = sq_norms(psg)
        forms.extend(psg.forms())
        return out

    vcpo.PerSequenceGradients.sq_norms = spy
    try:
        yield forms
    finally:
        vcpo.PerSequenceGradients.sq_norms = sq_norms


def form_counts(forms: list) -> str:
    """Per layer kind, how many of its recorded calls took the ghost (g) and materialised (m) norm."""
    cells = []
    for kind, names in LAYER_KINDS.items():
        got = [f for n, f in forms if n.rsplit(".", 1)[-1] in names]
        cells.append(f"{kind} " + "+".join(f"{got.count(f)}{f[0]}" for f in ("ghost", "materialised") if f in got))
    return "  ".join(cells)


def share(batch, rank: int, world: int):
    """Rank `rank`'s prompt groups of `batch` (groups in order, as vcpo train scatters them)."""
    import vcpo

    b = batch.input_ids.shape[0]
    rows = slice(rank * b // world, (rank + 1) * b // world)
    return vcpo.RolloutBatch(batch.input_ids[rows], batch.attention_mask[rows], batch.loss_mask[rows],
                             batch.behavior_logp[rows], batch.rewards[rows], group_index=batch.group_index[rows],
                             num_groups=batch.num_groups)
