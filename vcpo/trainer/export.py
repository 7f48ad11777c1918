"""`vcpo export RUN_OR_CHECKPOINT --output DIR`: a checkpoint as a standalone Hugging Face model folder. A LoRA
checkpoint's adapter is merged into its base model (peft's merge_and_unload); a full checkpoint is saved without
the trainer's files (docs/trainer.md, "LoRA")."""

from __future__ import annotations

import os
import shutil
from typing import Callable

import torch

from . import lora
from .evaluate import resolve_model


def export(source: str, output: str, log: Callable[[str], None] = print) -> str:
    """Write the model of `source` (a run folder: its latest checkpoint; or a checkpoint) to `output`, a new or
    empty folder; returns the checkpoint exported."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, _ = resolve_model(source)
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise ValueError(f"output {output!r} exists and is not an empty folder")
    if lora.is_adapter(checkpoint):
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(lora.base_model_dir(checkpoint), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.save_pretrained(output, safe_serialization=True)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(output)
    generation = os.path.join(checkpoint, "generation_config.json")
    if os.path.isfile(generation):
        shutil.copy(generation, output)
    log(f"{checkpoint} -> {output}" + (" (adapter merged into its base model)" if lora.is_adapter(checkpoint) else ""))
    return checkpoint
