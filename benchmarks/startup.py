"""Start-up of a wrapped reference model: on a fresh machine (empty compile caches) and with warm
caches, each run a fresh Python process, as a user restarting a server gets.

    python benchmarks/startup.py [--model qwen3_next] [--runs 3] [--device cuda] [--tiny]
        [--cache-dir DIR] [--new-tokens 8] [--max-running-requests N] [--profile N] [--bytecode-cache]
        [--out benchmarks/results/startup.json]

Each run builds the reference model's random weights on the device (``benchmarks/reference_models.py``;
timed apart as ``build_s``: a deployment loads its weights instead), then times
``hc.wrap(model, compile=True)`` (CUDA graphs by default on a GPU; ``--max-running-requests`` sets the
engine's, and so the decode graphs captured: by default the engine's default) around the call and records
``engine.stats()["startup"]`` (each phase's seconds: pools, patch, compile, capture, warm-up) and
``["startup_work"]`` (what each phase compiled: Dynamo graphs, Inductor compiles and cache hits, our
Triton kernels' JIT compiles), then greedy-generates ``--new-tokens`` tokens for two prompts (the
engine works; every run must give the same tokens: ``tokens_equal``). ``process_s`` is the whole
process (interpreter, imports, build, wrap, generate) as the parent sees it; ``dynamo_frames`` each
Dynamo compile of the forward (the first at the compile phase, the one-token decode graph's in the
capture phase) split into Dynamo's trace and our backend (torch's compile metrics).

The first run gets empty cache directories (``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``
under ``--cache-dir``, default a new temporary directory): a fresh machine's caches; the later runs
reuse them: warm caches. The JSON holds every run; a PNG beside it plots the phases per run
(``benchmarks/plots.py::plot_startup``). ``--tiny`` (CPU smoke runs) keeps the model's structure at
toy sizes. ``--profile N`` runs each ``wrap`` under cProfile and keeps its N costliest functions (by
own time and by cumulative time) in the run's ``profile`` (the profiler slows the call: its ``wrap_s``
is then not the start-up's). ``--bytecode-cache`` lets the runs keep Python's compiled modules
(``PYTHONPYCACHEPREFIX`` under ``--cache-dir``) where the environment sets ``PYTHONDONTWRITEBYTECODE``
(the GPU machine this repository measures on does: without it every process compiles the source of
each module it imports, torch's included); the first run then writes them, the later ones import them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(args) -> dict:
    """One start-up in this process (the parent runs this in a fresh one): build, wrap, generate."""
    t_start = time.perf_counter()
    import torch

    import hybrid_compile as hc
    from benchmarks.reference_models import REFERENCE_BUILDERS, random_token_prompts, sync_device

    import_s = time.perf_counter() - t_start
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    t = time.perf_counter()
    model = REFERENCE_BUILDERS[args.model](dtype=dtype, device=args.device, seed=0, tiny=args.tiny)
    sync_device(args.device)
    build_s = time.perf_counter() - t
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t = time.perf_counter()
    extra = {} if args.max_running_requests is None else {"max_running_requests": args.max_running_requests}
    engine = hc.wrap(model, compile=True, **extra)
    sync_device(args.device)
    wrap_s = time.perf_counter() - t
    if profiler is not None:
        profiler.disable()
    with engine:
        prompts = random_token_prompts(2, 16, model.config.vocab_size, seed=0)
        t = time.perf_counter()
        tokens = engine.generate_batch(prompts, max_new_tokens=args.new_tokens)
        generate_s = time.perf_counter() - t
        stats = engine.stats()
    return dict(import_s=import_s, build_s=build_s, wrap_s=wrap_s, generate_s=generate_s, tokens=tokens,
                dynamo_frames=_dynamo_frames(),
                startup=stats["startup"], startup_work=stats["startup_work"],
                compile=dict(pieces=stats["compile"]["pieces"],
                             distinct_pieces=stats["compile"].get("distinct_pieces"),
                             caches=stats["compile"]["caches"]),
                cuda_graphs={k: stats["compile"].get(k) for k in (
                    "cuda_graphs", "capture_seconds", "decode_batch_sizes", "token_buckets", "full_graphs",
                    "piecewise_graphs", "one_token_graph")},
                profile=_top_functions(profiler, args.profile) if profiler is not None else None)


def _dynamo_frames() -> list[dict]:
    """Dynamo's compile metrics of each compile of the engine's forward in this process (torch's
    ``get_compilation_metrics``): the whole frame's seconds, our backend's (split + Inductor) within
    them, and the trace (the rest); AOTAutograd / Inductor / garbage-collection microseconds where
    this torch records them."""
    from torch._dynamo.utils import get_compilation_metrics

    frames = []
    for m in get_compilation_metrics():
        if not str(getattr(m, "co_name", "")).startswith("hybrid_compile_forward"):
            continue
        entire, backend = getattr(m, "entire_frame_compile_time_s", None), getattr(m, "backend_compile_time_s", None)
        frames.append(dict(
            entire_s=entire, backend_s=backend,
            trace_s=entire - backend if entire is not None and backend is not None else None,
            **{k: getattr(m, k, None) for k in ("aot_autograd_cumulative_compile_time_us",
                                                 "inductor_cumulative_compile_time_us", "gc_time_us")}))
    return frames


def _top_functions(profiler, n: int) -> dict:
    """The ``n`` functions of a cProfile run with the most own time and the most cumulative time."""
    import pstats

    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = [dict(function=f"{os.path.relpath(f) if f.startswith(ROOT) else f}:{line}({name})", calls=nc,
                 own_s=round(tt, 4), cumulative_s=round(ct, 4)) for (f, line, name), (_, nc, tt, ct, _) in stats.items()]
    return dict(by_own_time=sorted(rows, key=lambda r: -r["own_s"])[:n],
                by_cumulative_time=sorted(rows, key=lambda r: -r["cumulative_s"])[:n])


def run_parent(args) -> dict:
    from hybrid_compile.engine.startup import PHASES

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="hc_startup_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"),
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if args.bytecode_cache:  # Python's compiled modules kept under the cache directory, as an installed package has them
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(cache_dir, "pycache")
    fresh = not any(os.path.exists(os.path.join(cache_dir, d)) for d in ("inductor", "triton"))
    child_args = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--device", args.device,
                  "--new-tokens", str(args.new_tokens), "--profile", str(args.profile)] + (["--tiny"] if args.tiny else []) \
        + ([] if args.max_running_requests is None else ["--max-running-requests", str(args.max_running_requests)])
    runs = []
    for i in range(args.runs):
        t = time.perf_counter()
        proc = subprocess.run(child_args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        process_s = time.perf_counter() - t
        if proc.returncode != 0:
            raise SystemExit(f"run {i} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run.update(run=i, caches="empty" if i == 0 and fresh else "warm", process_s=process_s)
        runs.append(run)
        s = run["startup"]
        work = run["startup_work"]
        print(f"run {i} ({run['caches']} caches): wrap {run['wrap_s']:.1f} s = "
              + ", ".join(f"{k} {s[f'{k}_s']:.1f}" for k in PHASES if s.get(f"{k}_s"))
              + f"; process {process_s:.1f} s (imports {run['import_s']:.1f}, build {run['build_s']:.1f}); "
              + "compiled: " + ", ".join(f"{p} {w['inductor_compiles']} inductor / {w['inductor_cache_hits']} hits / "
                                         f"{w.get('triton_compiles') or 0} triton ({w.get('triton_cache_hits') or 0} from its cache)"
                                         for p, w in work.items()
                                         if any(w.values()))
              + "; Dynamo frames (trace + backend s): " + ", ".join(
                  f"{f['trace_s']:.1f} + {f['backend_s']:.1f}" for f in run["dynamo_frames"] if f["trace_s"] is not None),
              flush=True)
    return dict(runs=runs, cache_dir=cache_dir, tokens_equal=all(r["tokens"] == runs[0]["tokens"] for r in runs))


def main(argv=None):
    from benchmarks.reference_models import REFERENCE_BUILDERS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_next", choices=sorted(REFERENCE_BUILDERS),
                   help="a reference model (benchmarks/reference_models.py)")
    p.add_argument("--runs", type=int, default=3, help="processes in a row; the first on the caches as found")
    p.add_argument("--device", default=None, help="cuda (default when there is one) or cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes of the model (CPU smoke runs)")
    p.add_argument("--cache-dir", default=None, help="where the runs' compile caches live (default: a new temp dir)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--bytecode-cache", action="store_true",
                   help="let the runs write Python's compiled modules (under --cache-dir, PYTHONPYCACHEPREFIX) where "
                        "the environment forbids it (PYTHONDONTWRITEBYTECODE): each later run then imports them, as "
                        "from an installed package, instead of compiling ~640 modules' source again")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="the engine's (decode graphs are captured up to it); default: the engine's default")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds a run may take")
    p.add_argument("--profile", type=int, default=0, help="keep the N costliest functions of each wrap (cProfile)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/startup_<device>.json)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        print(json.dumps(run_child(args)))
        return
    if args.runs < 1 or args.new_tokens < 1 or args.profile < 0:
        p.error("--runs and --new-tokens must be at least 1, --profile at least 0")
    import torch

    from benchmarks.plots import plot_startup

    result = dict(model=args.model, tiny=args.tiny, device=args.device, max_running_requests=args.max_running_requests,
                  bytecode_cache=args.bytecode_cache,
                  dont_write_bytecode_env=os.environ.get("PYTHONDONTWRITEBYTECODE"),
                  device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  torch=torch.__version__, date=time.strftime("%Y-%m-%d"), **run_parent(args))
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"startup_{args.device}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    plots = plot_startup(result, os.path.splitext(out)[0] + ".png")
    print(f"tokens equal across runs: {result['tokens_equal']}; wrote {out}"
          + (f", {plots['files'][0]}" if plots["files"] else f" ({plots['message']})"))
    if not result["tokens_equal"]:
        raise SystemExit("the runs generated different tokens")


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
