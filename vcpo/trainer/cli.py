"""The `vcpo` command: `vcpo train`, `vcpo eval` and `vcpo export` (docs/trainer.md), `vcpo serve` (a vLLM server,
docs/scale.md) and `vcpo plot`."""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import fields

from vcpo.config import VCPOConfig


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _value(text: str):
    """A command-line value read as YAML: numbers, true/false, null, [a, b]; anything else stays a string."""
    import yaml

    return yaml.safe_load(text)


def _train_parser(sub) -> argparse.ArgumentParser:
    from .config import SET_BY_SETTINGS, TrainConfig

    p = sub.add_parser("train", help="asynchronous VCPO training on vLLM rollouts",
                       description="Train with asynchronous VCPO. With no arguments: the built-in tiny model on "
                                   "the built-in addition task. Settings: docs/trainer.md.",
                       argument_default=argparse.SUPPRESS)
    p.add_argument("--config", help="a YAML/TOML/JSON file of settings (the command line overrides it)")
    p.add_argument("--resume", metavar="RUN", help="continue the run in folder RUN from its last checkpoint")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    hints = typing.get_type_hints(TrainConfig)
    groups: dict = {}
    for f in fields(TrainConfig):
        if f.name == "vcpo":  # its options are the flags of the last group
            continue
        if f.metadata["group"] not in groups:
            groups[f.metadata["group"]] = p.add_argument_group(f.metadata["group"])
        group, text = groups[f.metadata["group"]], f.metadata["help"]
        if hints[f.name] in (bool, typing.Optional[bool]):
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, help=text)
            continue
        if f.name == "ray":
            group.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS", help=text)
            continue
        kind = typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is typing.Union \
            else hints[f.name]
        group.add_argument(_flag(f.name), type=kind if kind in (int, float) else str, metavar=f.name.upper(),
                           help=text + ("" if f.default is None else f" [{f.default}]"))
    g = p.add_argument_group("VCPO loss options (docs/contract.md; values read as YAML, e.g. 8, true, null)")
    for f in fields(VCPOConfig):
        if f.name in SET_BY_SETTINGS:  # set by the settings above
            continue
        g.add_argument(_flag(f.name), dest="vcpo." + f.name, type=_value, metavar="VALUE")
    return p


def _train(args: argparse.Namespace, argv: list) -> int:
    from .config import load_file, make_config
    from .run import resume_config, train

    given = vars(args).copy()
    resume = given.pop("resume", None)
    config_file = given.pop("config", None)
    progress = not given.pop("no_progress", False)
    given.pop("command")
    settings = {k: v for k, v in given.items() if not k.startswith("vcpo.")}
    vcpo_options = {k[len("vcpo."):]: v for k, v in given.items() if k.startswith("vcpo.")}
    if vcpo_options:
        settings["vcpo"] = vcpo_options
    if resume is not None:
        if config_file is not None:
            raise ValueError("--resume continues a run with its own settings: drop --config")
        cfg = resume_config(resume, **settings)
    else:
        cfg = make_config(load_file(config_file) if config_file else None, **settings)
    from .errors import CLI_ERRORS, RunStopped
    from .placement.ranks import launch_ranks, launched_ranks
    from .process_guard import guard
    from .ray_launch import train_on_ray

    guard()  # whatever this process starts ends with it, however it ends (docs/trainer.md, "Resume")
    if cfg.ray is None and cfg.trainer_ranks > 1 and launched_ranks() == 1:
        launch_ranks(cfg.trainer_ranks, argv)  # does not return: this process becomes torchrun

    try:
        summary = train_on_ray(cfg, resume is not None) if cfg.ray is not None else \
            train(cfg, resume=resume is not None, progress=progress)
    except CLI_ERRORS as e:
        print(f"vcpo train: error: {e}", file=sys.stderr)
        return 1
    except RunStopped as stop:  # before the steps (during them a first signal checkpoints and ends the run)
        print(f"vcpo train: stopped by {stop}", file=sys.stderr)
        return 128 + stop.signum  # the shell's code for a process a signal ended
    if summary is None:  # a trainer rank > 0: rank 0 reports the run
        return 0
    final = summary["final_eval"]
    print(f"run folder: {summary['run_dir']}  steps: {summary['steps']}  wall: {summary['wall_seconds']:.0f} s"
          + (f"  held-out accuracy: {final['accuracy']:.3f}" if final else ""))
    return 0


