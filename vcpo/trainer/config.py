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

from .engines.interface import ENGINE_MODES
from .gguf_models import is_gguf
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
WEIGHT_SWAPS = ("wait", "keep", "abort")
WEIGHT_TRANSFERS = ("storage", "nccl")  # docs/scale.md, "Weight transfer over NCCL"
SAMPLING_REFUSED = (
    "vLLM would sample from the truncated, renormalised distribution, so the trainer's log-probs would have to be "
    "of that same distribution, whose token set comes from sorting the logits: the trainer's forward does not "
    "round as the engine's does, so a token at the edge of the set can be in one and not the other (log-prob "
    "-inf, an infinite importance weight), and the fused LM head never forms the logits the sort needs. Use "
    "temperature < 1 to sharpen the sampling (docs/trainer.md, \"Sampling settings\")")


@dataclass
class TrainConfig:
    # what to train on; None = the embedded default (tiny Llama, addition task)
    model: Optional[str] = None
    data: Optional[str] = None
    reward: Optional[str] = None  # exact (the default), a BUILTIN_REWARDS name or "module:function" (rewards.py)
    reward_workers: int = 4  # reward calls in flight at once
    reward_timeout: float = 30.0  # seconds per reward call
    reward_errors: str = "raise"  # a failed reward call: raise (stop the run) or zero (score 0)
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat_template: str = "auto"  # auto (the tokenizer's, if any), none, or a Jinja file (task.PromptFormat)
    system_prompt: Optional[str] = None  # a system message before each prompt (needs a chat template)
    eval_size: int = 128  # prompts held out of the data for the greedy evaluation
    warm_start_steps: int = 220  # built-in model only: supervised steps before RL (cached)
    # the run
    output_dir: Optional[str] = None  # default runs/vcpo-<date>-<time>
    steps: int = 1500
    prompts_per_step: int = 16
    responses_per_prompt: int = 8
    max_new_tokens: Optional[int] = None  # default 8 on the built-in task, 512 otherwise
    max_staleness: int = 4
    exact_staleness: bool = False  # the trainer also waits: every batch from k on has lag exactly k (rollouts.py)
    seed: int = 0
    # sampling (docs/trainer.md, "Sampling settings"): the trainer's log-probs are taken at the same temperature
    temperature: float = 1.0
    top_p: float = 1.0  # 1: off (anything less is refused: see SAMPLING_REFUSED)
    top_k: int = -1  # -1 or 0: off (anything more is refused)
    # the update
    loss: str = "vcpo"
    ess_scaling: Optional[bool] = None  # override the preset: ESS-scaled lr (sqrt rule) on or off
    opob: Optional[bool] = None  # override the preset: OPOB with exact norms, or the group mean
    vcpo: dict = field(default_factory=dict)  # any VCPOConfig field, applied last
    lr: Optional[float] = None  # default 3e-4 on the tiny model, 1e-6 otherwise
    weight_decay: float = 0.0
    # a non-finite step is skipped (vcpo.step); this many in a row stop the run (docs/trainer.md, Interrupt and resume)
    max_skipped_steps: int = 10
    # bookkeeping
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 20
    report_to: str = "none"  # metrics also to: tensorboard, wandb (comma-separated; vcpo/trainer/report.py)
    # the engine
    engine: str = "process"
    engine_cores: Optional[str] = None  # CPU: vLLM's worker cores, e.g. "1"; default: the last core
    trainer_cores: Optional[str] = None  # CPU: the trainer's cores, e.g. "0"; default: all but the engine's
    kv_cache_gib: float = 1.0
    dtype: str = "float32"
    max_model_len: Optional[int] = None
    gpu_memory_utilization: float = 0.3
    # engine: server (docs/scale.md)
    engine_urls: Optional[str] = None  # running vLLM servers, "http://host:port,..."
    engine_servers: Optional[int] = None  # or: start this many local servers
    weights_dir: Optional[str] = None  # where the servers read new weights; default <run>/.weights
    weight_swap: str = "wait"  # what requests in flight do during a weight sync: wait, keep, abort
    engine_timeout: float = 600.0  # seconds without an answer before a server is marked down
    weight_transfer: str = "storage"  # how new weights reach the servers: storage (weights_dir) or nccl
    weight_transfer_host: Optional[str] = None  # nccl: this machine's address for the servers (default: per route)
    # trainer ranks (torchrun; docs/trainer.md): data-parallel replicas, each on its share of the prompt groups
    trainer_ranks: int = 1
    fsdp: bool = False  # shard the model over the trainer ranks (FSDP2; docs/scale.md)
    ray: Optional[str] = None  # place the ranks and servers on Ray: "local" (a new local cluster) or its address
    # LoRA (docs/trainer.md, "LoRA"; vcpo/trainer/lora.py): only the adapter trains and goes to the engine
    lora_rank: Optional[int] = None  # None: full fine-tuning
    lora_alpha: Optional[float] = None  # default 2 * lora_rank
    lora_targets: str = "all-linear"  # peft's every linear layer but the LM head, or module names, comma-separated

    @property
    def builtin(self) -> bool:
        return self.model is None

    def resolved_max_new_tokens(self) -> int:
        return self.max_new_tokens if self.max_new_tokens is not None else (8 if self.data is None else 512)

    def resolved_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def resolved_lr(self) -> float:
        return self.lr if self.lr is not None else (3e-4 if self.builtin else 1e-6)

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
        for name in ("max_staleness", "eval_every", "eval_size", "seed", "warm_start_steps"):
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
