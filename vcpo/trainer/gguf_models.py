"""A model given as one GGUF file (`--model PATH.gguf`, docs/trainer.md "Models from GGUF files"): transformers
dequantizes it to float32 once, and the result is saved as a plain Hugging Face folder (weights, config, tokenizer
and chat template) in the cache ($VCPO_CACHE, default ~/.cache/vcpo), named by a hash of the file's bytes and reused
after. vLLM and the trainer both load that folder. Needs the `gguf` package (`pip install 'vcpo[gguf]'`)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile

from .tiny import cache_root

GGUF_SUFFIX = ".gguf"


def is_gguf(path: str | None) -> bool:
    return isinstance(path, str) and path.lower().endswith(GGUF_SUFFIX)


def file_digest(path: str) -> str:
    """The first 16 hex digits of the SHA-256 of the file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def model_folder(path: str, log=print) -> str:
    """`path` itself when it is a folder; for a GGUF file the folder of its float32 conversion (made on first use).
    A file that transformers cannot load (not GGUF, an architecture or quantization type it does not know) is a
    ValueError naming the file and transformers' reason."""
    if not is_gguf(path):
        return path
    if not os.path.isfile(path):
        raise ValueError(f"model: no such GGUF file {path!r}")
    folder = os.path.join(cache_root(), f"gguf-{file_digest(path)}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model: {path} is a GGUF file, which needs the gguf package: pip install 'vcpo[gguf]'")
    log(f"converting {path} to a float32 Hugging Face folder (cached in {folder}; once per file)")
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-gguf-")
    try:
        _convert(path, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, folder)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert(path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, OSError, RuntimeError) as err:
        raise ValueError(f"model: transformers cannot load the GGUF file {path}: {err}") from None
    # The loaded model is flagged as GGUF-quantized, which save_pretrained refuses: its dequantized weights go into
    # a plain model of the same configuration.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
