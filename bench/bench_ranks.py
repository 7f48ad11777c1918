"""One `vcpo.step` on 1 rank against 2 data-parallel gloo ranks (one core each) on the same batch: the step
time, and that the two take the same step (largest parameter difference after one step from the same weights).

Model: a random Llama of about 6M parameters (hidden 256, 4 layers, vocab 10000), fp32; batch 16 sequences x
256 tokens in 4 prompt groups of 4 (each rank gets 2 groups). The 2-rank case runs torch.distributed with gloo
in 2 processes on cores 0 and 1; the 1-rank case runs on core 0 with one thread.

    python bench/bench_ranks.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from common import share

B, T, GROUP, PROMPT = 16, 256, 4, 32
CONFIGS = {"vcpo (book-keeping)": {}, "vcpo, token-mean": {"loss_agg_mode": "token-mean"},
           "vcpo, two-pass": {"assembly": "two_pass"}}


def build(config=None, b: int = B, t: int = T, prompt: int = PROMPT):
    """A random Llama of `config` (default: this bench's 4-layer one) and a batch of `b` sequences of `t` tokens
    of unequal lengths after a `prompt`-token prompt, in prompt groups of GROUP."""
    import torch
    import transformers

    import vcpo

    torch.manual_seed(0)
    if config is None:
        config = transformers.LlamaConfig(vocab_size=10000, hidden_size=256, intermediate_size=688,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                          max_position_embeddings=t)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (b, t), generator=g)
    lengths = prompt + torch.randint(t // 4, t - prompt + 1, (b,), generator=g)  # unequal token counts
    attention = (torch.arange(t) < lengths[:, None]).long()
    loss_mask = attention * (torch.arange(t) >= prompt)
    behavior = -torch.rand(b, t, generator=g) * 8 - 6
    batch = vcpo.RolloutBatch(ids, attention, loss_mask, behavior, torch.randint(0, 2, (b,), generator=g).float(),
                              group_index=torch.arange(b) // GROUP, num_groups=b // GROUP)
    return model, batch


def steps(options: dict, rounds: int, rank: int = 0, world: int = 1, group=None):
    """(parameters after one step from the initial weights, median seconds of `rounds` more steps)."""
    import torch

    import vcpo

    model, batch = build()
    batch = share(batch, rank, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    config = vcpo.VCPOConfig(**options)
    vcpo.step(model, optimizer, batch, config, process_group=group)
    first = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        vcpo.step(model, optimizer, batch, config, process_group=group)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def rank_main(rank: int, world: int, init: str, options: dict, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    first, median = steps(options, rounds, rank, world, dist.group.WORLD)
    if rank == 0:
        torch.save({"first": first, "median": median}, out)
    dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, options in CONFIGS.items():
        os.sched_setaffinity(0, [0])
        torch.set_num_threads(1)
        first, one = steps(options, args.rounds)
        os.sched_setaffinity(0, range(os.cpu_count()))
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.pt")
            mp.spawn(rank_main, args=(2, f"file://{tmp}/init", options, args.rounds, out), nprocs=2)
            two = torch.load(out)
        diff = (two["first"] - first).abs().max().item()
        rows.append((name, one, two["median"], diff))
    print(f"| step (B={B} x T={T}, {args.rounds} rounds, medians) | 1 rank, 1 core | 2 ranks, 1 core each | "
          "speed-up | max abs param difference after one step |")
    print("|---|---|---|---|---|")
    for name, one, two, diff in rows:
        print(f"| {name} | {one:.3f} s | {two:.3f} s | {one / two:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
