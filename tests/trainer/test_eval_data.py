"""`eval_data`, a separate held-out file (docs/trainer.md, "A separate held-out file"): with it every row of `data`
trains and every row of it is evaluated (eval_size not used); without it eval_size rows of `data` are held out;
a bad path, an empty file or a bad row is an error naming eval_data; a resumed run keeps it. No engine, no model:
run_problems with make_model=False."""

import json

import pytest

from vcpo.trainer import make_config
from vcpo.trainer.data import load_problems, split_problems
from vcpo.trainer.task import run_problems

ROWS = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(4) for b in range(3)]  # 12 rows
HELD = [{"q": f"{a}+{b}=", "a": str(a + b)} for a in range(7, 10) for b in range(2)]  # 6 rows, other pairs


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    model = tmp_path / "model"  # a folder is all the settings ask of a model; nothing is loaded here
    model.mkdir()
    return str(model), _write(tmp_path / "train.jsonl", ROWS), _write(tmp_path / "held.jsonl", HELD)


def _config(files, **settings):
    model, data, _ = files
    return make_config(model=model, data=data, prompt_field="q", answer_field="a", **settings)


def test_without_eval_data_eval_size_rows_of_data_are_held_out(files):
    problems = run_problems(_config(files, eval_size=4, seed=3), print, make_model=False)
    assert (len(problems.train), len(problems.eval)) == (8, 4)
    assert (problems.train, problems.eval) == split_problems(load_problems(files[1], "q", "a"), 4, 3)
    assert not {p.prompt for p in problems.train} & {p.prompt for p in problems.eval}


def test_with_eval_data_every_row_of_each_file_and_eval_size_unused(files):
    logged = []
    # eval_size 128 (the default) is more than data's 12 rows: a split would be refused, so it is not used
    cfg = _config(files, eval_data=files[2])
    assert cfg.eval_size == 128
    problems = run_problems(cfg, logged.append, make_model=False)
    assert [(p.prompt, p.answer) for p in problems.train] == [(r["q"], r["a"]) for r in ROWS]
    assert [(p.prompt, p.answer) for p in problems.eval] == [(r["q"], r["a"]) for r in HELD]
    assert [p.index for p in problems.eval] == list(range(len(HELD)))  # rows of the held-out file
    assert any("eval_data" in line and "6 prompts" in line and "eval_size is not used" in line for line in logged)
    # any eval_size, 0 included, gives the same split
    again = run_problems(_config(files, eval_data=files[2], eval_size=0, seed=5), print, make_model=False)
    assert (again.train, again.eval) == (problems.train, problems.eval)


def test_eval_data_as_parquet(files, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "held.parquet"
    pq.write_table(pa.Table.from_pylist(HELD), path)
    problems = run_problems(_config(files, eval_data=str(path)), print, make_model=False)
    assert [p.prompt for p in problems.eval] == [r["q"] for r in HELD]


def test_a_bad_eval_data_is_an_error_naming_it(files, tmp_path):
    with pytest.raises(ValueError, match="eval_data: no such file or folder '/no/such/held.jsonl'"):
        _config(files, eval_data="/no/such/held.jsonl")
    with pytest.raises(ValueError, match="eval_data must be the path"):
        _config(files, eval_data="")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"eval_data: {empty} holds no rows"):
        run_problems(_config(files, eval_data=str(empty)), print, make_model=False)
    bad = _write(tmp_path / "bad.jsonl", HELD[:2] + [{"q": "1+1="}])
    with pytest.raises(ValueError, match="eval_data: row 2 of .*bad.jsonl \\(line 3\\) has no field 'a'"):
        run_problems(_config(files, eval_data=bad), print, make_model=False)
    with pytest.raises(ValueError, match="eval_data must be a .jsonl or .parquet file"):
        run_problems(_config(files, eval_data=_write(tmp_path / "held.csv", HELD)), print, make_model=False)
    with pytest.raises(ValueError, match="eval_data needs data"):
        make_config(eval_data=files[2])
    # data's own errors still name data
    with pytest.raises(ValueError, match="^data: .* holds no rows"):
        run_problems(make_config(model=files[0], data=str(empty), eval_data=files[2]), print, make_model=False)


def test_the_cli_has_eval_data_and_reports_a_bad_one(files, capsys):
    from vcpo.trainer.cli import main

    assert main(["train", "--model", files[0], "--data", files[1], "--eval-data", "/no/such/held.jsonl"]) == 2
    assert "eval_data: no such file or folder '/no/such/held.jsonl'" in capsys.readouterr().err


def test_a_resumed_run_keeps_eval_data(files, tmp_path):
    from vcpo.trainer.run import resume_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = _config(files, eval_data=files[2], output_dir=str(run))
    (run / "config.json").write_text(json.dumps({"settings": cfg.to_dict()}))
    resumed = resume_config(str(run), steps=5)
    assert resumed.eval_data == files[2] and resumed.steps == 5
    assert run_problems(resumed, print, make_model=False).eval == run_problems(cfg, print, make_model=False).eval
    with pytest.raises(ValueError, match="eval_data cannot change on resume"):
        resume_config(str(run), eval_data=files[1])


def test_the_real_model_stale_split_holds_out_whole_operand_pairs():
    """bench/real_model_stale.py, the --eval-data user: no held-out sum is trained on in any phrasing or order;
    its collapse is judged on the held-out curve."""
    import importlib.util
    import os
    import sys

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
    spec = importlib.util.spec_from_file_location("real_model_stale", os.path.join(bench, "real_model_stale.py"))
    stale = importlib.util.module_from_spec(spec)
    sys.path.insert(0, bench)
    try:
        spec.loader.exec_module(stale)
    finally:
        sys.path.remove(bench)
    train, held = stale.split_pairs(16, seed=0)
    assert len(train) + len(held) == 100 and stale.split_pairs(16, seed=0) == (train, held)
    assert stale.split_pairs(16, seed=1) != (train, held)
    assert len({tuple(sorted(p)) for p in held}) == 16
    assert not {tuple(sorted(p)) for p in train} & {tuple(sorted(p)) for p in held}
    curve = [[0, 0, 0.1], [10, 1, 0.5], [20, 2, 0.2], [30, 3, 0.3]]
    assert stale.collapse_version(curve) is None  # back above half the best
    assert stale.collapse_version(curve[:3]) == 20  # a fall at the last evaluation counts
    assert stale.collapse_version([[0, 0, 0.1], [10, 1, 0.25], [20, 2, 0.0]]) is None  # never learned (< 0.3)
