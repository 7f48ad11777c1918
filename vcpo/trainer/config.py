"""TrainConfig: every setting of `vcpo train`, from defaults, a YAML/TOML file and the command line, with the
update rule given as a preset (`loss`) plus VCPO loss options (docs/trainer.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from vcpo.config import VCPOConfig

from .gguf_models import is_gguf
from .lr_schedule import LR_SCHEDULES
from .report import parse_report_to

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
    # PPO clipping of pi/mu (the proximal policy is the behaviour policy), no further correction
    "ppo": {"is_correction": "none", "advantage": "grpo", "lr_rule": None, "grad_norms": "uniform",
            "clip_ratio": (0.2, 0.28)},
}
ENGINE_MODES = ("process", "inprocess", "server")  # the `engine` setting; engines/start.py builds each
WEIGHT_SWAPS = ("wait", "keep", "abort")
WEIGHT_TRANSFERS = ("storage", "nccl")  # docs/scale.md, "Weight transfer over NCCL"
SAMPLING_REFUSED = (
    "vLLM would sample from the truncated, renormalised distribution, so the trainer's log-probs would have to be "
    "of that same distribution, whose token set comes from sorting the logits: the trainer's forward does not "
    "round as the engine's does, so a token at the edge of the set can be in one and not the other (log-prob "
    "-inf, an infinite importance weight), and the fused LM head never forms the logits the sort needs. Use "
    "temperature < 1 to sharpen the sampling (docs/trainer.md, \"Sampling settings\")")


# the settings' groups, in the order of `vcpo train --help` and of the settings table
DATA, RUN, SAMPLING, UPDATE, BOOKKEEPING, ENGINE, SERVER, RANKS, LORA = (
    "task and data", "the run", "sampling (docs/trainer.md, Sampling settings)", "the update", "bookkeeping",
    "the engine", "engine: server (docs/scale.md)", "trainer ranks (docs/trainer.md, Trainer ranks)",
    "LoRA (docs/trainer.md, LoRA)")
BUILTIN_LR, MODEL_LR = 3e-4, 1e-6  # AdamW's learning rate unless `lr` is given: the built-in tiny model's, any other's


def setting(default: Any = dataclasses.MISSING, *, group: str, help: str, resumable: bool = False,
            factory: Any = dataclasses.MISSING) -> Any:
    """A TrainConfig field that carries its `help` (the CLI's and the settings table's), its `group`, and whether
    it is `resumable` (a resumed run may change it; the others define the run)."""
    metadata = {"help": help, "group": group, "resumable": resumable}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _short(x: float) -> str:
    """3e-4, not 0.0003."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


