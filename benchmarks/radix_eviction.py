"""Eviction cost of the prefix cache's radix tree vs its size (CPU, no model).

    python benchmarks/radix_eviction.py                              # 1k / 10k / 100k nodes, both policies
    python benchmarks/radix_eviction.py --sizes 200,1000 --evictions 50   # a quick run

For each policy (``lru``, ``marconi``) and tree size n, a :class:`HybridRadixCache` on tiny pools
(one attention layer and one linear layer of a few floats) is filled with random sequences that
branch off earlier ones (every insert caches a state: about one leaf and one split per insert)
until it holds n nodes, then random lookups shuffle the recency. Then, with ``--evictions`` E
(at most n / 10, so the tree keeps its size):

- ``kv_per_call_us`` / ``mamba_per_call_us``: E calls of ``evict_kv(1)`` / ``evict_mamba(1)``, one
  victim each (median and mean microseconds per call): the scheduler's pattern (``ensure_free``
  before each allocation);
- ``kv_bulk_us_per_node`` / ``mamba_bulk_us_per_node``: one call evicting about E nodes / E states,
  microseconds per evicted node;
- ``full_rank_ms``: one ranking of every candidate by the policy's key (``kv_eviction_order`` +
  ``mamba_eviction_order``), the work an eviction call did on every call before the incremental
  eviction indexes (``cache/policy.py``).

Times are CPU seconds of the benchmark's thread (``time.thread_time``; tree building: wall). A
per-call time that stays flat from 1k to 100k nodes while ``full_rank_ms`` grows with n is the
point. LRU is O(log n) per evicted node; Marconi visits efficiency groups only while one could beat
the best node found (its normalisers change with every call; ``cache/policy.py``). The garbage
collector is off while timing (it is run before). Output: a printed table and JSON (``--out``,
default ``benchmarks/results/radix_eviction_cpu.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid_compile.cache import HybridRadixCache  # noqa: E402
from hybrid_compile.memory import AttentionLayerSpec, MambaLayerSpec, MemoryPools  # noqa: E402

ATTN = [AttentionLayerSpec((1,), num_kv_heads=1, head_dim=2, dtype=torch.float32)]
LINEAR = [MambaLayerSpec((0,), conv_width=2, conv_dim=2, state_shape=(1,), conv_dtype=torch.float32)]
VOCAB = 64
CLOCK = time.thread_time  # CPU time of this thread: the numbers hold on a machine shared with other work
MAX_LEN = 40


def build_tree(policy: str, nodes: int, seed: int) -> tuple[HybridRadixCache, list[list[int]], float]:
    """A cache holding ``nodes`` nodes (random branching sequences, a state at each end)."""
    pools = MemoryPools.from_specs(
        ATTN, LINEAR, max_running_requests=1, max_context_len=MAX_LEN + 8, page_size=1,
        max_total_tokens=4 * nodes + 4 * MAX_LEN, mamba_cache_size=nodes + 8,
    )
    cache = HybridRadixCache(pools, mamba_align=1, policy=policy)
    rng = random.Random(seed)
    seqs: list[list[int]] = []
    t0 = time.perf_counter()
    check_every = max(1, nodes // 200)  # (stats() walks the tree)
    while len(seqs) % check_every or cache.stats()["nodes"] < nodes:
        if not seqs or rng.random() < 0.05:
            seq = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        else:
            parent = rng.choice(seqs)
            cut = rng.randint(1, min(len(parent), MAX_LEN - 3))
            seq = parent[:cut] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
        kv = pools.kv.allocator.alloc(len(seq))
        state = pools.mamba.alloc(1)
        if kv is None or state is None:
            raise RuntimeError("pools too small for the tree")
        cache.insert(seq, kv, int(state[0]))
        seqs.append(seq)
    build_s = time.perf_counter() - t0
    for _ in range(min(2000, len(seqs))):  # recency no longer follows insertion order
        cache.match_prefix(rng.choice(seqs))
    return cache, seqs, build_s


def per_call(fn, calls: int) -> dict:
    times = []
    for _ in range(calls):
        t0 = CLOCK()
        fn()
        times.append((CLOCK() - t0) * 1e6)
    return {"median": statistics.median(times), "mean": statistics.fmean(times), "calls": calls}


def measure(policy: str, nodes: int, evictions: int, seed: int) -> dict:
    cache, _, build_s = build_tree(policy, nodes, seed)
    e = max(1, min(evictions, nodes // 10))
    out = {"nodes": cache.stats()["nodes"], "build_s": build_s, "evictions": e}
    gc.collect()
    gc.disable()  # (a collection of the whole tree would land in whichever call triggers it)
    try:
        _evict(cache, e, out)
    finally:
        gc.enable()
    out["nodes_after"] = cache.stats()["nodes"]
    cache.check_invariants()
    return out


def _evict(cache: HybridRadixCache, e: int, out: dict) -> None:
    """The timed part of :func:`measure` (module docstring), results into ``out``."""
    t0 = CLOCK()
    cache.kv_eviction_order()
    cache.mamba_eviction_order()
    out["full_rank_ms"] = (CLOCK() - t0) * 1e3
    out["kv_per_call_us"] = per_call(lambda: cache.evict_kv(1), e)
    out["mamba_per_call_us"] = per_call(lambda: cache.evict_mamba(1), e)
    for kind in ("kv", "mamba"):
        before = cache.stats()
        t0 = CLOCK()
        if kind == "kv":
            cache.evict_kv(e * 2)  # edges of 1-3 tokens: about e nodes
            evicted = cache.stats()["kv_evicted_nodes"] - before["kv_evicted_nodes"]
        else:
            evicted = cache.evict_mamba(e)
        out[f"{kind}_bulk_us_per_node"] = (CLOCK() - t0) * 1e6 / max(evicted, 1)
        out[f"{kind}_bulk_nodes"] = evicted


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="tree sizes (nodes), comma-separated")
    ap.add_argument("--policies", default="lru,marconi")
    ap.add_argument("--evictions", type=int, default=1000, help="victims per measurement (at most n / 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    result = {
        "env": {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
                "processor": platform.processor(), "clock": "time.thread_time"},
        "sizes": sizes, "evictions": args.evictions, "results": {},
    }
    print(f"{'policy':8} {'nodes':>7} {'kv us/call':>11} {'mamba us/call':>14} {'kv bulk us/node':>16} "
          f"{'mamba bulk us/node':>19} {'full rank ms':>13} {'build s':>8}")
    for policy in args.policies.split(","):
        rows = result["results"].setdefault(policy, {})
        for n in sizes:
            r = measure(policy, n, args.evictions, args.seed)
            rows[str(n)] = r
            print(f"{policy:8} {r['nodes']:>7} {r['kv_per_call_us']['median']:>11.1f} "
                  f"{r['mamba_per_call_us']['median']:>14.1f} {r['kv_bulk_us_per_node']:>16.1f} "
                  f"{r['mamba_bulk_us_per_node']:>19.1f} {r['full_rank_ms']:>13.1f} {r['build_s']:>8.1f}", flush=True)
    write_result(result, args.out, "radix_eviction_cpu.json")
    return result


def write_result(result: dict, out: str | None, default_name: str) -> None:
    """``result`` as JSON to ``out`` (default: ``benchmarks/results/<default_name>``)."""
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", default_name)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
