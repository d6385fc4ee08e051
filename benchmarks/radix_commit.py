"""Host cost of caching one long prompt in the prefix cache vs the KV pool's size (CPU, no model).

    python benchmarks/radix_commit.py                                  # 4k tokens; 33k / 1M / 4.2M KV slots
    python benchmarks/radix_commit.py --tokens 4096 --slots 4202496 --threads 1,2,16 --repeats 20

Every prefill chunk of a request hands its KV slots to the prefix cache (``cache_unfinished_req``;
a finished request ``cache_finished_req``), which checks them against and marks them in its host
ownership mask, one flag per KV slot of the pool: ~4.2 million on an H200 engine sized by
``memory_fraction``. This times that commit, ``HybridRadixCache.insert`` of a fresh ``--tokens``-token
sequence (new slots, a state at its end; the tree emptied before each), on pools of ``--slots`` KV
slots (one tiny attention layer: the mask's length is what matters), at each of ``--threads`` torch
CPU threads (a GPU host's engine runs with all its cores' threads, beside other busy processes).
Wall microseconds (the ops may use several threads), median and mean of ``--repeats`` commits.
Output: a printed table and JSON (``--out``, default ``benchmarks/results/radix_commit_cpu.json``).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybrid_compile.cache import HybridRadixCache  # noqa: E402
from hybrid_compile.memory import MemoryPools  # noqa: E402
from radix_eviction import ATTN, LINEAR, write_result  # noqa: E402  (the same tiny pools)

VOCAB = 1000


def measure(tokens: int, slots: int, threads: int, repeats: int, seed: int) -> dict:
    pools = MemoryPools.from_specs(ATTN, LINEAR, max_running_requests=1, max_context_len=tokens + 8, page_size=1,
                                   max_total_tokens=slots, mamba_cache_size=8)
    cache = HybridRadixCache(pools, mamba_align=1)
    rng = random.Random(seed)
    torch.set_num_threads(threads)
    times = []
    gc.collect()
    gc.disable()  # (a collection would land in whichever commit triggers it)
    try:
        for _ in range(repeats + 1):  # the first: warm-up, not kept
            cache.reset()
            seq = [rng.randrange(VOCAB) for _ in range(tokens)]
            kv = pools.kv.allocator.alloc(tokens)
            state = pools.mamba.alloc(1)
            t0 = time.perf_counter()
            cached = cache.insert(seq, kv, int(state[0]))
            times.append((time.perf_counter() - t0) * 1e6)
            if cached != 0 or cache.stats()["cached_tokens"] != tokens:
                raise AssertionError(f"insert of a fresh {tokens}-token sequence cached {cache.stats()['cached_tokens']}")
    finally:
        gc.enable()
    cache.check_invariants()
    times = times[1:]
    return {"tokens": tokens, "kv_slots": pools.kv.allocator.num_slots, "threads": threads,
            "median_us": statistics.median(times), "mean_us": statistics.fmean(times), "repeats": repeats}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--slots", default="33600,1048576,4202496", help="KV pool sizes (token slots), comma-separated")
    ap.add_argument("--threads", default="1,2,16", help="torch CPU threads, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    result = {"env": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                      "cpus": os.cpu_count(), "clock": "time.perf_counter", "date": time.strftime("%Y-%m-%d")},
              "results": []}
    print(f"{'tokens':>7} {'KV slots':>9} {'threads':>8} {'median us':>10} {'mean us':>9}")
    for slots in (int(s) for s in args.slots.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            r = measure(args.tokens, slots, threads, args.repeats, args.seed)
            result["results"].append(r)
            print(f"{r['tokens']:>7} {r['kv_slots']:>9} {r['threads']:>8} {r['median_us']:>10.1f} {r['mean_us']:>9.1f}",
                  flush=True)
    write_result(result, args.out, "radix_commit_cpu.json")
    return result


if __name__ == "__main__":
    main()
