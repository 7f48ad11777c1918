"""A run stopped by a hard kill (an OOM kill, a dead node) resumes (issue 24): a partial last line of metrics.jsonl
or rollouts.jsonl is dropped with a warning naming the file (a corrupt line before it is an error naming file and
line); a newest checkpoint that does not read back is set aside and the previous one used, both named; the logs and
the checkpoint are on disk before the rename, and the rename before older checkpoints are removed; stale .tmp
folders are removed. Only what this run wrote is unpickled: every torch.load is weights_only, and a model folder's
optimizer.pt (a Hugging Face Trainer checkpoint ships one) is read only on --resume."""

import json
import math
import os
import pickle
import random
import re

import pytest
import torch

from support.tiny_models import save_tiny_model
from vcpo.trainer import make_config
from vcpo.trainer.placement.ranks import TrainerRanks
from vcpo.trainer.rollouts import GeneratedBatch, Rollout
from vcpo.trainer.errors import NonFiniteError
from vcpo.trainer.loop_state import LoopState
from vcpo.trainer.policy import Policy
from vcpo.trainer.run_folder import RunFolder, unreadable


def rows(steps, **extra):
    return [json.dumps({"step": s, **extra}) + "\n" for s in steps]


def resumable(tmp_path, steps=(2, 4)):
    """A run folder with metrics and rollouts lines for steps 1-5 and fake checkpoints of `steps` (files that
    read back: trainer_state.pt, optimizer.pt, model.safetensors, config.json)."""
    from safetensors.torch import save_file

    run = tmp_path / "run"
    for step in steps:
        folder = run / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        torch.save({"step": step}, folder / "trainer_state.pt")
        torch.save({"state": {}, "param_groups": []}, folder / "optimizer.pt")
        save_file({"w": torch.ones(3)}, folder / "model.safetensors")
        (folder / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(rows(range(1, 6), loss=0.5)))
    (run / "rollouts.jsonl").write_text("".join(rows(range(1, 6), uid=[0, 1, 2])))
    return run


def cut(path, keep_bytes):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep_bytes] if keep_bytes >= 0 else data[:len(data) + keep_bytes])


# -- the step logs -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["metrics.jsonl", "rollouts.jsonl"])
def test_a_partial_last_line_is_dropped_with_a_warning_naming_the_file(tmp_path, name):
    run = resumable(tmp_path)
    with open(run / name, "a") as f:
        f.write('{"step": 6, "loss": 0.')  # killed while writing step 6's line
    logged = []
    folder = RunFolder(str(run), resume=True, log=logged.append)
    folder.rewind(4)
    assert [json.loads(line)["step"] for line in open(run / name)] == [1, 2, 3, 4]
    assert open(run / name).read().endswith("\n")
    (warning,) = logged
    assert str(run / name) in warning and "partial last line" in warning and "line 6" in warning


def test_evaluations_of_the_resumed_version_and_after_are_dropped(tmp_path):
    """The resumed engine evaluates the checkpoint's version first: evals.jsonl keeps only the versions before it,
    so that no version is logged twice; a partial last line goes as in the step logs."""
    run = resumable(tmp_path)
    (run / "evals.jsonl").write_text("".join(json.dumps({"version": v, "accuracy": 0.5}) + "\n" for v in (0, 2, 4, 5))
                                     + '{"version": 6, "accur')
    logged = []
    RunFolder(str(run), resume=True, log=logged.append).rewind(4)
    assert [json.loads(line)["version"] for line in open(run / "evals.jsonl")] == [0, 2]
    (warning,) = logged
    assert str(run / "evals.jsonl") in warning and "partial last line" in warning


def test_a_last_line_without_its_newline_is_kept_whole(tmp_path):
    run = resumable(tmp_path)
    cut(run / "metrics.jsonl", -1)  # the final "\n" of step 5's line
    RunFolder(str(run), resume=True, log=print).rewind(5)
    text = open(run / "metrics.jsonl").read()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3, 4, 5] and text.endswith("}\n")


@pytest.mark.parametrize("bad", ['{"step": 3, "loss"\n', "not json\n", '{"loss": 1}\n', '[1, 2]\n',
                                 b'{"step": 3, "x": "\xff"}\n'])
