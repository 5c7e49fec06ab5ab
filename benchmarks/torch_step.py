#!/usr/bin/env python3
"""torch_step.py: PyTorch's data-parallel and ZeRO-1 optimizer step on CPU over gloo.

The baseline of benchmarks/run_torch_compare.sh: what bench_step measures for shardopt's
data-parallel and zero-1 stages, done the way PyTorch users do it. It starts --ranks
processes (torch.multiprocessing, spawn) that join a gloo process group on 127.0.0.1, one
intra-op thread per rank (torch.set_num_threads(1), as OMP_NUM_THREADS=1 for bench_step).

Model: --psi fp32 parameters as nn.Parameters of --tensor-elems elements each in an
nn.ParameterList (the last holds the remainder). Loss: sum over parameters of (p * c).sum()
with one fixed tensor c, so that every gradient is c (a backward of the least work).

Modes (--modes, default ddp,zero):
  ddp   DistributedDataParallel(bucket_cap_mb=4, i.e. buckets of 1 Mi fp32 elements as
        shardopt's, gradient_as_bucket_view=True) + torch.optim.AdamW on every parameter.
  zero  The same DDP for the gradient all-reduce + torch.distributed.optim.
        ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW): every rank updates its
        shard of the parameters and broadcasts it (ZeRO-1 as PyTorch users run it).
AdamW: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01, foreach as PyTorch's default
(None; torch 1.13 turns None into False, the per-tensor loop) unless --foreach.

What is timed, per step, after a dist.barrier() (as bench_step's MPI_Barrier):
  with DDP     model.zero_grad(set_to_none=False) + loss.backward() (with DDP's all-reduce
               hooks) + optimizer.step()
  without DDP  loss.backward() alone, on the same model before DDP wraps it (gradients
               already allocated and zeroed, untimed, as under DDP)
  step         the difference: clearing the gradients, the all-reduce and its hooks, the
               update and (zero) the broadcast of the parameters. bench_step's step has the
               same parts (reduction, norm, update, all-gather, clearing) and no backward.
The forward pass is not timed. --warmup steps (default 2: DDP rebuilds its buckets in its
second iteration) are left out; of the --steps timed steps each rank takes the median of
each time, and the table shows the maximum over ranks (all_reduce MAX), step = max(with DDP)
- max(without DDP).

    python3 benchmarks/torch_step.py [--ranks 2] [--psi 64M] [--tensor-elems 1M] [--steps 5]
        [--warmup 2] [--modes ddp,zero] [--foreach] [--verbose]

Sizes take K M G (powers of 1000, as bench_step) or Ki Mi Gi (powers of 1024).
"""
import argparse
import os
import socket
import statistics
import sys
import time

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
SCALE = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def size(s):
    s = s.strip()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, suffix = s[:i], s[i:]
    if suffix not in SCALE:
        raise argparse.ArgumentTypeError("%r: unknown suffix %r (K M G or Ki Mi Gi)" % (s, suffix))
    try:
        v = float(num) * SCALE[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError("%r is not a size (e.g. 64M, 1000000, 1Mi)" % s)
    if v < 1 or v != int(v):
        raise argparse.ArgumentTypeError("%r: expected a whole number >= 1" % s)
    return int(v)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--psi", type=size, default=64 * 10**6, help="parameters (default 64M)")
    p.add_argument("--tensor-elems", type=size, default=10**6,
                   help="elements per parameter tensor (default 1M)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--modes", default="ddp,zero", help="ddp, zero or both (default ddp,zero)")
    p.add_argument("--foreach", action="store_true",
                   help="AdamW(foreach=True) instead of PyTorch's default")
    p.add_argument("--verbose", action="store_true",
                   help="every rank prints its timed steps to stderr")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or any(m not in ("ddp", "zero") for m in a.modes):
        p.error("--modes: ddp, zero or ddp,zero")
    if a.ranks < 1:
        p.error("--ranks must be at least 1")
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return a


def make_model(torch, psi, tensor_elems):
    class Params(torch.nn.Module):
        def __init__(self):
            super().__init__()
            sizes = [tensor_elems] * (psi // tensor_elems)
            if psi % tensor_elems:
                sizes.append(psi % tensor_elems)
            g = torch.Generator().manual_seed(1234)
            self.params = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.empty(n).uniform_(-0.1, 0.1, generator=g)) for n in sizes])
            # Each gradient is c[:numel]: the backward of (p * c).sum().
            self.register_buffer("c", torch.linspace(-1.0, 1.0, max(sizes)), persistent=False)

        def forward(self):
            loss = None
            for p in self.params:
                term = (p * self.c[:p.numel()]).sum()
                loss = term if loss is None else loss + term
            return loss

    return Params()


