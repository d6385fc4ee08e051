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
are linked: NVLink, PCIe, or neither) and the NCCL version.

On CUDA each size is also timed the way a decode step runs it: ``--graph-reps`` all-reduces back to
back inside one CUDA graph, replayed (``nccl_graph_us``: per all-reduce), and, up to
``--one-shot-max-mb``, the same for the one-shot op (``hybrid_compile/distributed/one_shot.py``:
torch's symmetric-memory kernel, what ``EngineConfig.tensor_parallel_all_reduce`` "auto" / "one_shot"
uses up to its 64 KiB buffer; here a buffer of that size): ``one_shot_ms`` alone,
``one_shot_graph_us`` in a graph. Prints a table; writes JSON.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository's, installed or not

from hybrid_compile.distributed import one_shot  # noqa: E402


def _time_all_reduce(reduce, iters: int, cuda: bool) -> float:
    """Median seconds of one call of ``reduce`` (an all-reduce; each timed alone, the ranks meeting
    in a barrier first so that no rank's late arrival is counted as transfer time)."""
    times = []
    for _ in range(iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            reduce()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            reduce()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_in_graph(reduce, reps: int, iters: int) -> float:
    """Microseconds per all-reduce of ``reps`` calls of ``reduce`` captured back to back in one CUDA
    graph (as a decode step's graph holds them), median over ``iters`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream
        reduce()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            reduce()
    graph.replay()
    return _time_all_reduce(graph.replay, iters, True) * 1e6 / reps


def _worker(rank: int, ranks: int, port: int, device: str, sizes: list[int], iters: int, graph_reps: int,
            one_shot_bytes: int, out: str) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    # the rendezvous store is the launching process's (bound to a port the system picked, as
    # distributed/runtime.py launches ranks): every rank is its client
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=ranks)
    group_name = dist.group.WORLD.group_name
    done = False
    try:
        dtype = torch.bfloat16 if cuda else torch.float32
        device_ = torch.device(f"cuda:{rank}" if cuda else "cpu")
        reason = one_shot.unsupported_reason(device_, ranks, dtype)
        if reason is None:
            one_shot.enable(group_name, device_, one_shot_bytes)
        rows = []
        for size in sizes:
            t = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=device_)
            for _ in range(3):  # warm-up: NCCL sets up its channels on first use
                dist.all_reduce(t)
            seconds = _time_all_reduce(lambda: dist.all_reduce(t), iters, cuda)
            nbytes = t.numel() * t.element_size()
            algbw = nbytes / seconds / 1e9
            row = dict(bytes=nbytes, ms=seconds * 1e3, algbw_gb_s=algbw, busbw_gb_s=algbw * 2 * (ranks - 1) / ranks)
            if cuda:
                row["nccl_graph_us"] = _time_in_graph(lambda: dist.all_reduce(t), graph_reps, iters)
                if one_shot.takes_one_shot(t, one_shot.buffer(group_name)):
                    op = torch.ops.hybrid_compile.tp_all_reduce
                    if not torch.equal(op(t, group_name), t * ranks):  # (every rank holds ones)
                        raise RuntimeError(f"one-shot all-reduce of {nbytes} bytes: wrong sum")
                    row["one_shot_ms"] = _time_all_reduce(lambda: op(t, group_name), iters, True) * 1e3
                    row["one_shot_graph_us"] = _time_in_graph(lambda: op(t, group_name), graph_reps, iters)
            rows.append(row)
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps(dict(rows=rows, one_shot_unavailable=reason)))
        dist.barrier()  # every rank done before any tears its connections down
        done = True
    finally:
        one_shot.disable(group_name)
        dist.destroy_process_group()
    if done:
        # skip the interpreter's teardown: gloo's threads can abort it ("terminate called without an
        # active exception", SIGABRT; README, Tensor parallelism, known issue) after a complete run
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _topology() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--ranks", type=int, default=None, help="default: every visible GPU (2 on the CPU)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1 / 256, 1 / 16, 0.25, 1, 4, 32, 128],
                   help="4 KB: batch 1 of a 2048-wide bf16 model; 256 KB: batch 64; 32 MB: an 8k-token chunk")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph-reps", type=int, default=50, help="all-reduces per CUDA graph (CUDA only)")
    p.add_argument("--one-shot-max-mb", type=float, default=1.0, help="the one-shot op's buffer (CUDA only)")
    p.add_argument("--out", default="benchmarks/results/collectives.json")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device (or pass --device cpu)")
    ranks = args.ranks or (torch.cuda.device_count() if cuda else 2)
    if ranks < 2 or (cuda and ranks > torch.cuda.device_count()):
        p.error(f"--ranks must be at least 2{f' and at most the {torch.cuda.device_count()} GPUs' if cuda else ''}, "
                f"got {ranks}")
    if min(args.sizes_mb) <= 0 or args.iters < 1 or args.graph_reps < 1 or args.one_shot_max_mb * 2**20 < 16:
        p.error(f"--sizes-mb must be positive, --iters and --graph-reps at least 1 and --one-shot-max-mb at least "
                f"16 bytes, got {args.sizes_mb}, {args.iters}, {args.graph_reps} and {args.one_shot_max_mb}")
    sizes = [int(mb * 2**20) for mb in args.sizes_mb]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_file = str(out) + ".rows"
    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, timeout=datetime.timedelta(seconds=120),
                          wait_for_workers=False)
    one_shot_bytes = int(args.one_shot_max_mb * 2**20) // 16 * 16
    mp.spawn(_worker, args=(ranks, store.port, args.device, sizes, args.iters, args.graph_reps, one_shot_bytes,
                            rows_file), nprocs=ranks)
    measured = json.loads(pathlib.Path(rows_file).read_text())
    rows = measured["rows"]
    os.remove(rows_file)
    env = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "ranks": ranks, "torch": torch.__version__,
           "backend": "nccl" if cuda else "gloo", "date": time.strftime("%Y-%m-%d"), "iters": args.iters,
           "graph_reps": args.graph_reps, "one_shot_max_bytes": one_shot_bytes,
           "one_shot_unavailable": measured["one_shot_unavailable"]}
    if cuda:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["topology"] = _topology()
    print(f"all-reduce over {ranks} ranks ({env['backend']}, {env['device']}):")
    print(f"{'size':>10s} {'ms':>9s} {'algbw GB/s':>11s} {'busbw GB/s':>11s} {'graph us':>9s} {'1-shot ms':>10s} "
          f"{'1-shot graph us':>16s}")

    def cell(r, key, width, fmt):
        return f"{r[key]:{width}{fmt}}" if key in r else f"{'-':>{width}s}"

    for r in rows:
        print(f"{r['bytes'] / 2**20:8.4f}MB {r['ms']:9.3f} {r['algbw_gb_s']:11.2f} {r['busbw_gb_s']:11.2f} "
              f"{cell(r, 'nccl_graph_us', 9, '.1f')} {cell(r, 'one_shot_ms', 10, '.3f')} "
              f"{cell(r, 'one_shot_graph_us', 16, '.1f')}")
    if env["one_shot_unavailable"]:
        print(f"one-shot all-reduce not measured: {env['one_shot_unavailable']}")
    if env.get("topology"):
        print(env["topology"])
    out.write_text(json.dumps({"env": env, "all_reduce": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
