"""`--model PATH.gguf` (vcpo/trainer/gguf_models.py): a folder passes through, a GGUF file is converted once into
the cache under its content hash and reused, and a file transformers cannot load is an error naming it and the
reason. (The real conversion of SmolLM2-135M-Instruct: tests/trainer/test_real_model.py, slow tier.)"""

import os

import pytest

from vcpo.trainer import gguf_models

gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VCPO_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def write_gguf(path, arch="llama"):
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_folder_or_no_model_passes_through(tmp_path):
    assert gguf_models.model_folder(str(tmp_path)) == str(tmp_path)
    assert not gguf_models.is_gguf(None) and gguf_models.is_gguf("a/B.GGUF")


def test_converted_once_per_content_and_reused(tmp_path, cache, monkeypatch):
    converted = []

    def fake_convert(path, out):  # what a conversion leaves
        converted.append(path)
        open(os.path.join(out, "model.safetensors"), "wb").close()

    monkeypatch.setattr(gguf_models, "_convert", fake_convert)
    path = write_gguf(tmp_path / "m.gguf")
    first = gguf_models.model_folder(path, log=lambda m: None)
    assert gguf_models.model_folder(path, log=lambda m: None) == first and converted == [path]
    assert os.path.dirname(first) == str(cache) and os.path.basename(first) == f"gguf-{gguf_models.file_digest(path)}"
    with open(path, "ab") as f:  # other bytes: another conversion, another folder
        f.write(b"\0" * 32)
    assert gguf_models.model_folder(path, log=lambda m: None) != first and len(converted) == 2
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(first), f"gguf-{gguf_models.file_digest(path)}"])


def test_a_failed_conversion_leaves_nothing_in_the_cache(tmp_path, cache, monkeypatch):
    def failing(path, out):
        open(os.path.join(out, "partial"), "wb").close()
        raise ValueError("boom")

    monkeypatch.setattr(gguf_models, "_convert", failing)
    with pytest.raises(ValueError, match="boom"):
        gguf_models.model_folder(write_gguf(tmp_path / "m.gguf"), log=lambda m: None)
    assert os.listdir(cache) == []


@pytest.mark.parametrize("kind, reason", [("arch", "architecture notanarch is not supported"),
                                          ("junk", "not a GGUF file"), ("missing", "no such GGUF file")])
def test_a_file_transformers_cannot_load_is_named(tmp_path, cache, kind, reason):
    path = tmp_path / "model.gguf"
    if kind == "arch":
        write_gguf(path, arch="notanarch")
    elif kind == "junk":
        path.write_bytes(b"not a model" * 8)
    with pytest.raises(ValueError, match="^model: ") as err:
        gguf_models.model_folder(str(path), log=lambda m: None)
    assert str(path) in str(err.value) and reason in str(err.value)
    assert not cache.exists() or os.listdir(cache) == []
