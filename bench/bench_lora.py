"""LoRA against full fine-tuning: the time of one `vcpo.step` with exact per-sequence gradient norms (VCPO) and
without norms (GRPO), and what a weight sync writes (bytes, seconds for the safetensors folder the engine reads).

The model and batch are bench_step.py's 10M-parameter Llama (hidden 256, 6 layers, vocab 10000), B sequences x
256 tokens; LoRA adapters of rank R on every linear layer but the LM head (`--lora-targets all-linear`, the
default), which then stays frozen with the rest of the base model.

    python bench/bench_lora.py                 # rank 16, 16 sequences, 3 rounds
    python bench/bench_lora.py --rank 64 --batch 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_step import build
from common import GRPO, form_counts, norm_forms


def adapter_form_counts(forms: list) -> str:
    """Per factor (lora_A, lora_B), how many recorded calls took the ghost (g) and materialised (m) norm."""
    cells = []
    for factor in ("lora_A", "lora_B"):
        got = [f for n, f in forms if f".{factor}." in n]
        cells.append(f"{factor} " + "+".join(f"{got.count(f)}{f[0]}" for f in ("ghost", "materialised") if f in got))
    return "  ".join(cells)


def step_seconds(rank, loss: str, rounds: int, batch_size: int) -> dict:
    import torch

    import vcpo
    from vcpo.trainer import lora

    model, batch = build("llama", b=batch_size)
    if rank:
        model = lora.wrap(model, rank, 2.0 * rank, "all-linear")
        with torch.no_grad():  # a trained adapter: B away from its zero start
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)
    config = vcpo.VCPOConfig() if loss == "vcpo" else vcpo.VCPOConfig(**GRPO)
    with norm_forms() as forms:
        vcpo.step(model, optimizer, batch, config)  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        vcpo.step(model, optimizer, batch, config)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "trainable": sum(p.numel() for p in trainable),
            "forms": (adapter_form_counts if rank else form_counts)(forms) if forms else "-", "model": model}


def sync_cost(model, rank) -> tuple[int, float]:
    """Bytes and seconds of what the engine is sent: the adapter folder, or the full safetensors file."""
    from safetensors.torch import save_file

    from vcpo.trainer import lora
    from vcpo.trainer.engines.interface import unique_tensors

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        if rank:
            size = lora.write_adapter(folder, lora.adapter_state(model), lora.adapter_config(model))
        else:
            state = unique_tensors({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"))
            size = os.path.getsize(os.path.join(folder, "model.safetensors"))
        return size, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"| {args.batch} x 256 tokens, fp32, {args.rounds} rounds, median | trainable parameters | GRPO step | "
          "VCPO step (exact norms) | norms' cost (VCPO - GRPO) | VCPO norm forms | sync bytes | sync write |")
    print("|---|---|---|---|---|---|---|---|")
    for rank in (0, args.rank):
        grpo = step_seconds(rank, "grpo", args.rounds, args.batch)
        vcpo_ = step_seconds(rank, "vcpo", args.rounds, args.batch)
        size, seconds = sync_cost(vcpo_["model"], rank)
        print(f"| {'full fine-tuning' if not rank else f'LoRA rank {rank}'} | {vcpo_['trainable']:,} | "
              f"{grpo['median_s']:.3f} s | {vcpo_['median_s']:.3f} s | "
              f"{vcpo_['median_s'] - grpo['median_s']:+.3f} s | {vcpo_['forms']} | {size / 2 ** 20:.2f} MiB | "
              f"{seconds * 1e3:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
