"""vcpo.trainer: asynchronous VCPO training on vLLM rollouts with bounded staleness (`vcpo train`,
docs/trainer.md). Needs the `train` extra (vLLM)."""

from .config import LOSS_PRESETS, TrainConfig, load_file, make_config
from .run import resume_config, train

__all__ = ["TrainConfig", "LOSS_PRESETS", "load_file", "make_config", "resume_config", "train"]
