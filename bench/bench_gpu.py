"""Forward+backward of vcpo_kernels.policy_loss on one GPU: eager PyTorch (the reference), torch.compile of it,
the Triton kernels and the CUDA kernels, at 1M, 16M and 64M tokens (B = 512, 8192, 32768 sequences of 2048
tokens, packed) and one batch of 64 sequences of 128k tokens; fp32, default options (sequence-level truncated
IS, OPOB, no proximal policy). Times are medians of CUDA-event timings after warm-up; GB/s counts the bytes
the op must move (one read of logp and behavior_logp, one write of the gradient: 12 bytes a token), next to
a device-to-device copy measured in the same run. Run by bench/gpu_check.sh.

    python3 bench/bench_gpu.py [--sizes 1M,16M,64M,long] [--reps 10]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vcpo_kernels as vk  # noqa: E402

SIZES = {"1M": (512, 2048), "16M": (8192, 2048), "64M": (32768, 2048), "long": (64, 131072)}
BYTES_PER_TOKEN = 12


def make(b: int, t: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    n = b * t
    logp = torch.randn(n, generator=g, device=device) * 0.3 - 1
    behavior = logp + 0.05 * torch.randn(n, generator=g, device=device)
    cu = torch.arange(b + 1, device=device, dtype=torch.int64) * t
    return dict(logp=logp, behavior_logp=behavior, cu_seqlens=cu, rewards=(torch.arange(b, device=device) % 2).float(),
                group_index=torch.arange(b, device=device) // 8, num_groups=max(b // 8, 1))


def timed(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() over reps CUDA-event timings."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, reps: int):
    """(ms, GB/s counting bytes read and written) of a device-to-device copy of num_bytes."""
    src = torch.empty(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps)
    return ms, 2 * num_bytes / ms / 1e6


def loss_step(loss_fn, inputs):
    kw = dict(inputs)
    logp = kw.pop("logp")

    def step():
        leaf = logp.detach().requires_grad_()
        loss_fn(leaf, **kw).backward()
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,16M,64M,long")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    backends = [b for b in vk.available_backends("cuda") if b != "torch"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; backends: torch, compile, {', '.join(backends)}")

    def by(backend):
        return lambda logp, **kw: vk.policy_loss(logp, validate=False, backend=backend, **kw).loss

    eager = by("torch")
    compiled = torch.compile(eager, dynamic=True)
    cases = {"eager": eager, "compile": compiled, **{b: by(b) for b in backends}}
    header = f"{'tokens':>8} {'case':>8} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'eager/x':>8} {'compile/x':>10}"
    print(header)
    for size in args.sizes.split(","):
        b, t = SIZES[size]
        inputs = make(b, t)
        n = b * t
        copy_ms, copy_gbs = copy_bandwidth(n * BYTES_PER_TOKEN, args.reps)
        results = {}
        for name, fn in cases.items():
            try:
                results[name] = timed(loss_step(fn, inputs), args.reps if name != "eager" else max(3, args.reps // 3))
            except Exception as exc:  # keep the table going; the tests say what is wrong
                print(f"{size:>8} {name:>8} failed: {type(exc).__name__}: {str(exc)[:200]}")
        print(f"{size:>8} {'copy':>8} {copy_ms:9.3f} {copy_gbs:8.0f}")
        for name, ms in results.items():
            gbs = n * BYTES_PER_TOKEN / ms / 1e6
            print(f"{size:>8} {name:>8} {ms:9.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.0f}% "
                  f"{results.get('eager', float('nan')) / ms:8.1f} {results.get('compile', float('nan')) / ms:10.2f}",
                  flush=True)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
