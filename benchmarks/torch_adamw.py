#!/usr/bin/env python3
"""torch_adamw.py: PyTorch's AdamW on one GPU, the baseline of bench_cuda_adam.

Times torch.optim.AdamW(fused=True) and AdamW(foreach=True) stepping one fp32 parameter of
2^k elements (lr 1e-3, weight decay 0.01, as bench_cuda_adam), with CUDA events over
--reps steps after two warm-up steps, and prints CSV rows:

    impl,elements,ms,gb_per_s

gb_per_s counts what the update must move: it reads the parameter, gradient, m and v and
writes the parameter, m and v (28 bytes per element; bench_cuda_adam's kernel also writes a
bf16 copy, 30 bytes). --dry-run checks the arguments and prints the rows with "dry run" in
place of the figures, without a GPU (scripts/gpu_check.sh --dry-run).

    python3 benchmarks/torch_adamw.py [--sizes 24,26,28] [--reps 20] [--dry-run]
"""
import argparse
import sys

BYTES_PER_ELEM = 28


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="24,26,28",
                   help="log2 of the element counts, comma separated (default 24,26,28)")
    p.add_argument("--reps", type=int, default=20, help="timed steps per size and optimizer")
    p.add_argument("--dry-run", action="store_true", help="no GPU: rows without figures")
    a = p.parse_args(argv)
    try:
        a.sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        p.error("--sizes: expected integers separated by commas, got %r" % a.sizes)
    if any(s < 0 or s > 34 for s in a.sizes):
        p.error("--sizes: each must be in 0..34")
    if a.reps < 1:
        p.error("--reps must be at least 1")
    return a


def time_step_ms(torch, n, reps, **kind):
    p = torch.nn.Parameter(torch.zeros(n, device="cuda", dtype=torch.float32))
    # Values in [-1, 1), as bench_cuda_adam's gradient.
    p.grad = torch.arange(n, device="cuda", dtype=torch.float32).remainder_(2001).div_(1000).sub_(1)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kind)
    for _ in range(2):  # the first step allocates m and v
        opt.step()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        opt.step()
    stop.record()
    stop.synchronize()
    ms = start.elapsed_time(stop) / reps
    del opt, p
    torch.cuda.empty_cache()
    return ms


def main(argv):
    a = parse_args(argv)
    print("impl,elements,ms,gb_per_s")
    if a.dry_run:
        for k in a.sizes:
            for impl in ("fused", "foreach"):
                print("%s,%d,dry run,dry run" % (impl, 1 << k))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("torch_adamw: no CUDA device", file=sys.stderr)
        return 1
    for k in a.sizes:
        n = 1 << k
        for impl, kind in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
            ms = time_step_ms(torch, n, a.reps, **kind)
            print("%s,%d,%.6f,%.3f" % (impl, n, ms, BYTES_PER_ELEM * n / ms / 1e6), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
