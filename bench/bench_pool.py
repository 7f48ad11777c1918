"""The vLLM server pool of `vcpo train --engine server` (docs/scale.md): generation throughput with 1 and 2 local
servers, and the time of a weight sync (writing the file once, then pause + reload + relabel + resume on every
server in parallel) as a function of the number of servers and of the model size.

Servers are real `vcpo serve` processes on 127.0.0.1 (LocalServers), started and stopped here.

    python bench/bench_pool.py throughput        # the tiny model, 2 servers on a core each: samples/s of
                                                 # trainer-sized batches on one of them, and on both
    python bench/bench_pool.py sync              # the tiny model: sync latency per server and for the pool
    python bench/bench_pool.py size --params 10M 100M 1B   # sync time against model size (one server)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

SIZES = {  # hidden, layers, intermediate, heads: a Llama of about this many parameters (vocab 21)
    "10M": (512, 3, 1792, 8),
    "100M": (1024, 8, 3584, 16),
    "1B": (2048, 20, 7168, 16),
}


def tiny_model(folder: str) -> str:
    import torch

    from vcpo.trainer import tiny

    tok = tiny.build_tokenizer()
    torch.manual_seed(0)
    tiny.build_model(tiny.TinyRecipe(), len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def sized_model(folder: str, size: str) -> tuple[str, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vcpo.trainer import tiny

    hidden, layers, inter, heads = SIZES[size]
    tok = tiny.build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64,
                         bos_token_id=tiny.BOS, eos_token_id=tiny.EOS, pad_token_id=tiny.PAD, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


def start(model: str, cores: list[list[int]], log_dir: str):
    from vcpo.trainer.engines.pool import ServerPool
    from vcpo.trainer.engines.servers import LocalServers

    servers = LocalServers(model, len(cores), log_dir=log_dir, dtype="float32", max_model_len=64, kv_cache_gib=1,
                           seed=0, cores=cores, log=lambda s: print(s, file=sys.stderr))
    t0 = time.perf_counter()
    urls = servers.start()
    started = time.perf_counter() - t0
    pool = ServerPool(urls, weights_dir=os.path.join(log_dir, "weights"), log=lambda s: print(s, file=sys.stderr))
    return servers, pool, started


def state_of(model_dir: str):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def throughput(args) -> None:
    """Batches of the trainer's default shape (16 prompts x 8 responses, up to `max_tokens` new tokens) on
    server A alone, server B alone, and A + B (each server on a core of its own); the layouts alternate over
    `rounds` rounds so that a busy moment of the machine does not fall on one layout only."""
    from vcpo.trainer import tiny
    from vcpo.trainer.engines.pool import ServerPool
    from vcpo.trainer.data import addition_problems

    cores = sorted(os.sched_getaffinity(0))
    tok = tiny.build_tokenizer()
    prompts = [[tiny.BOS] + tok.encode(p.prompt) for p in addition_problems(16 * args.batches, 2, seed=1)]
    with tempfile.TemporaryDirectory() as root:
        model = tiny_model(os.path.join(root, "model"))
        servers, pool, started = start(model, [[c] for c in cores[:2]], os.path.join(root, "logs"))
        pools = {"1 server (A)": [servers.urls[0]], "1 server (B)": [servers.urls[1]], "2 servers": servers.urls}
        rates: dict[str, list[float]] = {name: [] for name in pools}
        try:
            pool.load_weights(state_of(model), 0)
            pool.generate(prompts[:32], n=8, max_tokens=args.max_tokens, temperature=1.0)  # warm-up
            pool.close()
            for _ in range(args.rounds):
                for name, urls in pools.items():
                    pool = ServerPool(urls, weights_dir=os.path.join(root, "weights"))
                    t0, samples = time.perf_counter(), 0
                    for b in range(args.batches):
                        out = pool.generate(prompts[16 * b:16 * (b + 1)], n=8, max_tokens=args.max_tokens,
                                            temperature=1.0, seeds=range(16 * b, 16 * (b + 1)))
                        samples += sum(len(group) for group in out)
                    rates[name].append(samples / (time.perf_counter() - t0))
                    pool.close()
        finally:
            pool.close()
            servers.stop()
        for name, values in rates.items():
            print(json.dumps({"layout": name, "samples_per_s_median": round(statistics.median(values), 1),
                              "samples_per_s_each": [round(v, 1) for v in values], "batches": args.batches,
                              "max_tokens": args.max_tokens, "servers_start_s": round(started, 1)}), flush=True)


def sync_latency(args) -> None:
    """Weight syncs of the tiny model to 1 and 2 servers, idle (no requests in flight)."""
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as root:
        model = tiny_model(os.path.join(root, "model"))
        state = state_of(model)
        for layout in ([cores[-1:]], [[c] for c in cores[:2]]):
            servers, pool, _ = start(model, layout, os.path.join(root, f"n{len(layout)}"))
            try:
                pool.load_weights(state, 0)
                totals = []
                for v in range(1, args.syncs + 1):
                    t0 = time.perf_counter()
                    pool.load_weights(state, v)
                    totals.append(time.perf_counter() - t0)
                per_server = [statistics.median(s.reload_seconds[1:]) for s in pool.servers]
                print(json.dumps({"servers": len(layout), "syncs": args.syncs,
                                  "pool_median_ms": round(1e3 * statistics.median(totals), 1),
                                  "pool_max_ms": round(1e3 * max(totals), 1),
                                  "write_mean_ms": round(1e3 * pool.stats.write_seconds / (args.syncs + 1), 1),
                                  "per_server_median_ms": [round(1e3 * t, 1) for t in per_server]}), flush=True)
            finally:
                pool.close()
                servers.stop()


def size(args) -> None:
    """One server on one core; a sync = write the safetensors file + pause/reload/relabel/resume."""
    cores = sorted(os.sched_getaffinity(0))
    for name in args.params:
        with tempfile.TemporaryDirectory(dir=args.tmp) as root:
            model, count = sized_model(os.path.join(root, "model"), name)
            state = state_of(model)
            servers, pool, started = start(model, [cores[-1:]], os.path.join(root, "logs"))
            try:
                pool.load_weights(state, 0)
                write0 = pool.stats.write_seconds
                totals = []
                for v in range(1, args.syncs + 1):
                    t0 = time.perf_counter()
                    pool.load_weights(state, v)
                    totals.append(time.perf_counter() - t0)
                write = (pool.stats.write_seconds - write0) / args.syncs
                reload = statistics.median(pool.servers[0].reload_seconds[1:])
                print(json.dumps({"model": name, "parameters": count, "file_mb": round(4 * count / 1e6),
                                  "server_start_s": round(started, 1),
                                  "sync_median_s": round(statistics.median(totals), 3),
                                  "write_mean_s": round(write, 3), "reload_median_s": round(reload, 3)}), flush=True)
            finally:
                pool.close()
                servers.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--batches", type=int, default=40)
    t.add_argument("--rounds", type=int, default=5)
    t.add_argument("--max-tokens", type=int, default=8)
    s = sub.add_parser("sync")
    s.add_argument("--syncs", type=int, default=20)
    z = sub.add_parser("size")
    z.add_argument("--params", nargs="+", default=["10M", "100M"], choices=list(SIZES))
    z.add_argument("--syncs", type=int, default=5)
    z.add_argument("--tmp", default=None, help="folder for the model files (default: the temporary directory)")
    args = parser.parse_args()
    {"throughput": throughput, "sync": sync_latency, "size": size}[args.what](args)


if __name__ == "__main__":
    main()
