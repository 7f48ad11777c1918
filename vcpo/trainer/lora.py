"""LoRA training (`--lora-rank`, docs/trainer.md "LoRA"): the policy is the base model with peft LoRA adapters, of
which only the adapter trains; the engine serves the base model with vLLM's LoRA support and receives only the
adapter at each sync; a checkpoint is an adapter folder (peft's save_pretrained) that names its base model."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # the file name peft and vLLM read
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank choices


def is_adapter(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))


def base_model_dir(adapter: str) -> str:
    """The base model folder an adapter folder was trained on (recorded by peft)."""
    base = read_adapter_config(adapter).get("base_model_name_or_path")
    if not base or not os.path.isdir(base):
        raise ValueError(f"{adapter}: its adapter's base model folder {base!r} is not on this machine")
    return base


def targets(spec: str):
    """lora_targets: "all-linear" (peft: every linear layer but the LM head) or comma-separated module names."""
    if spec == "all-linear":
        return spec
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise ValueError(f"lora_targets must be all-linear or module names like q_proj,v_proj, got {spec!r}")
    return names


def engine_max_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)


def adapters_in_flight(max_staleness: int) -> int:
    """How many adapter versions a server pool keeps loaded, and vLLM's max_loras (the adapters one batch may
    mix): a request keeps the adapter it named until it ends, and the engine runs ahead of the trainer by at most
    k versions, so the requests in flight name at most k + 1 of them; one more is the new one being loaded."""
    return max_staleness + 2


def server_args(rank: int, max_staleness: int) -> list[str]:
    """A LoRA server's vLLM arguments (and SERVER_ENV in its environment): adapters loaded and unloaded at run
    time over HTTP, up to the run's rank."""
    return ["--enable-lora", "--max-lora-rank", str(engine_max_rank(rank)), "--max-loras",
            str(adapters_in_flight(max_staleness))]


# vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this in the server's environment
SERVER_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def wrap(model, rank: int, alpha: float, target_spec: str, seed: int = 0):
    """`model` with fresh LoRA adapters (B = 0: the policy starts as the base model; A drawn from `seed` alone, so
    a run's adapters do not depend on what drew random numbers before, on any rank); base weights frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets(target_spec), lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return get_peft_model(model, config)
    except ValueError as e:  # target names that match no module of the model
        raise ValueError(f"lora_targets {target_spec!r}: {e}") from None


def load_policy(path: str, rank: int, alpha: float, target_spec: str, dtype: torch.dtype = torch.float32,
                seed: int = 0):
    """The LoRA policy in `dtype`: fresh adapters (drawn from `seed`) on the model folder `path`, or, `path` being
    an adapter checkpoint, its adapters (trainable) on the base model it names."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not is_adapter(path):
        return wrap(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), rank, alpha, target_spec, seed)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir(path), dtype=dtype)
    return PeftModel.from_pretrained(base, path, is_trainable=True)


def adapter_state(model, state_dict: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """CPU copies of the adapter tensors, under peft's file names (what an adapter file holds), read from the model
    or from `state_dict`, its (gathered) state dict."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=state_dict)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def adapter_config(model) -> dict:
    """The adapter's peft config as adapter_config.json holds it."""
    config = model.peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def write_adapter(folder: str, state: dict[str, torch.Tensor], config: dict) -> int:
    """An adapter folder (adapter_config.json, adapter_model.safetensors) that vLLM loads; returns its bytes."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, ADAPTER_WEIGHTS))
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return sum(os.path.getsize(os.path.join(folder, n)) for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG))


def read_adapter_config(adapter: str) -> dict:
    with open(os.path.join(adapter, ADAPTER_CONFIG)) as f:
        return json.load(f)


def check_settings(rank: Optional[int], alpha: Optional[float], target_spec: str, *, engine: str,
                   fused_lm_head: bool, weight_transfer: str, weight_swap: str) -> None:
    """TrainConfig.validate's LoRA part: the rules between the LoRA settings and the others (the range of each is
    its setting's own check)."""
    if rank is None:
        if alpha is not None or target_spec != "all-linear":
            raise ValueError("lora_alpha and lora_targets are settings of LoRA: add --lora-rank R")
        return
    if not isinstance(target_spec, str):
        raise ValueError(f"lora_targets must be all-linear or module names like q_proj,v_proj, got {target_spec!r}")
    targets(target_spec)
    if engine == "server" and weight_transfer != "storage":
        raise ValueError("lora_rank with engine server: the adapter travels as files (weight_transfer storage), "
                         "not over NCCL")
    if engine == "server" and weight_swap != "wait":
        raise ValueError("lora_rank with engine server: each request keeps the adapter it named to its end and a new "
                         "adapter serves the requests sent after it, so no weights are swapped under a request; "
                         "leave weight_swap at wait")
    if fused_lm_head:
        raise ValueError("lora_rank: fused_lm_head differentiates the LM head's weight, which LoRA freezes; use "
                         "fused_lm_head false")
