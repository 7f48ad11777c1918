"""The embedded default: a character tokenizer and a tiny Llama made locally (nothing is downloaded), given a
short supervised warm start on the addition task so that RL starts from a non-zero reward. The result is a
normal Hugging Face model folder, cached under $VCPO_CACHE (default ~/.cache/vcpo) by a hash of its recipe."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from .data import Problem

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789+-*=() ")
PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the cached warm-started model (its hash names the cache folder)."""

    hidden_size: int = 128  # vLLM's CPU attention needs head_dim >= 32: 4 heads of 32
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 64
    warm_start_steps: int = 220
    warm_start_batch: int = 128
    warm_start_lr: float = 1e-3
    seed: int = 0
    format_version: int = 1

    def key(self, problems: list[Problem]) -> str:
        h = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        for p in problems:
            h.update(f"{p.prompt}\x00{p.answer}\x01".encode())
        return h.hexdigest()[:16]


def cache_root() -> str:
    return os.environ.get("VCPO_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "vcpo"))


def build_tokenizer():
    """A character-level fast tokenizer over digits, operators and space, with <s>, </s> and <pad>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def build_model(recipe: TinyRecipe, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers, num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads, max_position_embeddings=recipe.max_positions,
        bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
    )
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(config).float()


def _supervised_batch(tokenizer, problems: list[Problem]):
    """Right-padded prompt+answer+</s> ids with labels on the answer tokens only."""
    rows, labels = [], []
    for p in problems:
        prompt = [BOS] + tokenizer.encode(p.prompt)
        answer = tokenizer.encode(p.answer) + [EOS]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, (ids != PAD).long(), lab


def warm_start(model, tokenizer, problems: list[Problem], recipe: TinyRecipe, log=print) -> None:
    """A deliberately short supervised fine-tune: enough for a non-zero reward, far from solved."""
    rng = random.Random(recipe.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.warm_start_lr, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    for step in range(recipe.warm_start_steps):
        ids, attn, lab = _supervised_batch(tokenizer, rng.sample(problems, recipe.warm_start_batch))
        loss = model(input_ids=ids, attention_mask=attn, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == recipe.warm_start_steps:
            log(f"warm start {step + 1}/{recipe.warm_start_steps}: loss {loss.item():.3f} "
                f"({time.perf_counter() - t0:.0f} s)")


def tiny_model_dir(problems: list[Problem], recipe: TinyRecipe = TinyRecipe(), log=print) -> str:
    """Path of the warm-started tiny model for `problems`, built on first use and cached."""
    folder = os.path.join(cache_root(), f"tiny-llama-{recipe.key(problems)}")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    log(f"building the tiny model (cached in {folder})")
    tokenizer = build_tokenizer()
    model = build_model(recipe, len(tokenizer))
    warm_start(model, tokenizer, problems, recipe, log)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process cached it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