def _eval_parser(sub) -> None:
    from .engines.interface import OWNED_MODES

    p = sub.add_parser("eval", help="greedy accuracy, pass@k and mean@n of a checkpoint on held-out prompts",
                       description="Evaluate a checkpoint with vLLM; the result is written as JSON beside it "
                                   "(docs/trainer.md, Evaluation).")
    p.add_argument("--model", required=True, metavar="RUN_OR_FOLDER",
                   help="a run folder (its latest checkpoint), one of its checkpoints, or a model folder")
    p.add_argument("--data", help="a .jsonl/.parquet file or datasets folder, every row evaluated (default: the "
                                  "run's held-out split)")
    p.add_argument("--reward", help="exact, math, math-lenient or module:function (default: the run's, else exact)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt at the run's temperature (else 1) for "
                                                    "pass@k (0: greedy only) [8]")
    p.add_argument("--seed", type=int, default=0, help="the samples' seed [0]")
    p.add_argument("--max-new-tokens", type=int, help="default: the run's, else 512")
    p.add_argument("--prompt-field", help="the data's prompt column (default: the run's, else prompt)")
    p.add_argument("--answer-field", help="the data's answer column (default: the run's, else answer)")
    p.add_argument("--engine", default="inprocess", choices=sorted(OWNED_MODES),
                   help="vLLM in this process or in its own [inprocess]")
    p.add_argument("-o", "--output", help="the JSON file (default: eval-<data stem>.json, eval-heldout.json "
                                          "without --data, in the model folder)")


def _eval(args: argparse.Namespace) -> int:
    from .errors import CLI_ERRORS
    from .evaluate import run_eval

    try:
        run_eval(args.model, data=args.data, reward=args.reward, n=args.n, engine=args.engine, output=args.output,
                 seed=args.seed, max_new_tokens=args.max_new_tokens, prompt_field=args.prompt_field,
                 answer_field=args.answer_field)
    except CLI_ERRORS as e:
        print(f"vcpo eval: error: {e}", file=sys.stderr)
        return 1
    return 0


def _export(args: argparse.Namespace) -> int:
    from .export import export

    export(args.model, args.output)
    return 0


def _plot(args: argparse.Namespace) -> int:
    import os

    from .plot import plot_runs, read_metrics

    runs = {}
    for spec in args.runs:
        label, _, folder = spec.rpartition("=")
        rows = read_metrics(folder)
        if not rows:
            raise ValueError(f"{folder!r} has no metrics.jsonl")
        runs[label or os.path.basename(os.path.normpath(folder))] = rows
    plot_runs(runs, args.output)
    print(args.output)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # vLLM's arguments, and serve's own --insecure-no-key: `vcpo serve MODEL --port 8000`
        from .engines.servers import serve

        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="vcpo", description="Variance-controlled off-policy RL for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _eval_parser(sub)
    sub.add_parser("serve", help="a vLLM server for `vcpo train --engine server`: the arguments of `vllm serve`; "
                                 "with VLLM_API_KEY set, every route needs that key; without it, refused unless "
                                 "on --host 127.0.0.1 (::1, localhost), on --uds, or with --insecure-no-key",
                   add_help=False)
    export = sub.add_parser("export", help="a checkpoint as a Hugging Face model folder (a LoRA adapter merged into "
                                           "its base model)")
    export.add_argument("model", metavar="RUN_OR_CHECKPOINT", help="a run folder (its latest checkpoint) or a "
                                                                   "checkpoint")
    export.add_argument("--output", required=True, metavar="DIR", help="a new or empty folder")
    plot = sub.add_parser("plot", help="one figure comparing the curves of several runs")
    plot.add_argument("runs", nargs="+", metavar="[LABEL=]RUN")
    plot.add_argument("-o", "--output", default="compare.png")
    args = parser.parse_args(argv)
    try:
        return {"train": lambda: _train(args, argv[1:]), "eval": lambda: _eval(args),
                "export": lambda: _export(args), "plot": lambda: _plot(args)}[args.command]()
    except ValueError as e:
        print(f"vcpo {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