def test_a_corrupt_line_that_is_not_the_last_names_file_and_line(tmp_path, bad):
    run = resumable(tmp_path)
    lines = open(run / "rollouts.jsonl", "rb").read().splitlines(keepends=True)
    lines[2] = bad if isinstance(bad, bytes) else bad.encode()
    open(run / "rollouts.jsonl", "wb").write(b"".join(lines))
    before = open(run / "rollouts.jsonl", "rb").read()
    with pytest.raises(ValueError, match=re.escape(f"{run / 'rollouts.jsonl'}, line 3: not a JSON row with a step")):
        RunFolder(str(run), resume=True, log=print).rewind(4)
    assert open(run / "rollouts.jsonl", "rb").read() == before  # left as it was


# -- checkpoints -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file, keep", [("trainer_state.pt", -10), ("optimizer.pt", -30), ("model.safetensors", -4),
                                        ("config.json", 1), ("trainer_state.pt", 0)])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_naming_both(tmp_path, file, keep):
    run = resumable(tmp_path)
    newest, previous = (str(run / "checkpoints" / f"step-{s:06d}") for s in (4, 2))
    cut(os.path.join(newest, file), keep)
    logged = []
    folder = RunFolder(str(run), resume=True, log=logged.append)
    assert folder.resume_checkpoint() == previous
    (warning,) = logged
    assert newest in warning and previous in warning and file in warning
    assert os.path.isdir(newest + ".corrupt") and not os.path.exists(newest)  # kept for a look, out of the way
    assert RunFolder.latest_checkpoint(str(run)) == previous  # what the other trainer ranks then load
    assert folder.checkpoints() == [previous]


def test_every_checkpoint_unreadable_is_an_error_naming_each(tmp_path):
    run = resumable(tmp_path)
    for step in (2, 4):
        os.remove(run / "checkpoints" / f"step-{step:06d}" / "optimizer.pt")
    with pytest.raises(ValueError, match="no checkpoint .* reads back.*step-000004: no optimizer.pt.*step-000002"):
        RunFolder(str(run), resume=True, log=print).resume_checkpoint()
    assert len(os.listdir(run / "checkpoints")) == 2  # nothing moved


def test_stale_temporary_checkpoints_are_removed_at_resume(tmp_path):
    run = resumable(tmp_path)
    stale = run / "checkpoints" / "step-000006.tmp"
    stale.mkdir()
    (stale / "optimizer.pt").write_bytes(b"half")
    logged = []
    RunFolder(str(run), resume=True, log=logged.append)
    assert not stale.exists() and any(str(stale) in line for line in logged)


