"""`vcpo train`'s settings without an engine: their errors naming the setting, presets and switches, config
files, the CLI's exit codes, `vcpo plot`, and where local servers are placed."""

import json
import math

import pytest

from vcpo.trainer import LOSS_PRESETS, load_file, make_config


@pytest.mark.parametrize("change, name", [
    ({"steps": 0}, "steps"), ({"steps": 2.5}, "steps"), ({"prompts_per_step": -1}, "prompts_per_step"),
    ({"responses_per_prompt": 0}, "responses_per_prompt"), ({"max_staleness": -1}, "max_staleness"),
    ({"lr": float("nan")}, "lr"), ({"lr": -1e-3}, "lr"),
    ({"loss": "ppo2"}, "loss"), ({"engine": "remote"}, "engine"), ({"dtype": "int8"}, "dtype"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"ess_scaling": "yes"}, "ess_scaling"),
    ({"vcpo": {"is_threshold": -1}}, "is_threshold"), ({"vcpo": {"no_such_option": 1}}, "no_such_option"),
    ({"model": "/no/such/folder"}, "model"), ({"engine_cores": "0-x"}, "engine_cores"),
    ({"trainer_cores": "4096"}, "trainer_cores"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"kv_cache_gib": 0}, "kv_cache_gib"),
    ({"engine": "server", "engine_servers": 0}, "engine_servers"),
    ({"engine": "server", "engine_urls": "http://127.0.0.1:80a"}, "engine_urls"),
    ({"engine": "server", "engine_urls": "127.0.0.1:8000"}, "engine_urls"),
    ({"engine": "server"}, "engine_urls"), ({"engine_servers": 2}, "engine_servers"),
    ({"engine": "server", "engine_servers": 1, "weight_swap": "later"}, "weight_swap"),
    ({"engine": "server", "engine_servers": 1, "engine_timeout": 0}, "engine_timeout"),
    ({"engine": "server", "engine_servers": 1, "exact_staleness": True}, "exact_staleness"),
    ({"exact_staleness": "yes"}, "exact_staleness"), ({"lr_schedule": "step"}, "lr_schedule"),
    ({"lr_min_ratio": 1.5}, "lr_min_ratio"), ({"lr_min_ratio": float("nan")}, "lr_min_ratio"),
    ({"lr_warmup_steps": -1}, "lr_warmup_steps"),
])
def test_bad_settings_name_the_setting(change, name):
    with pytest.raises(ValueError, match=name):
        make_config(**change)


def test_a_config_is_validated_when_it_is_made():
    from vcpo.trainer.config import TrainConfig

    with pytest.raises(ValueError, match="^steps must be an integer >= 1, got 0$"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="^data needs model"):  # the rules between settings too
        TrainConfig(data="x.jsonl")
    cfg = TrainConfig()
    cfg.steps = "many"  # a field assigned since: validate() checks again
    with pytest.raises(ValueError, match="^steps must be an integer >= 1, got 'many'$"):
        cfg.validate()


def test_every_declared_check_refuses_a_value_of_the_wrong_kind():
    from dataclasses import fields

    from vcpo.trainer.config import TrainConfig

    for name in [f.name for f in fields(TrainConfig) if f.metadata["check"] is not None]:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            TrainConfig(**{name: object()})


def _shared_checks():
    import os

    from vcpo.trainer.config import boolean, integer, number, one_of, path_of

    template = path_of("template file", os.path.isfile, ("auto", "none"))
    return [  # (check, a good value, bad values: a bool where it is not one, a wrong type, out of range; the message)
        (integer(1), 1, [True, 1.0, "1", 0], "knob must be an integer >= 1, got {}"),
        (integer(-1), -1, [False, None, -2], "knob must be an integer >= -1, got {}"),
        (number(above=0), 0.5, [True, "0.5", 0, -1, math.nan, math.inf], "knob must be a finite number > 0, got {}"),
        (number(at_least=0), 0, [False, "0", -0.5, -math.inf], "knob must be a finite number >= 0, got {}"),
        (number(at_least=0, at_most=1), 1, [True, None, -0.1, 1.5], "knob must be a number in [0, 1], got {}"),
        (number(above=0, at_most=1), 1.0, [True, [1], 0, 2], "knob must be a number in (0, 1], got {}"),
        (one_of(("raise", "zero")), "zero", [True, 0, "skip"], "knob must be one of ['raise', 'zero'], got {}"),
        (boolean, False, [1, "true", None], "knob must be true or false, got {}"),
        (path_of("file or folder", os.path.exists), ".", [True, 5, ""],
         "knob must be the path of a file or folder, got {}"),
        (path_of("file or folder", os.path.exists), ".", ["/no/such/path"], "knob: no such file or folder {}"),
        (template, "none", [False, 5], "knob must be auto, none or the path of a template file, got {}"),
        (template, "auto", ["/no/such/file"], "knob: no such template file {} (or: auto, none)"),
    ]


