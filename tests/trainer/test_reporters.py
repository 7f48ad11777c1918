"""--report-to (vcpo/trainer/report.py) through RunFolder.log_step: TensorBoard event files read back with
TensorBoard's own event reader, a W&B offline run read back from its record file with W&B's protobufs, resume
continuity of both; and the rolling mean of curves.png against a brute-force loop. (The reporters of a real
`vcpo train` run: tests/trainer/test_eval.py, whose run reports to TensorBoard.)"""

import glob
import json
import math
import os
import random
import struct
import time

import pytest

from vcpo.trainer.plot import rolling_mean, smoothing_window
from vcpo.trainer.report import parse_report_to, scalars
from vcpo.trainer.run_folder import RunFolder


def rows_for(steps, offset=0.0):
    return [{"step": s, "reward": 0.1 * s + offset, "ess_ratio": 1.0 / (s + 1), "lag": s % 3, "interrupted": False,
             "note": "text", "nan": float("nan")} for s in steps]


def write_run(path, report_to, rows, resume_at=None):
    """Log `rows` the way vcpo train does: a fresh run, or (resume_at) a run resumed from that step's checkpoint."""
    run = RunFolder(str(path), resume=False, report_to=report_to) if resume_at is None else _resumed(path, report_to)
    if resume_at is None:
        run.write_json("config.json", {"settings": {"steps": 10, "seed": 3}})
    else:
        run.rewind(resume_at)
    with run:
        for row in rows:
            run.log_step(row, [])
    return run


def _resumed(path, report_to):
    os.makedirs(os.path.join(path, "checkpoints", "step-000003"), exist_ok=True)
    return RunFolder(str(path), resume=True, report_to=report_to)


def tensorboard_scalars(run_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path):
    """The records of a W&B run file: a 7-byte ':W&B' header, then LevelDB log records (4-byte CRC, 2-byte length,
    1-byte type: 1 whole, 2 first, 3 middle, 4 last part) in 32 KiB blocks, each a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, parts, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def complete_wandb_records(run_file, timeout=60.0):
    """The records once the file holds the run's exit record: W&B's service may still be writing it after
    run.finish() returned."""
    deadline = time.monotonic() + timeout
    while True:
        records = wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wandb_history(run_file):
    out = {}
    for r in complete_wandb_records(run_file):
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out[items.pop("_step")] = items
    return out


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))


def test_parse_report_to():
    assert parse_report_to(None) == [] and parse_report_to("none") == []
    assert parse_report_to("tensorboard") == ["tensorboard"]
    assert parse_report_to(" wandb , tensorboard ") == ["wandb", "tensorboard"]
    for bad in ("", "tb", "tensorboard,tensorboard", "none,wandb", "tensorboard;wandb"):
        with pytest.raises(ValueError, match="report_to"):
            parse_report_to(bad)


def test_scalars_keep_the_finite_numbers_but_the_step():
    row = rows_for([2])[0]
    assert scalars(row) == {"reward": pytest.approx(0.2), "ess_ratio": pytest.approx(1 / 3), "lag": 2.0}


def test_tensorboard_event_files_hold_the_logged_metrics(tmp_path):
    rows = rows_for(range(1, 6))
    write_run(tmp_path / "run", "tensorboard", rows)
    got = tensorboard_scalars(tmp_path / "run")
    assert set(got) == {"reward", "ess_ratio", "lag"}
    for tag in got:  # event files hold float32
        assert [s for s, _ in got[tag]] == [r["step"] for r in rows]
        assert [v for _, v in got[tag]] == pytest.approx([r[tag] for r in rows], rel=1e-6)
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]  # metrics.jsonl stays
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]


def test_tensorboard_resume_replaces_the_steps_done_again(tmp_path):
    """Interrupted after step 5 with the last checkpoint at 3: the resumed run logs 4.. again, with other values;
    the reader sees each step once, the redone ones with the resumed values."""
    write_run(tmp_path / "run", "tensorboard", rows_for(range(1, 6)))
    write_run(tmp_path / "run", "tensorboard", rows_for(range(4, 8), offset=10.0), resume_at=3)
    assert len(glob.glob(str(tmp_path / "run" / "tensorboard" / "events.out.tfevents.*"))) == 2  # same folder
    reward = tensorboard_scalars(tmp_path / "run")["reward"]
    expected = [r["reward"] for r in rows_for(range(1, 4)) + rows_for(range(4, 8), offset=10.0)]
    assert [s for s, _ in reward] == list(range(1, 8))
    assert [v for _, v in reward] == pytest.approx(expected, rel=1e-6)


def test_wandb_offline_run_holds_the_metrics_and_resumes_the_same_run(tmp_path, offline_wandb):
    run_dir = tmp_path / "run"
    write_run(run_dir, "wandb", rows_for(range(1, 4)))
    run_id = (run_dir / "wandb" / "vcpo-run-id").read_text().strip()
    first = glob.glob(str(run_dir / "wandb" / "offline-run-*" / f"run-{run_id}.wandb"))
    assert len(first) == 1  # offline: no key, no network
    history = wandb_history(first[0])
    assert sorted(history) == [1, 2, 3]
    for row in rows_for(range(1, 4)):
        got = history[row["step"]]
        assert got["reward"] == pytest.approx(row["reward"]) and got["lag"] == row["lag"]
        assert "note" not in got and "nan" not in got and "interrupted" not in got
    runs = [r.run for r in complete_wandb_records(first[0]) if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].run_id == run_id and runs[0].project == "vcpo" and runs[0].display_name == "run"
    config = {i.key: json.loads(i.value_json) for i in runs[0].config.update}
    assert config["settings"] == {"steps": 10, "seed": 3}

    write_run(run_dir, "wandb,tensorboard", rows_for(range(4, 6)), resume_at=3)
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)  # the same W&B run
    resumed = wandb_history(next(f for f in files if f != first[0]))
    assert sorted(resumed) == [4, 5] and resumed[5]["reward"] == pytest.approx(0.5)
    assert [s for s, _ in tensorboard_scalars(run_dir)["reward"]] == [4, 5]  # a reporter added on resume


def test_rolling_mean_against_a_brute_force_loop():
    rng = random.Random(0)
    for length in (0, 1, 2, 7, 50):
        values = [rng.uniform(-3, 3) for _ in range(length)]
        for window in (1, 2, 3, 10, 60):
            want = []
            for i in range(length):
                part = values[max(0, i - window + 1):i + 1]
                want.append(math.fsum(part) / len(part))
            assert rolling_mean(values, window) == pytest.approx(want, abs=1e-12)
    assert rolling_mean([1.0, 2.0, 3.0, 4.0], 1) == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="window"):
        rolling_mean([1.0], 0)


def test_smoothing_window():
    assert [smoothing_window(n) for n in (0, 19, 20, 40, 1500, 10 ** 6)] == [1, 1, 1, 2, 75, 100]