@dataclass
class TrainConfig:
    """The settings of `vcpo train`. Each is written once, here: its default, its help, its group and whether a
    resumed run may change it (setting); the CLI's flags and help, RESUMABLE and the settings table of
    docs/trainer.md (tools/settings_table.py) are made from these fields."""

    model: Optional[str] = setting(None, group=DATA,
        help="a local Hugging Face causal LM folder (default: the built-in tiny Llama)")
    data: Optional[str] = setting(None, group=DATA,
        help="a .jsonl or .parquet file or a `datasets` folder (save_to_disk) of prompts and answers (default: the "
             "built-in addition task)")
    reward: Optional[str] = setting(None, group=DATA,
        help="exact (exact match), math (the final answer: the last \\boxed{}, else an 'Answer:' line; a number when "
             "the gold is one, else symbolic equivalence), math-lenient (math-verify's own extraction: the last "
             "expression anywhere) or module:function, called as function(response, answer[, example]) -> float or "
             "dict with 'reward', in worker processes (async: in the trainer) (default: exact)")
    reward_workers: int = setting(4, group=DATA, resumable=True,
        help="reward calls in flight at once (worker processes for a sync function)")
    reward_timeout: float = setting(30.0, group=DATA, resumable=True,
        help="seconds per reward call (then its worker process is killed and replaced)")
    reward_errors: str = setting("raise", group=DATA, resumable=True,
        help="a reward call that raises or times out: raise (stop the run) or zero (score it 0)")
    prompt_field: str = setting("prompt", group=DATA, help="the data's prompt column")
    answer_field: str = setting("answer", group=DATA, help="the data's answer column")
    chat_template: str = setting("auto", group=DATA,
        help="auto (the tokenizer's chat template, if it has one), none (prompts as written) or a Jinja template file")
    system_prompt: Optional[str] = setting(None, group=DATA,
        help="a system message before every prompt (needs a chat template)")
    eval_size: int = setting(128, group=DATA,
        help="prompts held out (seeded) for the greedy evaluation; not used with eval_data")
    eval_data: Optional[str] = setting(None, group=DATA,
        help="a separate held-out file or `datasets` folder (as data: same formats and fields): the greedy "
             "evaluation uses every row of it, every row of data trains, and eval_size is not used")
    warm_start_steps: int = setting(220, group=DATA, help="built-in model: supervised steps before RL (cached)")
    output_dir: Optional[str] = setting(None, group=RUN, resumable=True,
        help="the run folder (default: runs/vcpo-<date>-<time>)")
    steps: int = setting(1500, group=RUN, resumable=True, help="optimizer steps")
    prompts_per_step: int = setting(16, group=RUN, help="prompts per step")
    responses_per_prompt: int = setting(8, group=RUN, help="responses sampled per prompt (the group size)")
    max_new_tokens: Optional[int] = setting(None, group=RUN, help="default: 8 on the built-in task, else 512")
    max_staleness: int = setting(4, group=RUN,
        help="k: the largest policy-version lag of a consumed sample (0 = synchronous)")
    exact_staleness: bool = setting(False, group=RUN,
        help="the trainer also waits for the engine, so every batch from k on has lag exactly k")
    seed: int = setting(0, group=RUN, help="prompt order, sampling seeds, initial RNG")
    temperature: float = setting(1.0, group=SAMPLING,
        help="sampling temperature of the rollouts and of vcpo eval's samples; the trainer's log-probs are taken at it "
             "(the evaluation's greedy decoding is unchanged)")
    top_p: float = setting(1.0, group=SAMPLING,
        help="nucleus sampling: only 1 (off); less is refused (docs/trainer.md, Sampling settings)")
    top_k: int = setting(-1, group=SAMPLING,
        help="top-k sampling: only -1 or 0 (off); more is refused (docs/trainer.md, Sampling settings)")
    loss: str = setting("vcpo", group=UPDATE, help=f"update rule: {', '.join(LOSS_PRESETS)}")
    ess_scaling: Optional[bool] = setting(None, group=UPDATE,
        help="ESS-scaled learning rate on or off, over the preset")
    opob: Optional[bool] = setting(None, group=UPDATE,
        help="OPOB with exact per-sequence norms on, or the group mean, over the preset")
    vcpo: dict = setting(factory=dict, group=UPDATE,
        help="the VCPO loss options over the preset: any VCPOConfig field (docs/contract.md), applied last; on the "
             "command line one flag each, e.g. --is-level sequence")
    lr: Optional[float] = setting(None, group=UPDATE,
        help=f"AdamW learning rate (default: {_short(BUILTIN_LR)} on the tiny model, else {_short(MODEL_LR)})")
    lr_schedule: str = setting("cosine", group=UPDATE,
        help=f"the lr over the steps: {', '.join(LR_SCHEDULES)} (cosine, linear: a decay from lr to lr_min_ratio x lr "
             "at the last step, `steps`; bench/RESULTS.md, \"The main job with a decaying lr\")")
    lr_warmup_steps: int = setting(0, group=UPDATE,
        help="steps of a linear warm-up of the lr from lr / lr_warmup_steps")
    lr_min_ratio: float = setting(0.1, group=UPDATE, help="the lr at the last step of a decay, as a fraction of lr")
    weight_decay: float = setting(0.0, group=UPDATE, help="AdamW")
    max_skipped_steps: int = setting(10, group=UPDATE, resumable=True,
        help="steps in a row skipped as non-finite (loss, gradient norm or lr scale) that stop the run, after a "
             "checkpoint")
    checkpoint_every: int = setting(50, group=BOOKKEEPING, resumable=True, help="steps between checkpoints")
    keep_checkpoints: int = setting(2, group=BOOKKEEPING, resumable=True, help="checkpoints kept")
    eval_every: int = setting(20, group=BOOKKEEPING, resumable=True, help="versions between greedy evaluations")
    report_to: str = setting("none", group=BOOKKEEPING, resumable=True,
        help="metrics also to tensorboard (<run>/tensorboard) and/or wandb (<run>/wandb), comma-separated")
    engine: str = setting("process", group=ENGINE, resumable=True,
        help="process (vLLM in its own processes), inprocess, or server (a pool of vLLM servers, docs/scale.md)")
    engine_cores: Optional[str] = setting(None, group=ENGINE, resumable=True,
        help="CPU: the engine's cores, e.g. 1 (default: the last)")
    trainer_cores: Optional[str] = setting(None, group=ENGINE, resumable=True,
        help="CPU: the trainer's cores (default: the others)")
    kv_cache_gib: float = setting(1.0, group=ENGINE, resumable=True, help="the engine's KV cache (CPU)")
    dtype: str = setting("float32", group=ENGINE, help="the engine's dtype: float32, bfloat16, float16")
    max_model_len: Optional[int] = setting(None, group=ENGINE, help="default: the longest prompt plus max_new_tokens")
    gpu_memory_utilization: float = setting(0.3, group=ENGINE, resumable=True,
        help="GPU: the engine's share of the GPU memory")
    engine_urls: Optional[str] = setting(None, group=SERVER, resumable=True,
        help="engine server: running vLLM servers, http://host:port,... (see vcpo serve)")
    engine_servers: Optional[int] = setting(None, group=SERVER, resumable=True,
        help="engine server: start this many local vLLM servers instead")
    weights_dir: Optional[str] = setting(None, group=SERVER, resumable=True,
        help="engine server: a folder every server can read, for new weights (default: <run>/.weights)")
    weight_swap: str = setting("wait", group=SERVER, resumable=True,
        help="engine server: requests in flight during a weight sync: wait (finish on the old weights), keep (continue "
             "on the new ones) or abort (start again)")
    engine_timeout: float = setting(600.0, group=SERVER, resumable=True,
        help="engine server: seconds without an answer before a server is marked down")
    weight_transfer: str = setting("storage", group=SERVER,
        help="engine server: how new weights reach the servers: storage (through weights_dir) or nccl (from the "
             "trainer's GPU to the servers' GPUs, vLLM's NCCL engine; docs/scale.md)")
    weight_transfer_host: Optional[str] = setting(None, group=SERVER,
        help="weight transfer nccl: this machine's address the servers join the NCCL groups at (default: its address "
             "on the route to each server)")
    trainer_ranks: int = setting(1, group=RANKS, resumable=True,
        help="data-parallel trainer ranks, launched with torchrun (prompts_per_step must be a multiple)")
    fsdp: bool = setting(False, group=RANKS, resumable=True,
        help="shard the model over the trainer ranks with FSDP2 (needs trainer_ranks >= 2)")
    ray: Optional[str] = setting(None, group=RANKS, resumable=True,
        help="place the trainer ranks and local servers on a Ray cluster: at ADDRESS (auto, HOST:PORT, "
             "ray://HOST:PORT), or without one on a new local cluster (docs/trainer.md, Trainer ranks on Ray)")
    lora_rank: Optional[int] = setting(None, group=LORA,
        help="train LoRA adapters of this rank (peft) instead of the whole model; the engine gets only the adapter "
             "(docs/trainer.md, LoRA)")
    lora_alpha: Optional[float] = setting(None, group=LORA,
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
            options["lr_rule"] = "sqrt" if self.ess_scaling else None
        if self.opob is not None:
            options.update({"advantage": "opob", "grad_norms": "exact"} if self.opob
                           else {"advantage": "grpo", "grad_norms": "uniform"})
        options.update(self.vcpo)
        options["temperature"] = self.temperature  # the step's log-probs are of the distribution sampled from
        try:
            return VCPOConfig(**options)
        except TypeError as e:  # an unknown field name
            raise ValueError(f"vcpo: {e}") from None

    def validate(self) -> "TrainConfig":
        def positive_int(name: str, minimum: int = 1) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")

        def positive_float(name: str, allow_zero: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                    v < 0 or (v == 0 and not allow_zero):
                raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {v!r}")

        for name in ("steps", "prompts_per_step", "responses_per_prompt", "checkpoint_every", "keep_checkpoints",
                     "trainer_ranks", "reward_workers", "max_skipped_steps"):
            positive_int(name)
        positive_float("reward_timeout")
        if self.reward_errors not in ("raise", "zero"):
            raise ValueError(f"reward_errors must be raise or zero, got {self.reward_errors!r}")
        if not isinstance(self.chat_template, str) or not self.chat_template:
            raise ValueError(f"chat_template must be auto, none or a Jinja template file, got {self.chat_template!r}")
        if self.chat_template not in ("auto", "none") and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template: no such Jinja template file {self.chat_template!r} (or: auto, none)")
        for name in ("max_staleness", "eval_every", "eval_size", "seed", "warm_start_steps", "lr_warmup_steps"):
            positive_int(name, 0)
        if self.max_new_tokens is not None:
            positive_int("max_new_tokens")
        if self.max_model_len is not None:
            positive_int("max_model_len")
        positive_float("weight_decay", allow_zero=True)
        positive_float("kv_cache_gib")
        positive_float("gpu_memory_utilization")
        if self.lr is not None:
            positive_float("lr")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        if isinstance(self.lr_min_ratio, bool) or not isinstance(self.lr_min_ratio, (int, float)) or \
                not 0 <= self.lr_min_ratio <= 1:
            raise ValueError(f"lr_min_ratio must be a number in [0, 1], got {self.lr_min_ratio!r}")
        if self.loss not in LOSS_PRESETS:
            raise ValueError(f"loss must be one of {list(LOSS_PRESETS)}, got {self.loss!r}")
        if self.engine not in ENGINE_MODES:
            raise ValueError(f"engine must be one of {list(ENGINE_MODES)}, got {self.engine!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("ess_scaling", "opob"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be true, false or unset, got {getattr(self, name)!r}")
        if not isinstance(self.vcpo, dict):
            raise ValueError(f"vcpo must be a mapping of VCPO loss options, got {self.vcpo!r}")
        self._validate_sampling()
        if self.model is not None and not os.path.isdir(self.model) and not is_gguf(self.model):
            raise ValueError(f"model must be a local Hugging Face model folder or a .gguf file, got {self.model!r}")
        if self.model is None and self.data is not None:
            raise ValueError("data needs model: the built-in tiny model only knows the built-in addition task")
        self._validate_eval_data()
        for name in ("engine_cores", "trainer_cores"):
            v = getattr(self, name)
            if v is not None:
                parse_cores(v, name)
        if self.exact_staleness not in (True, False):
            raise ValueError(f"exact_staleness must be true or false, got {self.exact_staleness!r}")
        if self.exact_staleness and self.engine == "server":
            raise ValueError("exact_staleness needs engine process or inprocess: a server loads weights while it "
                             "generates, so a batch's tokens span versions")
        if self.trainer_ranks > 1 and self.engine == "inprocess":
            raise ValueError("trainer_ranks > 1 needs engine process or server: an in-process vLLM engine takes over "
                             "torch.distributed in the trainer's process")
        if self.fsdp not in (True, False):
            raise ValueError(f"fsdp must be true or false, got {self.fsdp!r}")
        if self.fsdp and self.trainer_ranks < 2:
            raise ValueError("fsdp shards the model over the trainer ranks: it needs trainer_ranks >= 2 (torchrun "
                             "--nproc-per-node N, or --trainer-ranks N)")
        if self.fsdp and self.vcpo_config().fused_lm_head:
            raise ValueError("fsdp: fused_lm_head needs the LM head's weight outside its module's forward, where "
                             "FSDP2 has it sharded; use fused_lm_head false")
        if self.ray is not None and not isinstance(self.ray, str):
            raise ValueError(f"ray must be local or a Ray cluster's address (auto, HOST:PORT, ray://HOST:PORT), got "
                             f"{self.ray!r}")
        if self.prompts_per_step % self.trainer_ranks:
            raise ValueError(f"prompts_per_step ({self.prompts_per_step}) must be a multiple of trainer_ranks "
                             f"({self.trainer_ranks}): each rank trains on whole prompt groups, as many as the others")
        self._validate_server_settings()
        from .lora import check_settings

        check_settings(self.lora_rank, self.lora_alpha, self.lora_targets, engine=self.engine, fsdp=self.fsdp,
                       trainer_ranks=self.trainer_ranks, fused_lm_head=self.vcpo_config().fused_lm_head)
        parse_report_to(self.report_to)
        self.vcpo_config()
        return self

    def _validate_eval_data(self) -> None:
        if self.eval_data is None:
            return
        if not isinstance(self.eval_data, str) or not self.eval_data:
            raise ValueError(f"eval_data must be the path of a held-out .jsonl or .parquet file or `datasets` folder, "
                             f"got {self.eval_data!r}")
        if self.data is None:
            raise ValueError("eval_data needs data (and model): the built-in task holds out eval_size of its own "
                             "problems")
        if not os.path.exists(self.eval_data):
            raise ValueError(f"eval_data: no such file or folder {self.eval_data!r}")

    def _validate_sampling(self) -> None:
        if "temperature" in self.vcpo:
            raise ValueError("vcpo.temperature follows the sampling setting: set temperature instead")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0: off), got {self.top_k!r}")
        for name, on in (("top_p", self.top_p < 1), ("top_k", self.top_k > 0)):
            if on:
                raise ValueError(f"{name} {getattr(self, name)!r} is refused: {SAMPLING_REFUSED}")

    def _validate_server_settings(self) -> None:
        if self.weight_swap not in WEIGHT_SWAPS:
            raise ValueError(f"weight_swap must be one of {list(WEIGHT_SWAPS)}, got {self.weight_swap!r}")
        if isinstance(self.engine_timeout, bool) or not isinstance(self.engine_timeout, (int, float)) or \
                not self.engine_timeout > 0 or not math.isfinite(self.engine_timeout):
            raise ValueError(f"engine_timeout must be a finite number of seconds > 0, got {self.engine_timeout!r}")
        self._validate_weight_transfer()
        if self.engine != "server":
            for name in ("engine_urls", "engine_servers", "weights_dir"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is a setting of the server pool: add --engine server")
            return
        if (self.engine_urls is None) == (self.engine_servers is None):
            raise ValueError("engine: server needs exactly one of engine_urls (running servers) and engine_servers "
                             "(how many to start here)")
        if self.engine_servers is not None:
            v = self.engine_servers
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"engine_servers must be an integer >= 1, got {v!r}")
        else:
            parse_urls(self.engine_urls)

    def _validate_weight_transfer(self) -> None:
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(f"weight_transfer must be one of {list(WEIGHT_TRANSFERS)}, got {self.weight_transfer!r}")
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
        gpus = torch.cuda.device_count()
        trainer = self.trainer_ranks if isinstance(self.trainer_ranks, int) else 1
        if self.engine_servers is not None and isinstance(self.engine_servers, int) and \
                gpus < trainer + self.engine_servers:
            raise ValueError(f"weight_transfer: nccl with engine_servers {self.engine_servers} and trainer_ranks "
                             f"{trainer} needs {trainer + self.engine_servers} GPUs, one per trainer rank and one per "
                             f"server (NCCL cannot put two ranks of a group on one GPU); this machine has {gpus}")
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
    return TrainConfig(**data).validate()