def test_commit_syncs_logs_and_checkpoint_before_the_rename_and_the_rename_before_removing(tmp_path, monkeypatch):
    """The order of the disk operations: every file of the checkpoint and the two logs fsynced, the .tmp folder too,
    then the rename, then the checkpoints folder fsynced (the rename on disk), and only then the old one removed."""
    import shutil

    from vcpo.trainer import run_folder

    events = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree
    monkeypatch.setattr(run_folder.os, "fsync",
                        lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd)))
    monkeypatch.setattr(run_folder.os, "replace", lambda a, b: (events.append(("rename", a)), real_replace(a, b)))
    monkeypatch.setattr(run_folder.shutil, "rmtree",
                        lambda p, **kw: (events.append(("remove", str(p))), real_rmtree(p, **kw)))
    monkeypatch.setattr(run_folder, "plot_run", lambda path: None)
    run = RunFolder(str(tmp_path / "run"), resume=False)
    old = run.new_checkpoint(1)
    run.commit_checkpoint(old, keep=1)
    with run:
        run.log_step({"step": 2}, [])
        tmp = run.new_checkpoint(2)
        for name in ("model.safetensors", "optimizer.pt"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write("x")
        os.makedirs(os.path.join(tmp, "sub"))
        with open(os.path.join(tmp, "sub", "deep.json"), "w") as f:
            f.write("{}")
        events.clear()
        run.commit_checkpoint(tmp, keep=1)
    rename = events.index(("rename", tmp))
    synced = {path for kind, path in events[:rename] if kind == "fsync"}
    assert synced >= {os.path.join(tmp, "model.safetensors"), os.path.join(tmp, "optimizer.pt"),
                      os.path.join(tmp, "sub", "deep.json"), os.path.join(tmp, "sub"), tmp,
                      run.file("metrics.jsonl"), run.file("rollouts.jsonl")}
    removed = events.index(("remove", old[:-len(".tmp")]))
    assert ("fsync", run.file("checkpoints")) in events[rename:removed]
    assert run.checkpoints() == [tmp[:-len(".tmp")]]  # keep=1: the new one stays, the older one went


@pytest.mark.parametrize("fails", ["writing", "committing"])
def test_a_failed_checkpoint_write_keeps_the_previous_one_and_names_it(tmp_path, monkeypatch, fails):
    """OSError (ENOSPC) while the files are written, or while they are synced: CheckpointError naming the cause and
    the newest whole checkpoint, which is untouched; the partial one is gone."""
    import errno

    from vcpo.trainer import run_folder
    from vcpo.trainer.errors import CheckpointError

    monkeypatch.setattr(run_folder, "plot_run", lambda path: None)
    run = RunFolder(str(tmp_path / "run"), resume=False)
    with run.checkpoint(3, keep=1) as folder:
        open(os.path.join(folder, "optimizer.pt"), "w").write("whole")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if fails == "committing":
        monkeypatch.setattr(run_folder, "_fsync_tree", lambda root: (_ for _ in ()).throw(full))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint of step 6 failed (OSError: [Errno 28] No space "
                                                        f"left on device); the newest whole checkpoint is "
                                                        f"{run.checkpoints()[0]}, untouched")):
        with run.checkpoint(6, keep=1) as folder:
            open(os.path.join(folder, "model.safetensors"), "w").write("half")
            if fails == "writing":
                raise full
    assert os.listdir(run.file("checkpoints")) == ["step-000003"]
    assert open(os.path.join(run.checkpoints()[0], "optimizer.pt")).read() == "whole"


@pytest.mark.parametrize("writer", ["safetensors", "torch.save", "open"])
def test_the_real_writers_failing_is_a_checkpoint_error(tmp_path, monkeypatch, writer):
    """What safetensors (SafetensorError), torch.save (RuntimeError) and a file object (OSError) raise when the disk
    refuses a write (here EFBIG under a file size limit): CheckpointError naming the cause; the partial checkpoint is
    gone and the previous one stays."""
    from safetensors.torch import save_file

    from support.file_limits import file_size_limit
    from vcpo.trainer import run_folder
    from vcpo.trainer.errors import CheckpointError

    monkeypatch.setattr(run_folder, "plot_run", lambda path: None)
    run = RunFolder(str(tmp_path / "run"), resume=False)
    with run.checkpoint(3, keep=1) as folder:
        save_file({"w": torch.ones(3)}, os.path.join(folder, "model.safetensors"))
    big = torch.ones(1 << 18)  # 1 MiB
    write = {"safetensors": lambda path: save_file({"w": big}, path),
             "torch.save": lambda path: torch.save({"w": big}, path),
             "open": lambda path: open(path, "wb").write(big.numpy().tobytes())}[writer]
    with pytest.raises(CheckpointError, match=re.escape("writing the checkpoint of step 6 failed (")) as caught:
        with file_size_limit(64 * 1024), run.checkpoint(6, keep=1) as folder:
            write(os.path.join(folder, "model.safetensors"))
    assert f"the newest whole checkpoint is {run.checkpoints()[0]}, untouched" in str(caught.value)
    assert os.listdir(run.file("checkpoints")) == ["step-000003"]