@pytest.mark.parametrize("check, good, bad, message", _shared_checks())
def test_each_shared_check_refuses_what_it_must_naming_the_setting(check, good, bad, message):
    check(good, "knob")
    for value in bad:
        with pytest.raises(ValueError) as refused:
            check(value, "knob")
        assert str(refused.value) == message.format(repr(value))


def test_unknown_setting_and_data_without_model():
    with pytest.raises(ValueError, match="unknown settings"):
        make_config(stepz=3)
    with pytest.raises(ValueError, match="data needs model"):
        make_config(data="x.jsonl")


def test_presets_and_switches():
    for name in LOSS_PRESETS:
        make_config(loss=name).vcpo_config()  # every preset is a valid VCPOConfig
    default = make_config().vcpo_config()
    assert (default.is_level, default.is_correction, default.is_threshold) == ("sequence", "truncate", 8.0)
    assert (default.advantage, default.grad_norms, default.lr_rule) == ("opob", "exact", "linear")
    grpo = make_config(loss="grpo").vcpo_config()
    assert (grpo.is_correction, grpo.advantage, grpo.lr_rule) == ("none", "grpo", None)
    both = make_config(loss="token-tis", ess_scaling=True, opob=True).vcpo_config()
    assert (both.is_level, both.lr_rule, both.advantage, both.grad_norms) == ("token", "linear", "opob", "exact")
    off = make_config(ess_scaling=False, opob=False, vcpo={"is_threshold": 4.0}).vcpo_config()
    assert (off.lr_rule, off.advantage, off.is_threshold) == (None, "grpo", 4.0)
    assert make_config(loss="ppo").vcpo_config().clip_ratio == (0.2, 0.28)
    gspo = make_config(loss="gspo", ess_scaling=True, opob=True).vcpo_config()  # a peer's rule with VCPO's parts
    assert (gspo.trust_rule, gspo.is_correction, gspo.lr_rule, gspo.advantage) == ("gspo", "none", "linear", "opob")
    with pytest.raises(ValueError, match="is_correction truncate would weight each unit a second time"):
        make_config(vcpo={"trust_region": "cispo", "clip_ratio": [1.0, 0.2]})  # the vcpo preset truncates
    masked = make_config(vcpo={"trust_region": "cispo", "clip_ratio": [1.0, 0.2], "is_correction": "mask"})
    assert masked.vcpo_config().trust_rule == "cispo"


@pytest.mark.parametrize("suffix", ["yaml", "toml", "json"])
def test_config_files(tmp_path, suffix):
    text = {"yaml": "steps: 7\nloss: seq-tis\nvcpo:\n  is_threshold: 4.0\n",
            "toml": 'steps = 7\nloss = "seq-tis"\n[vcpo]\nis_threshold = 4.0\n',
            "json": json.dumps({"steps": 7, "loss": "seq-tis", "vcpo": {"is_threshold": 4.0}})}[suffix]
    path = tmp_path / f"c.{suffix}"
    path.write_text(text)
    cfg = make_config(load_file(str(path)), steps=9, vcpo={"ess_base_ratio": 0.5})
    assert (cfg.steps, cfg.loss) == (9, "seq-tis")  # the command line wins
    assert cfg.vcpo == {"is_threshold": 4.0, "ess_base_ratio": 0.5}  # option mappings merge


