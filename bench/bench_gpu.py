"""The GPU benchmark table, run by bench/gpu_check.sh. Two sections, each case fwd+bwd:

loss: vcpo_kernels.policy_loss in eager PyTorch (the reference), torch.compile of it, the Triton kernels and the
CUDA kernels, at 1M, 16M and 64M tokens (B = 512, 8192, 32768 sequences of 2048 tokens, packed) and one batch
of 64 sequences of 128k tokens; fp32, default options (sequence-level truncated IS, OPOB, no proximal policy).
GB/s counts the bytes the op must move (one read of logp and behavior_logp, one write of the gradient: 12
bytes a token), next to a device-to-device copy measured in the same run.

head: vcpo_kernels.linear_logprobs (N tokens, hidden H, vocabulary V, fp32) for each backend and each chunk
size (logits a chunk: the row passes' grid and the GEMMs' shape depend on it), against eager PyTorch that
materialises the N x V logits; TFLOP/s counts the three GEMMs (6 N H V) and the peak column is the device
memory above the inputs.

Times are medians after warm-up: CUDA events on a GPU, the host clock on the CPU (--device cpu: the dry run of
gpu_check.sh, small sizes, the Triton kernels under the interpreter). A case that fails prints its error and
the table goes on.

    python3 bench/bench_gpu.py [--sections loss,head] [--sizes 1M,16M,64M,long] [--chunks 4M,16M,64M] [--reps 10]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

# bench/gpu_check.sh runs this with the GPU machine's own python, where vcpo is not installed but built in place
# (setup.py build_ext --inplace): vcpo_kernels is imported from the repository root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vcpo_kernels as vk  # noqa: E402

LOSS_SIZES = {"64k": (16, 4096), "1M": (512, 2048), "16M": (8192, 2048), "64M": (32768, 2048), "long": (64, 131072)}
HEAD_SIZES = {"tiny": (256, 64, 4096), "qwen": (8192, 4096, 151936)}  # (N, H, V)
LOGITS = {"4k": 1 << 12, "64k": 1 << 16, "1M": 1 << 20, "4M": 1 << 22, "16M": 1 << 24, "64M": 1 << 26}
BYTES_PER_TOKEN = 12


def timed(fn, reps: int, device: torch.device, warmup: int = 3) -> float:
    """Median milliseconds of fn() over reps runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, reps: int, device: torch.device):
    """(ms, GB/s counting bytes read and written) of a copy of num_bytes on device."""
    src = torch.randn(num_bytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps, device)
    return ms, 2 * num_bytes / ms / 1e6


def loss_inputs(b: int, t: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    n = b * t
    logp = torch.randn(n, generator=g, device=device) * 0.3 - 1
    behavior = logp + 0.05 * torch.randn(n, generator=g, device=device)
    cu = torch.arange(b + 1, device=device, dtype=torch.int64) * t
    return dict(logp=logp, behavior_logp=behavior, cu_seqlens=cu, rewards=(torch.arange(b, device=device) % 2).float(),
                group_index=torch.arange(b, device=device) // 8, num_groups=max(b // 8, 1))


def loss_step(loss_fn, inputs):
    kw = dict(inputs)
    logp = kw.pop("logp")

    def step():
        leaf = logp.detach().requires_grad_()
        loss_fn(leaf, **kw).backward()
    return step


def loss_section(args, device: torch.device, backends: list) -> None:
    def by(backend):
        return lambda logp, **kw: vk.policy_loss(logp, validate=False, backend=backend, **kw).loss

    eager = by("torch")
    cases = {"eager": eager, "compile": torch.compile(eager, dynamic=True), **{b: by(b) for b in backends}}
    print(f"\n{'tokens':>8} {'case':>8} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'eager/x':>8} {'compile/x':>10}")
    for size in args.sizes.split(","):
        b, t = LOSS_SIZES[size]
        inputs = loss_inputs(b, t, device)
        n = b * t
        copy_ms, copy_gbs = copy_bandwidth(n * BYTES_PER_TOKEN, args.reps, device)
        results = {}
        for name, fn in cases.items():
            try:
                results[name] = timed(loss_step(fn, inputs), args.reps if name != "eager" else max(3, args.reps // 3),
                                      device)
            except Exception as exc:  # keep the table going; the tests say what is wrong
                print(f"{size:>8} {name:>8} failed: {type(exc).__name__}: {str(exc)[:200]}")
        print(f"{size:>8} {'copy':>8} {copy_ms:9.3f} {copy_gbs:8.0f}")
        for name, ms in results.items():
            gbs = n * BYTES_PER_TOKEN / ms / 1e6
            print(f"{size:>8} {name:>8} {ms:9.3f} {gbs:8.0f} {100 * gbs / copy_gbs:6.0f}% "
                  f"{results.get('eager', float('nan')) / ms:8.1f} {results.get('compile', float('nan')) / ms:10.2f}",
                  flush=True)
        del inputs
        empty_cache(device)


def head_section(args, device: torch.device, backends: list) -> None:
    n, h, v = HEAD_SIZES[args.head_size]
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, generator=g, device=device).requires_grad_()
    weight = (torch.randn(v, h, generator=g, device=device) / h ** 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    upstream = torch.randn(n, generator=g, device=device)

    def eager():
        logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None])[:, 0]
        (logp * upstream).sum().backward()

    def fused(backend, chunk):
        def step():
            out = vk.linear_logprobs(hidden, weight, targets, chunk_size=chunk, backend=backend)
            (out.logp * upstream).sum().backward()
        return step

    cases = {"eager": eager}
    for chunk_name in args.chunks.split(","):
        rows = max(1, LOGITS[chunk_name] // v)
        for backend in ["torch", *backends]:
            cases[f"{backend} {chunk_name}"] = fused(backend, rows)
    flop = 6 * n * h * v
    print(f"\nhead: N={n} H={h} V={v} fp32")
    print(f"{'case':>14} {'rows':>6} {'ms':>9} {'TFLOP/s':>8} {'peak MiB':>9} {'eager/x':>8}")
    results = {}
    for name, step in cases.items():
        try:
            hidden.grad = weight.grad = None
            base = reset_peak(device)
            ms = timed(step, args.reps, device, warmup=1)
            peak = (peak_bytes(device) - base) / 2 ** 20
        except Exception as exc:
            print(f"{name:>14} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        results[name] = ms
        rows = "" if name == "eager" else str(max(1, LOGITS[name.split()[-1]] // v))
        peak_text = f"{peak:9.0f}" if device.type == "cuda" else f"{'-':>9}"
        print(f"{name:>14} {rows:>6} {ms:9.3f} {flop / ms / 1e9:8.1f} {peak_text} "
              f"{results.get('eager', float('nan')) / ms:8.2f}", flush=True)


def reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_bytes(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run")
    p.add_argument("--sections", default="loss,head")
    p.add_argument("--sizes", default="1M,16M,64M,long", help=f"loss sizes: {','.join(LOSS_SIZES)}")
    p.add_argument("--head-size", default="qwen", choices=list(HEAD_SIZES))
    p.add_argument("--chunks", default="4M,16M,64M", help=f"logits a chunk for head: {','.join(LOGITS)}")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    device = torch.device(args.device)
    backends = [b for b in vk.available_backends(device) if b != "torch"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; backends: torch, {', '.join(backends)}", flush=True)
    sections = {"loss": loss_section, "head": head_section}
    for section in args.sections.split(","):
        sections[section](args, device, backends)


if __name__ == "__main__":
    main()