def test_checkpoints_sort_by_step_and_ignore_other_names(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step-999999", "step-1000000", "step-000010.tmp", "step-000005.corrupt", "step-x", "notes"):
        (root / name).mkdir(parents=True)
    assert [os.path.basename(p) for p in RunFolder(str(tmp_path), resume=True).checkpoints()] == \
        ["step-999999", "step-1000000"]


# -- what is unpickled -------------------------------------------------------------------------------------------------
class _Payload:
    """A pickle that, once loaded with weights_only=False, writes a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def model_folder(tmp_path):
    return save_tiny_model(tmp_path / "model")


def policy_of(folder, resume):
    return Policy(str(folder), make_config(model=str(folder), data="unused.jsonl", lr=1e-6), TrainerRanks(1, 16, 60),
                  resume=resume)


def test_a_model_folders_optimizer_is_not_read_on_a_fresh_run(model_folder):
    """A Hugging Face Trainer checkpoint ships optimizer.pt: a fresh run ignores it (it ran at lr 0.5 while the run
    was configured and logged at 1e-6, issue 24); --resume of a checkpoint reads it."""
    other = policy_of(model_folder, resume=False).optimizer
    other.param_groups[0]["lr"] = 0.5
    torch.save(other.state_dict(), os.path.join(model_folder, "optimizer.pt"))
    fresh = policy_of(model_folder, resume=False)
    assert fresh.optimizer.param_groups[0]["lr"] == 1e-6 and not fresh.optimizer.state_dict()["state"]
    resumed = policy_of(model_folder, resume=True)
    assert resumed.optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("file", ["optimizer.pt", "trainer_state.pt"])
def test_checkpoint_files_are_loaded_without_running_pickled_code(model_folder, tmp_path, file):
    marker = tmp_path / "ran"
    torch.save({"step": 1}, os.path.join(model_folder, "trainer_state.pt"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(model_folder, "optimizer.pt"))
    assert unreadable(model_folder) is None
    torch.save({"state": {}, "param_groups": [_Payload(str(marker))]}, os.path.join(model_folder, file))
    assert unreadable(model_folder).startswith(f"{file}: UnpicklingError: Weights only load failed")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        if file == "optimizer.pt":
            policy_of(model_folder, resume=True)
        else:
            LoopState.load(str(model_folder))
    assert not marker.exists()


def test_the_trainer_state_reads_back_weights_only(tmp_path):
    """What LoopState.save writes (RNG states, pending batches of every Rollout field) loads with weights_only=True,
    so a checkpoint written before weights_only still resumes."""
    rollout = Rollout(3, 7, 1, [1, 2], [3, 4], [-0.5, -1.25], "stop", 1.0, 2, True, 3, "http://127.0.0.1:1",
                      {"format": 0.5}, None)
    state = LoopState(step=3, elapsed=1.5, next_batch=5, pending=[GeneratedBatch(3, 2, [rollout])])
    state.lag_hist[1] += 2
    random.seed(4)
    state.save(str(tmp_path))
    expected = random.random()
    random.seed(99)
    loaded = LoopState.load(str(tmp_path))
    assert random.random() == expected  # the RNG state came back
    assert (loaded.step, loaded.next_batch, loaded.pending, dict(loaded.lag_hist)) == (3, 5, state.pending, {1: 2})


def test_non_finite_weights_are_refused_at_load(model_folder):
    from safetensors.torch import load_file, save_file

    path = os.path.join(model_folder, "model.safetensors")
    weights = load_file(path)
    name = sorted(k for k, v in weights.items() if v.dim() == 2)[1]
    weights[name][0, 0] = math.nan
    save_file(weights, path)
    with pytest.raises(NonFiniteError, match=rf"not finite \({name}"):
        policy_of(model_folder, resume=False)


def test_weights_that_turn_non_finite_after_a_step_stop_the_run_before_publishing(model_folder, monkeypatch):
    """A step taken (not skipped) that leaves a weight non-finite: Policy.step raises, so the trainer neither
    publishes nor saves them (vcpo.step replaced by one that writes an infinity)."""
    import vcpo

    policy = policy_of(model_folder, resume=False)
    name, param = next((n, p) for n, p in policy.model.named_parameters() if p.dim() == 2)

    def step(model, optimizer, batch, config, process_group=None):
        with torch.no_grad():
            param[0, 0] = math.inf
        return {"skipped": 0.0}

    monkeypatch.setattr(vcpo, "step", step)
    batch = vcpo.RolloutBatch(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), torch.ones(1, 2),
                              torch.zeros(1, 2), torch.zeros(1))
    with pytest.raises(NonFiniteError, match=rf"\({name}: a NaN or an infinity\): nothing of them was sent"):
        policy.step(batch, 1)


# -- what a hard kill leaves outside the logs and checkpoints ---------------------------------------------------------
def start_ticks(pid):
    """A process's start time as /proc gives it (clock ticks since boot): the `processes` file's unit."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return int(text[text.rindex(")") + 2:].split()[19])