def test_toml_config_on_python_3_10_is_read_with_tomli(tmp_path, monkeypatch):
    """Python 3.10 has no tomllib: load_file falls back to tomli (the package tomllib came from), which vcpo[train]
    requires on 3.10 alone. Here 3.10 is imitated: no tomllib, and a tomli that records its use."""
    import sys
    import types
    from pathlib import Path

    from packaging.requirements import Requirement

    parser = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    calls = []
    tomli = types.SimpleNamespace(load=lambda f: calls.append(f.name) or parser.load(f))
    monkeypatch.setitem(sys.modules, "tomllib", None)  # `import tomllib` raises ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "tomli", tomli)
    path = tmp_path / "c.toml"
    path.write_text('steps = 7\n[vcpo]\nis_threshold = 4.0\n')
    assert load_file(str(path)) == {"steps": 7, "vcpo": {"is_threshold": 4.0}} and calls == [str(path)]
    pyproject = parser.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["train"] if r.startswith("tomli")]
    assert req.name == "tomli"
    assert [req.marker.evaluate({"python_version": v}) for v in ("3.10", "3.11")] == [True, False]


def test_config_file_errors(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(ValueError, match="stepz"):
        load_file(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        load_file(str(tmp_path / "missing.yaml"))
    other = tmp_path / "c.ini"
    other.write_text("")
    with pytest.raises(ValueError, match=".yaml"):
        load_file(str(other))


def test_server_urls_are_parsed():
    cfg = make_config(engine="server", engine_urls="http://127.0.0.1:8000/, http://gpu-node-2:8001")
    assert cfg.server_urls() == ["http://127.0.0.1:8000", "http://gpu-node-2:8001"]
    with pytest.raises(ValueError, match="listed twice"):
        make_config(engine="server", engine_urls="http://a:1,http://a:1")


def test_cli_reports_bad_settings(capsys):
    from vcpo.trainer.cli import main

    assert main(["train", "--steps", "0"]) == 2
    assert "steps must be an integer >= 1" in capsys.readouterr().err
    assert main(["train", "--engine", "server", "--engine-servers", "0"]) == 2
    assert "engine_servers must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["train", "--engine", "server", "--engine-urls", "http://127.0.0.1:eighty"]) == 2
    assert "engine_urls: the port of 'http://127.0.0.1:eighty' is not a number" in capsys.readouterr().err
    assert main(["train", "--is-threshold", "-3"]) == 2
    assert "is_threshold" in capsys.readouterr().err
    assert main(["train", "--resume", "/no/such/run"]) == 2
    assert "not a run folder" in capsys.readouterr().err


def test_plot_command_draws_runs(tmp_path, capsys):
    from vcpo.trainer.cli import main

    for name, k in (("sync", 0), ("async", 4)):
        folder = tmp_path / name
        folder.mkdir()
        rows = [{"step": s, "wall_seconds": 0.5 * s, "reward": s / 40, "ess_ratio": 1.0 if k == 0 else 0.5,
                 "lr_scale": 1.0 if k == 0 else 0.7, **({"eval_accuracy": s / 50, "eval_version": s} if s % 5 == 0
                                                       else {})} for s in range(1, 21)]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.png"
    assert main(["plot", f"sync={tmp_path / 'sync'}", f"async={tmp_path / 'async'}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert main(["plot", str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_local_servers_get_the_gpus_the_trainer_ranks_leave(monkeypatch):
    import torch

    from vcpo.trainer.placement.devices import gpu_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert gpu_plan(2, 2) == ["2", "3"] and gpu_plan(3, 1) == ["1", "2", "3"]
    assert gpu_plan(3, 2) == ["0", "1", "2"]  # not enough GPUs: the servers share them, the trainer's too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_plan(2, 1) is None


def test_every_setting_is_written_once():
    """Each TrainConfig field carries its help, group and resumability (config.setting): the CLI's help, the
    resumable set and the settings table of docs/trainer.md are made from them, and the table is current."""
    import os
    import subprocess
    import sys
    from dataclasses import fields

    from vcpo.trainer.cli import main
    from vcpo.trainer.config import RESUMABLE, TrainConfig

    for f in fields(TrainConfig):
        assert f.metadata["help"] and f.metadata["group"] and isinstance(f.metadata["resumable"], bool), f.name
    assert {"steps", "engine_urls", "max_skipped_steps"} <= RESUMABLE and "lr" not in RESUMABLE
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    check = subprocess.run([sys.executable, os.path.join(root, "tools", "settings_table.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
