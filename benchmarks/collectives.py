"""All-reduce bandwidth between the ranks of one host: the link tensor parallelism's all-reduces ride on.

    python benchmarks/collectives.py [--ranks 2] [--sizes-mb 0.25 4 32 128] [--out benchmarks/results/collectives.json]
    python benchmarks/collectives.py --device cpu --ranks 2 --sizes-mb 0.01 0.1   # CPU smoke run (gloo)

Spawns ``--ranks`` processes (one GPU each on CUDA, NCCL; gloo on the CPU), all-reduces a bf16
(CUDA) / fp32 (CPU) tensor of each size ``--iters`` times after a warm-up, and reports per size the
median time of one all-reduce on rank 0, the algorithm bandwidth (bytes / time) and the bus bandwidth
(``algbw * 2 (n - 1) / n``, NCCL's convention: what each link carries, comparable across rank
counts). The sizes that matter here: a decode step's all-reduce is ``batch x hidden`` (256 KB at
batch 64 of a 2048-wide model), a prefill chunk's ``chunk x hidden`` (32 MB for 8,192 tokens): each
layer all-reduces twice per step. On CUDA the JSON also keeps ``nvidia-smi topo -m`` (how the GPUs
are linked: NVLink, PCIe, or neither) and the NCCL version. Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import datetime
import pathlib
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time_all_reduce(t: torch.Tensor, iters: int, cuda: bool) -> float:
    """Median seconds of one all-reduce of ``t`` (each timed alone, the ranks meeting in a barrier
    first so that no rank's late arrival is counted as transfer time)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(t)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, ranks: int, port: int, device: str, sizes: list[int], iters: int, out: str) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    # the rendezvous store is the launching process's (bound to a port the system picked, as
    # distributed/runtime.py launches ranks): every rank is its client
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=ranks)
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        rows = []
        for size in sizes:
            t = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=f"cuda:{rank}" if cuda else "cpu")
            for _ in range(3):  # warm-up: NCCL sets up its channels on first use
                dist.all_reduce(t)
            seconds = _time_all_reduce(t, iters, cuda)
            nbytes = t.numel() * t.element_size()
            algbw = nbytes / seconds / 1e9
            rows.append(dict(bytes=nbytes, ms=seconds * 1e3, algbw_gb_s=algbw,
                             busbw_gb_s=algbw * 2 * (ranks - 1) / ranks))
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _topology() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--ranks", type=int, default=None, help="default: every visible GPU (2 on the CPU)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 4, 32, 128])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/collectives.json")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device (or pass --device cpu)")
    ranks = args.ranks or (torch.cuda.device_count() if cuda else 2)
    if ranks < 2 or (cuda and ranks > torch.cuda.device_count()):
        p.error(f"--ranks must be at least 2{f' and at most the {torch.cuda.device_count()} GPUs' if cuda else ''}, "
                f"got {ranks}")
    if min(args.sizes_mb) <= 0 or args.iters < 1:
        p.error(f"--sizes-mb must be positive and --iters at least 1, got {args.sizes_mb} and {args.iters}")
    sizes = [int(mb * 2**20) for mb in args.sizes_mb]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_file = str(out) + ".rows"
    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    mp.spawn(_worker, args=(ranks, store.port, args.device, sizes, args.iters, rows_file), nprocs=ranks)
    rows = json.loads(pathlib.Path(rows_file).read_text())
    os.remove(rows_file)
    env = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "ranks": ranks, "torch": torch.__version__,
           "backend": "nccl" if cuda else "gloo", "date": time.strftime("%Y-%m-%d"), "iters": args.iters}
    if cuda:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["topology"] = _topology()
    print(f"all-reduce over {ranks} ranks ({env['backend']}, {env['device']}):")
    print(f"{'size':>10s} {'ms':>9s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
    for r in rows:
        print(f"{r['bytes'] / 2**20:8.2f}MB {r['ms']:9.3f} {r['algbw_gb_s']:11.2f} {r['busbw_gb_s']:11.2f}")
    if env.get("topology"):
        print(env["topology"])
    out.write_text(json.dumps({"env": env, "all_reduce": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