def test_a_resume_ends_what_the_killed_run_left_and_removes_its_runtime_folder(tmp_path):
    """The killed run's watchdog was killed too: its record of the run's processes and the run's token find what is
    left (a recorded process; an unrecorded one whose environment carries the token), a resume ends both and removes
    the runtime folder and the half-written checkpoint and weight file, saying so; a recorded pid whose start time
    differs (a pid reused since by another program) is left alone."""
    import socket
    import subprocess

    run = resumable(tmp_path)
    runtime = tmp_path / "vcpo-run-123-abc"
    runtime.mkdir()
    recorded = subprocess.Popen(["sleep", "60"])
    marked = subprocess.Popen(["sleep", "60"], env={**os.environ, "VCPO_RUN_TOKENS": "other:vcpo-run-123-abc"})
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        (runtime / "processes").write_text(f"{recorded.pid} {start_ticks(recorded.pid)}\n"
                                           f"{stranger.pid} {start_ticks(stranger.pid) + 1}\n")
        (run / ".lock").write_text(json.dumps({"pid": 4 * 10 ** 6, "host": socket.gethostname(),
                                               "runtime_dir": str(runtime)}))
        (run / ".weights").mkdir()
        (run / ".weights" / "model.safetensors.tmp").write_bytes(b"half")
        (run / ".weights" / "model.safetensors").write_bytes(b"whole")
        (run / "checkpoints" / "step-000006.tmp").mkdir()
        logs = []
        RunFolder(str(run), resume=True, log=logs.append)
        assert recorded.wait(timeout=5) == -9 and marked.wait(timeout=5) == -9 and stranger.poll() is None
        text = "\n".join(logs)
        assert f"previous process (pid {4 * 10 ** 6}) had left 2 process(es) running: ended sleep 60 (pid " in text
        assert f"removed {runtime}, the runtime folder" in text and not runtime.exists()
        assert "model.safetensors.tmp: a weight file that was being written" in text
        assert "step-000006.tmp: a checkpoint that was being written" in text
        assert sorted(os.listdir(run / ".weights")) == ["model.safetensors"]
        assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    finally:
        for p in (recorded, marked, stranger):
            p.kill()
            p.wait()


def test_a_folder_in_use_is_refused_naming_its_process_and_free_once_it_dies(tmp_path):
    """Another process holds the folder's lock: a new run or a resume is refused, naming it; once it is SIGKILLed the
    kernel has released the lock and the resume goes on (its record names a process that is gone: nothing to end)."""
    import subprocess
    import sys

    run = resumable(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, json, os, socket, time
fd = os.open({str(run / ".lock")!r}, os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({{"pid": os.getpid(), "host": socket.gethostname(), "runtime_dir": None}}).encode())
print("locked", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=re.escape(f"is in use by another vcpo train (pid {holder.pid} on ")):
            RunFolder(str(run), resume=True)
        assert (run / "checkpoints" / "step-000004").is_dir()  # nothing touched
    finally:
        holder.kill()
        holder.wait()
    logs = []
    RunFolder(str(run), resume=True, log=logs.append)
    assert not logs and json.loads((run / ".lock").read_text())["pid"] == os.getpid()


def test_each_metrics_row_is_in_the_file_when_its_step_ends(tmp_path):
    """A reader polling metrics.jsonl (`tail -f`, a dashboard) sees a step's row before the next step, not at the
    next checkpoint."""
    with RunFolder(str(tmp_path / "run"), resume=False) as run:
        for step in (1, 2):
            run.log_step({"step": step, "loss": 0.5}, [])
            with open(run.file("metrics.jsonl")) as f:
                assert [json.loads(line)["step"] for line in f] == list(range(1, step + 1))