def make_optimizer(torch, mode, params, foreach):
    kw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    if foreach:
        kw["foreach"] = True
    if mode == "ddp":
        return torch.optim.AdamW(params, **kw)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **kw)


def max_over_ranks(torch, dist, x):
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_mode(torch, dist, a, mode):
    torch.manual_seed(0)
    model = make_model(torch, a.psi, a.tensor_elems)
    # Without DDP: backward alone, into allocated, zeroed gradients.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    bwd = []
    for s in range(a.warmup + a.steps):
        model.zero_grad(set_to_none=False)
        loss = model()
        dist.barrier()
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        if s >= a.warmup:
            bwd.append(t1 - t0)
        del loss
    model.zero_grad(set_to_none=True)

    # With DDP (and the optimizer): clearing + backward with the all-reduce + step.
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, bucket_cap_mb=4, gradient_as_bucket_view=True)
    opt = make_optimizer(torch, mode, ddp.parameters(), a.foreach)
    full = []
    for s in range(a.warmup + a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        ddp.zero_grad(set_to_none=False)
        t1 = time.perf_counter()
        loss = ddp()
        dist.barrier()
        t2 = time.perf_counter()
        loss.backward()
        opt.step()
        t3 = time.perf_counter()
        if s >= a.warmup:
            full.append((t1 - t0) + (t3 - t2))
        del loss
    if a.verbose:
        print("rank %d %s: backward without DDP %s; with DDP %s" % (
            dist.get_rank(), mode, " ".join("%.4f" % t for t in bwd),
            " ".join("%.4f" % t for t in full)), file=sys.stderr, flush=True)
    t_bwd = max_over_ranks(torch, dist, statistics.median(bwd))
    t_full = max_over_ranks(torch, dist, statistics.median(full))
    del opt, ddp, model
    return t_bwd, t_full


def rank_main(rank, a, init_method):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=a.ranks)
    try:
        rows = []
        for mode in a.modes:
            t_bwd, t_full = run_mode(torch, dist, a, mode)
            rows.append((mode, t_bwd, t_full))
        if rank == 0:
            names = {"ddp": "DDP + AdamW", "zero": "DDP + ZeroRedundancyOptimizer(AdamW)"}
            foreach = "foreach=True" if a.foreach else "foreach default (None -> False in 1.13)"
            print("torch %s, gloo, %d ranks, torch.set_num_threads(1); psi %d, tensors of %d; "
                  "AdamW lr %g wd %g, %s; median of %d steps after %d, max over ranks"
                  % (torch.__version__, a.ranks, a.psi, a.tensor_elems, LR, WEIGHT_DECAY,
                     foreach, a.steps, a.warmup))
            print()
            print("| mode | optimizer | ranks | psi | backward+step with DDP s "
                  "| backward without DDP s | step s |")
            print("|---|---|---|---|---|---|---|")
            for mode, t_bwd, t_full in rows:
                print("| %s | %s | %d | %d | %.4f | %.4f | %.4f |"
                      % (mode, names[mode], a.ranks, a.psi, t_full, t_bwd, t_full - t_bwd))
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv):
    a = parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp
    except ImportError as e:
        print("torch_step: %s (Debian: apt-get install python3-torch, then /usr/bin/python3)"
              % e, file=sys.stderr)
        return 2
    if not dist.is_available() or not dist.is_gloo_available():
        print("torch_step: this torch has no gloo backend", file=sys.stderr)
        return 2
    init_method = "tcp://127.0.0.1:%d" % free_port()
    mp.spawn(rank_main, args=(a, init_method), nprocs=a.ranks, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
