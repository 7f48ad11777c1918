"""TrainConfig: every setting of `vcpo train`, from defaults, a YAML/TOML file and the command line, with the
update rule given as a preset (`loss`) plus VCPO loss options (docs/trainer.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from vcpo.config import VCPOConfig
from vcpo_kernels.options import DEFAULT_LR_RULE

from .gguf_models import is_gguf
from .lora import VLLM_MAX_LORA_RANKS
from .lr_schedule import LR_SCHEDULES
from .report import parse_report_to
from .rewards import REWARD_ERRORS

# The peers' rules: no importance correction of their own, the group-mean baseline, a constant lr.
_PEER = {"is_correction": "none", "advantage": "grpo", "lr_rule": None, "grad_norms": "uniform"}
# The update rules offered for comparison; each is a VCPOConfig (docs/trainer.md, "Update rules").
LOSS_PRESETS: dict[str, dict[str, Any]] = {
    # sequence-level truncated IS (C = 8), OPOB with exact per-sequence norms, ESS-scaled lr
    "vcpo": {},
    # no importance correction at all: the behaviour policy's samples are treated as on-policy
    "grpo": {"is_correction": "none", "advantage": "grpo", "lr_rule": None, "grad_norms": "uniform"},
    "seq-tis": {"is_level": "sequence", "is_correction": "truncate", "advantage": "grpo", "lr_rule": None,
                "grad_norms": "uniform"},
    "token-tis": {"is_level": "token", "is_correction": "truncate", "advantage": "grpo", "lr_rule": None,
                  "grad_norms": "uniform"},
    # masked IS: sequences whose weight leaves [1/C, C] get no gradient
    "mis": {"is_level": "sequence", "is_correction": "mask", "advantage": "grpo", "lr_rule": None,
            "grad_norms": "uniform"},
    # The trust regions read pi / mu (the trainer runs in bypass mode: one step per batch), which carries the
    # importance weight: no further correction. Bounds: each rule's paper or its peer's example (docs/api.md).
    "ppo": {**_PEER, "clip_ratio": (0.2, 0.28)},
    "gspo": {**_PEER, "trust_region": "gspo", "clip_ratio": (3e-4, 4e-4)},
    "gmpo": {**_PEER, "trust_region": "gmpo", "clip_ratio": (0.4, 0.4)},
    "cispo": {**_PEER, "trust_region": "cispo", "clip_ratio": (1.0, 0.2), "loss_agg_mode": "token-mean"},
    "dppo": {**_PEER, "trust_region": "dppo_tv", "clip_ratio": (0.15, 0.15)},
    "sapo": {**_PEER, "trust_region": "sapo"},
    # IcePop: the token's weight pi / mu inside [0.5, 5], 0 outside
    "icepop": {**_PEER, "is_level": "token", "is_correction": "truncate", "is_threshold": 5.0,
               "rejection": (("token_k1", 0.5, 5.0),)},
    # M2PO: the tokens of largest (log pi / mu)^2 masked until the mean of the others is at most 0.04 (AReaL's
    # example), the others weighted by pi / mu truncated at 5
    "m2po": {**_PEER, "is_level": "token", "is_correction": "truncate", "is_threshold": 5.0,
             "rejection": (("batch_m2", None, 0.04),)},
}
ENGINE_MODES = ("process", "inprocess", "server")  # the `engine` setting; engines/start.py builds each
DTYPES = ("float32", "bfloat16", "float16")  # the `dtype` setting: the engine's
WEIGHT_SWAPS = ("wait", "keep", "abort")
WEIGHT_TRANSFERS = ("storage", "nccl")  # docs/scale.md, "Weight transfer over NCCL"
# The trainer's precision (docs/trainer.md, "Precision"): its parameters' dtype (and the optimizer state's) and the
# forward's autocast dtype (VCPOConfig.autocast; with FSDP2, MixedPrecisionPolicy's param_dtype, fp32 reductions).
PRECISIONS = {"fp32": ("float32", None), "bf16-mixed": ("float32", "bfloat16"), "bf16": ("bfloat16", None)}
# VCPOConfig fields the trainer sets from a setting of its own, never apart: field -> the setting
SET_BY_SETTINGS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "autocast": "precision"}

# the settings' groups, in the order of `vcpo train --help` and of the settings table
DATA, RUN, SAMPLING, UPDATE, BOOKKEEPING, ENGINE, SERVER, RANKS, LORA = (
    "task and data", "the run", "sampling (docs/trainer.md, Sampling settings)", "the update", "bookkeeping",
    "the engine", "engine: server (docs/scale.md)", "trainer ranks (docs/trainer.md, Trainer ranks)",
    "LoRA (docs/trainer.md, LoRA)")
BUILTIN_LR, MODEL_LR = 3e-4, 1e-6  # AdamW's learning rate unless `lr` is given: the built-in tiny model's, any other's


# A setting's check (setting(check=...)), called as check(value, name) on its value unless that is None where None is
# the default (unset); it raises ValueError naming the setting. The shared ones first.
Check = Callable[[Any, str], object]


def integer(at_least: int, at_most: Optional[int] = None) -> Check:
    """An int, not a bool, >= at_least (and <= at_most)."""
    what = f"an integer >= {at_least}" if at_most is None else f"an integer from {at_least} to {at_most}"

    def check(value: Any, name: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < at_least or \
                (at_most is not None and value > at_most):
            raise ValueError(f"{name} must be {what}, got {value!r}")

    return check


def number(*, above: Optional[float] = None, at_least: Optional[float] = None, at_most: float = math.inf) -> Check:
    """A finite int or float, not a bool, > above (or >= at_least) and <= at_most."""
    low = at_least if above is None else above
    if at_most == math.inf:
        what = f"a finite number {'>=' if above is None else '>'} {low}"
    else:
        what = f"a number in {'[' if above is None else '('}{low}, {at_most}]"

    def check(value: Any, name: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                value > at_most or (value < low if above is None else value <= low):
            raise ValueError(f"{name} must be {what}, got {value!r}")

    return check


def one_of(values) -> Check:
    """One of `values` (a tuple, or a dict's keys)."""
    allowed = tuple(values)

    def check(value: Any, name: str) -> None:
        if value not in allowed:
            raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")

    return check


def boolean(value: Any, name: str) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def path_of(kind: str, exists: Callable[[str], bool], keywords: tuple = ()) -> Check:
    """One of `keywords`, or the path of a `kind`, for which exists(path) holds."""
    alternatives = ", ".join(keywords) + " or " if keywords else ""
    otherwise = f" (or: {', '.join(keywords)})" if keywords else ""

    def check(value: Any, name: str) -> None:
        if value in keywords:
            return
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be {alternatives}the path of a {kind}, got {value!r}")
        if not exists(value):
            raise ValueError(f"{name}: no such {kind} {value!r}{otherwise}")

    return check


def _is_model(folder_or_file: str) -> bool:
    return os.path.isdir(folder_or_file) or is_gguf(folder_or_file)


def _loss_options(value: Any, name: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping of VCPO loss options, got {value!r}")
    for field, setting_name in SET_BY_SETTINGS.items():
        if field in value:
            raise ValueError(f"{name}.{field} follows the {setting_name} setting: set {setting_name} instead")


def _ray_address(value: Any, name: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be local or a Ray cluster's address (auto, HOST:PORT, ray://HOST:PORT), got "
                         f"{value!r}")


def parse_cores(spec: str, name: str = "cores") -> list[int]:
    """"0,2-3" -> [0, 2, 3]; every core must be one this process may run on."""
    cores: list[int] = []
    try:
        for part in str(spec).split(","):
            lo, _, hi = part.strip().partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"{name} must be a core list like '0' or '0,2-3', got {spec!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cores or any(c not in allowed for c in cores):
        raise ValueError(f"{name} {spec!r} names cores outside this process's {sorted(allowed)}")
    return cores


def setting(default: Any = dataclasses.MISSING, *, group: str, help: str, resumable: bool = False,
            factory: Any = dataclasses.MISSING, check: Optional[Check] = None) -> Any:
    """A TrainConfig field that carries its `help` (the CLI's and the settings table's), its `group`, whether it is
    `resumable` (a resumed run may change it; the others define the run) and the `check` of its value."""
    metadata = {"help": help, "group": group, "resumable": resumable, "check": check}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _short(x: float) -> str:
    """3e-4, not 0.0003."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


@dataclass
class TrainConfig:
    """The settings of `vcpo train`. Each is written once, here: its default, its help, its group, whether a
    resumed run may change it and its check (setting); the CLI's flags and help, RESUMABLE and the settings table of
    docs/trainer.md (tools/settings_table.py) are made from these fields, and validate() from their checks."""

    model: Optional[str] = setting(None, group=DATA,
        check=path_of("local Hugging Face model folder or .gguf file", _is_model),
        help="a local Hugging Face causal LM folder (default: the built-in tiny Llama)")
    data: Optional[str] = setting(None, group=DATA,
        help="a .jsonl or .parquet file or a `datasets` folder (save_to_disk) of prompts and answers (default: the "
             "built-in addition task)")
    reward: Optional[str] = setting(None, group=DATA,
        help="exact (exact match), math (the final answer: the last \\boxed{}, else an 'Answer:' line; a number when "
             "the gold is one, else symbolic equivalence), math-lenient (math-verify's own extraction: the last "
             "expression anywhere) or module:function, called as function(response, answer[, example]) -> float or "
             "dict with 'reward', in worker processes (async: in the trainer) (default: exact)")
    reward_workers: int = setting(4, group=DATA, resumable=True, check=integer(1),
        help="reward calls in flight at once (worker processes for a sync function)")
    reward_timeout: float = setting(30.0, group=DATA, resumable=True, check=number(above=0),
        help="seconds per reward call (then its worker process is killed and replaced)")
    reward_errors: str = setting("raise", group=DATA, resumable=True, check=one_of(REWARD_ERRORS),
        help="a reward call that raises or times out: raise (stop the run) or zero (score it 0)")
    prompt_field: str = setting("prompt", group=DATA, help="the data's prompt column")
    answer_field: str = setting("answer", group=DATA, help="the data's answer column")
    chat_template: str = setting("auto", group=DATA,
        check=path_of("Jinja template file", os.path.isfile, ("auto", "none")),
        help="auto (the tokenizer's chat template, if it has one), none (prompts as written) or a Jinja template file")
    system_prompt: Optional[str] = setting(None, group=DATA,
        help="a system message before every prompt (needs a chat template)")
    eval_size: int = setting(128, group=DATA, check=integer(0),
        help="prompts held out (seeded) for the greedy evaluation; not used with eval_data")
    eval_data: Optional[str] = setting(None, group=DATA, check=path_of("file or folder", os.path.exists),
        help="a separate held-out file or `datasets` folder (as data: same formats and fields): the greedy "
             "evaluation uses every row of it, every row of data trains, and eval_size is not used")
    warm_start_steps: int = setting(220, group=DATA, check=integer(0),
        help="built-in model: supervised steps before RL (cached)")
    output_dir: Optional[str] = setting(None, group=RUN, resumable=True,
        help="the run folder (default: runs/vcpo-<date>-<time>)")
    steps: int = setting(1500, group=RUN, resumable=True, check=integer(1), help="optimizer steps")
    prompts_per_step: int = setting(16, group=RUN, check=integer(1), help="prompts per step")
    responses_per_prompt: int = setting(8, group=RUN, check=integer(1),
        help="responses sampled per prompt (the group size)")
    max_new_tokens: Optional[int] = setting(None, group=RUN, check=integer(1),
        help="default: 8 on the built-in task, else 512")
    max_staleness: int = setting(4, group=RUN, check=integer(0),
        help="k: the largest policy-version lag of a consumed sample (0 = synchronous)")
    exact_staleness: bool = setting(False, group=RUN, check=boolean,
        help="the trainer also waits for the engine, so every batch from k on has lag exactly k")
    seed: int = setting(0, group=RUN, check=integer(0), help="prompt order, sampling seeds, initial RNG")
    # checked as the loss's temperature (VCPOConfig), which it is
    temperature: float = setting(1.0, group=SAMPLING,
        help="sampling temperature of the rollouts and of vcpo eval's samples; the trainer's log-probs are taken at it "
             "(the evaluation's greedy decoding is unchanged)")
    top_p: float = setting(1.0, group=SAMPLING, check=number(above=0, at_most=1),
        help="nucleus sampling of the rollouts and of vcpo eval's samples (1: off); the trainer's log-probs are of the "
             "same truncated distribution (docs/trainer.md, Sampling settings)")
    top_k: int = setting(-1, group=SAMPLING, check=integer(-1),
        help="top-k sampling of the rollouts and of vcpo eval's samples (-1 or 0: off); the trainer's log-probs are of "
             "the same truncated distribution")
    precision: str = setting("fp32", group=UPDATE, check=one_of(PRECISIONS),
        help="the trainer's: fp32; bf16-mixed (bf16 compute over fp32 weights and optimizer state); bf16 (bf16 "
             "weights and optimizer state). The engine's is --dtype (docs/trainer.md, Precision)")
    loss: str = setting("vcpo", group=UPDATE, check=one_of(LOSS_PRESETS),
        help=f"update rule: {', '.join(LOSS_PRESETS)}")
    ess_scaling: Optional[bool] = setting(None, group=UPDATE, check=boolean,
        help="ESS-scaled learning rate on or off, over the preset")
    opob: Optional[bool] = setting(None, group=UPDATE, check=boolean,
        help="OPOB with exact per-sequence norms on, or the group mean, over the preset")
    vcpo: dict = setting(factory=dict, group=UPDATE, check=_loss_options,
        help="the VCPO loss options over the preset: any VCPOConfig field (docs/contract.md), applied last; on the "
             "command line one flag each, e.g. --is-level sequence")
    lr: Optional[float] = setting(None, group=UPDATE, check=number(above=0),
        help=f"AdamW learning rate (default: {_short(BUILTIN_LR)} on the tiny model, else {_short(MODEL_LR)})")
    lr_schedule: str = setting("cosine", group=UPDATE, check=one_of(LR_SCHEDULES),
        help=f"the lr over the steps: {', '.join(LR_SCHEDULES)} (cosine, linear: a decay from lr to lr_min_ratio x lr "
             "at the last step, `steps`; bench/RESULTS.md, \"The main job with a decaying lr\")")
    lr_warmup_steps: int = setting(0, group=UPDATE, check=integer(0),
        help="steps of a linear warm-up of the lr from lr / lr_warmup_steps")
    lr_min_ratio: float = setting(0.1, group=UPDATE, check=number(at_least=0, at_most=1),
        help="the lr at the last step of a decay, as a fraction of lr")
    weight_decay: float = setting(0.0, group=UPDATE, check=number(at_least=0), help="AdamW")
    memory_budget_gib: Optional[float] = setting(None, group=UPDATE, check=number(above=0),
        help="the micro-batch size from this budget of each trainer rank's memory (the GPU's allocated memory, or "
             "the process's resident set on a CPU), fitted on steps 2 and 3 (vcpo.MicroBatchFit; docs/grad_norms.md, "
             "Choosing m for a memory budget)")
    max_skipped_steps: int = setting(10, group=UPDATE, resumable=True, check=integer(1),
        help="steps in a row skipped as non-finite (loss, gradient norm or lr scale) that stop the run, after a "
             "checkpoint")
    checkpoint_every: int = setting(50, group=BOOKKEEPING, resumable=True, check=integer(1),
        help="steps between checkpoints")
    keep_checkpoints: int = setting(2, group=BOOKKEEPING, resumable=True, check=integer(1), help="checkpoints kept")
    eval_every: int = setting(20, group=BOOKKEEPING, resumable=True, check=integer(0),
        help="versions between greedy evaluations")
    report_to: str = setting("none", group=BOOKKEEPING, resumable=True, check=lambda spec, _: parse_report_to(spec),
        help="metrics also to tensorboard (<run>/tensorboard) and/or wandb (<run>/wandb), comma-separated")
    engine: str = setting("process", group=ENGINE, resumable=True, check=one_of(ENGINE_MODES),
        help="process (vLLM in its own processes), inprocess, or server (a pool of vLLM servers, docs/scale.md)")
    engine_cores: Optional[str] = setting(None, group=ENGINE, resumable=True, check=parse_cores,
        help="CPU: the engine's cores, e.g. 1 (default: the last)")
    trainer_cores: Optional[str] = setting(None, group=ENGINE, resumable=True, check=parse_cores,
        help="CPU: the trainer's cores (default: the others)")
    kv_cache_gib: float = setting(1.0, group=ENGINE, resumable=True, check=number(above=0),
        help="the engine's KV cache (CPU)")
    dtype: str = setting("float32", group=ENGINE, check=one_of(DTYPES), help=f"the engine's dtype: {', '.join(DTYPES)}")
    max_model_len: Optional[int] = setting(None, group=ENGINE, check=integer(1),
        help="default: the longest prompt plus max_new_tokens")
    gpu_memory_utilization: float = setting(0.3, group=ENGINE, resumable=True, check=number(above=0),
        help="GPU: the engine's share of the GPU memory")
    engine_urls: Optional[str] = setting(None, group=SERVER, resumable=True,
        help="engine server: running vLLM servers, http://host:port,... (see vcpo serve)")
    engine_servers: Optional[int] = setting(None, group=SERVER, resumable=True, check=integer(1),
        help="engine server: start this many local vLLM servers instead")
    weights_dir: Optional[str] = setting(None, group=SERVER, resumable=True,
        help="engine server: a folder every server can read, for new weights (default: <run>/.weights)")
    weight_swap: str = setting("wait", group=SERVER, resumable=True, check=one_of(WEIGHT_SWAPS),
        help="engine server: requests in flight during a weight sync: wait (finish on the old weights), keep (continue "
             "on the new ones) or abort (start again)")
    engine_timeout: float = setting(600.0, group=SERVER, resumable=True, check=number(above=0),
        help="engine server: seconds without an answer before a server is marked down")
    weight_transfer: str = setting("storage", group=SERVER, check=one_of(WEIGHT_TRANSFERS),
        help="engine server: how new weights reach the servers: storage (through weights_dir) or nccl (from the "
             "trainer's GPU to the servers' GPUs, vLLM's NCCL engine; docs/scale.md)")
    weight_transfer_host: Optional[str] = setting(None, group=SERVER,
        help="weight transfer nccl: this machine's address the servers join the NCCL groups at (default: its address "
             "on the route to each server)")
    trainer_ranks: int = setting(1, group=RANKS, resumable=True, check=integer(1),
        help="data-parallel trainer ranks, launched with torchrun (prompts_per_step must be a multiple)")
    fsdp: bool = setting(False, group=RANKS, resumable=True, check=boolean,
        help="shard the model over the trainer ranks with FSDP2 (needs trainer_ranks >= 2)")
    ray: Optional[str] = setting(None, group=RANKS, resumable=True, check=_ray_address,
        help="place the trainer ranks and local servers on a Ray cluster: at ADDRESS (auto, HOST:PORT, "
             "ray://HOST:PORT), or without one on a new local cluster (docs/trainer.md, Trainer ranks on Ray)")
    lora_rank: Optional[int] = setting(None, group=LORA, check=integer(1, at_most=VLLM_MAX_LORA_RANKS[-1]),
        help="train LoRA adapters of this rank (peft) instead of the whole model; the engine gets only the adapter "
             "(docs/trainer.md, LoRA)")
    lora_alpha: Optional[float] = setting(None, group=LORA, check=number(above=0),
        help="LoRA scale numerator: the adapter's update is (alpha / rank) B A (default: 2 * rank)")
    lora_targets: str = setting("all-linear", group=LORA,
        help="the modules that get adapters: all-linear (every linear layer but the LM head) or names, "
             "comma-separated, e.g. q_proj,v_proj")

    @property
    def builtin(self) -> bool:
        return self.model is None

    def resolved_max_new_tokens(self) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else (8 if self.data is None else 512)

    def resolved_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else (BUILTIN_LR if self.builtin else MODEL_LR)

    def vcpo_config(self) -> VCPOConfig:
        options = dict(LOSS_PRESETS[self.loss])
        if self.ess_scaling is not None:
            options["lr_rule"] = DEFAULT_LR_RULE if self.ess_scaling else None
        if self.opob is not None:
            options.update({"advantage": "opob", "grad_norms": "exact"} if self.opob
                           else {"advantage": "grpo", "grad_norms": "uniform"})
        options.update(self.vcpo)
        # the step's log-probs are of the distribution sampled from, in the trainer's precision
        options.update(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                       autocast=PRECISIONS[self.precision][1])
        try:
            return VCPOConfig(**options)
        except TypeError as e:  # an unknown field name
            raise ValueError(f"vcpo: {e}") from None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "TrainConfig":
        """Each setting's own check, then the rules between settings, each error naming a setting. A TrainConfig is
        validated when it is made; this is for one whose fields were assigned since."""
        for f in fields(self):
            value, check = getattr(self, f.name), f.metadata["check"]
            if check is not None and not (value is None and f.default is None):  # None: unset, where the default
                check(value, f.name)
        options = self.vcpo_config()  # the preset, the switches and vcpo together: its errors name the option
        if options.trust_rule != "none" and options.is_correction == "truncate":
            raise ValueError(f"vcpo: trust_region {options.trust_rule!r} reads the ratio pi / mu (the trainer takes one "
                             "step per batch, in bypass mode), which is the importance weight itself: is_correction "
                             "truncate would weight each unit a second time; use is_correction none or mask")
        if self.model is None and self.data is not None:
            raise ValueError("data needs model: the built-in tiny model only knows the built-in addition task")
        if self.eval_data is not None and self.data is None:
            raise ValueError("eval_data needs data (and model): the built-in task holds out eval_size of its own "
                             "problems")
        if self.exact_staleness and self.engine == "server":
            raise ValueError("exact_staleness needs engine process or inprocess: a server loads weights while it "
                             "generates, so a batch's tokens span versions")
        if self.trainer_ranks > 1 and self.engine == "inprocess":
            raise ValueError("trainer_ranks > 1 needs engine process or server: an in-process vLLM engine takes over "
                             "torch.distributed in the trainer's process")
        if self.fsdp and self.trainer_ranks < 2:
            raise ValueError("fsdp shards the model over the trainer ranks: it needs trainer_ranks >= 2 (torchrun "
                             "--nproc-per-node N, or --trainer-ranks N)")
        if self.fsdp and options.fused_lm_head:
            raise ValueError("fsdp: fused_lm_head needs the LM head's weight outside its module's forward, where "
                             "FSDP2 has it sharded; use fused_lm_head false")
        if self.memory_budget_gib is not None and options.micro_batch_size is not None:
            raise ValueError(f"memory_budget_gib ({self.memory_budget_gib}) chooses the micro-batch size; vcpo sets "
                             f"micro_batch_size ({options.micro_batch_size}): give one or the other")
        if self.prompts_per_step % self.trainer_ranks:
            raise ValueError(f"prompts_per_step ({self.prompts_per_step}) must be a multiple of trainer_ranks "
                             f"({self.trainer_ranks}): each rank trains on whole prompt groups, as many as the others")
        self._validate_server_settings()
        from .lora import check_settings

        check_settings(self.lora_rank, self.lora_alpha, self.lora_targets, engine=self.engine,
                       fused_lm_head=options.fused_lm_head,
                       weight_transfer=self.weight_transfer, weight_swap=self.weight_swap)
        return self

    def _validate_server_settings(self) -> None:
        self._validate_weight_transfer()
        if self.engine != "server":
            for name in ("engine_urls", "engine_servers", "weights_dir"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is a setting of the server pool: add --engine server")
            return
        if (self.engine_urls is None) == (self.engine_servers is None):
            raise ValueError("engine: server needs exactly one of engine_urls (running servers) and engine_servers "
                             "(how many to start here)")
        if self.engine_urls is not None:
            parse_urls(self.engine_urls)

    def _validate_weight_transfer(self) -> None:
        if self.weight_transfer == "storage":
            if self.weight_transfer_host is not None:
                raise ValueError("weight_transfer_host is a setting of the NCCL transfer: add --weight-transfer nccl")
            return
        if self.engine != "server":
            raise ValueError("weight_transfer: nccl is a setting of the server pool: add --engine server")
        import torch

        if not torch.cuda.is_available():
            raise ValueError("weight_transfer: nccl sends the weights from the trainer's GPU, and this machine has no "
                             "CUDA device: use weight_transfer storage")
        gpus, needed = torch.cuda.device_count(), self.trainer_ranks + (self.engine_servers or 0)
        if self.engine_servers is not None and gpus < needed:
            raise ValueError(f"weight_transfer: nccl with engine_servers {self.engine_servers} and trainer_ranks "
                             f"{self.trainer_ranks} needs {needed} GPUs, one per trainer rank and one per server (NCCL "
                             f"cannot put two ranks of a group on one GPU); this machine has {gpus}")
        if self.weight_transfer_host is not None:
            host = self.weight_transfer_host
            try:  # binding it is what vLLM's rendezvous will do, on IPv4
                with socket.create_server((host, 0)):
                    pass
            except (OSError, TypeError, UnicodeError) as e:
                raise ValueError(f"weight_transfer_host must be an address of this machine that the servers can "
                                 f"reach, got {host!r} ({type(e).__name__}: {e})") from None

    def server_urls(self) -> list[str]:
        return parse_urls(self.engine_urls) if self.engine_urls is not None else []

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# the settings a resumed run may change; the others define the run and must stay as they were
RESUMABLE = frozenset(f.name for f in fields(TrainConfig) if f.metadata["resumable"])


def parse_urls(spec: str) -> list[str]:
    """"http://host:port,..." -> the URLs, each with a scheme, a host and a numeric port."""
    from urllib.parse import urlsplit

    urls = [u.strip() for u in str(spec).split(",") if u.strip()]
    if not urls:
        raise ValueError(f"engine_urls must list server URLs like http://host:8000,http://host2:8000, got {spec!r}")
    for url in urls:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"engine_urls: the port of {url!r} is not a number from 0 to 65535") from None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ValueError(f"engine_urls: {url!r} is not like http://host:port")
    if len(set(urls)) != len(urls):
        raise ValueError(f"engine_urls: a URL is listed twice in {spec!r}")
    return [u.rstrip("/") for u in urls]


FIELD_NAMES = {f.name for f in fields(TrainConfig)}


def load_file(path: str) -> dict:
    """A YAML (.yaml/.yml), TOML (.toml) or JSON file of TrainConfig fields; VCPO options under `vcpo`."""
    if not os.path.isfile(path):
        raise ValueError(f"config: no such file {path!r}")
    with open(path, "rb") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(f) or {}
        elif path.endswith(".toml"):
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10: tomli is the same parser (vcpo[train] installs it there)
                import tomli as tomllib

            data = tomllib.load(f)
        elif path.endswith(".json"):
            data = json.load(f)
        else:
            raise ValueError(f"config must be a .yaml, .yml, .toml or .json file, got {path!r}")
    if not isinstance(data, dict):
        raise ValueError(f"config: {path} must hold a mapping of settings")
    unknown = set(data) - FIELD_NAMES
    if unknown:
        raise ValueError(f"config: unknown settings {sorted(unknown)} in {path}")
    return data


def make_config(base: Optional[dict] = None, **overrides) -> TrainConfig:
    """TrainConfig from a mapping (a file, a resumed run's config) and overrides; `vcpo` mappings merge."""
    data = dict(base or {})
    for key, value in overrides.items():
        if key == "vcpo":
            data["vcpo"] = {**data.get("vcpo", {}), **value}
        else:
            data[key] = value
    unknown = set(data) - FIELD_NAMES
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}")
    return TrainConfig(**data)
