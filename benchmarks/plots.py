"""PNG plots of an end-to-end benchmark run (the JSON that ``benchmarks/e2e.py`` writes), and of
tensor-parallel scaling runs (``plot_tensor_parallel``, the JSON of ``benchmarks/tensor_parallel.py``) and
of start-up runs (``plot_startup``, the JSON of ``benchmarks/startup.py``).

``make_plots(run, prefix)`` writes, per model, ``<prefix>_<model>_decode.png`` (decode tokens/s
vs batch size, one line per system), ``<prefix>_<model>_ttft.png`` (CDF of the per-request time
to first token of the continuous-batching run) and ``<prefix>_<model>_roofline.png`` (decode at
batch 1 as a fraction of the roofline). Without matplotlib it writes nothing and says so.

    python benchmarks/plots.py benchmarks/results/e2e_<device>_<date>.json
"""

from __future__ import annotations

import json
import os
import sys


def _ok(r: dict) -> bool:
    return r.get("status") in ("ok", "partial")


def make_plots(run: dict, prefix: str) -> dict:
    """Writes the PNGs; returns {"files": [...]} or {"files": [], "message": why none}."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return dict(files=[], message="plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
    files = []
    rooflines = run.get("env", {}).get("rooflines", {})
    device = run.get("env", {}).get("device", "")
    for model, systems in run.get("results", {}).items():
        title = f"{model} on {device}"
        # decode throughput vs batch size
        fig, ax = plt.subplots(figsize=(7, 4.5))
        any_line = False
        for name, r in systems.items():
            batches = r.get("workloads", {}).get("decode", {}).get("batches", {}) if _ok(r) else {}
            pts = sorted((int(b), d["decode_tokens_per_s"]) for b, d in batches.items() if "decode_tokens_per_s" in d)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
                any_line = True
        if any_line:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"decode throughput: {title}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
            files.append(_save(fig, f"{prefix}_{model}_decode.png"))
        plt.close(fig)
        # TTFT distribution of the continuous-batching run
        fig, ax = plt.subplots(figsize=(7, 4.5))
        any_line = False
        for name, r in systems.items():
            ttfts = sorted(r.get("workloads", {}).get("cb", {}).get("ttft_s", []) if _ok(r) else [])
            if ttfts:
                ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], drawstyle="steps-post", label=name)
                any_line = True
        if any_line:
            ax.set_xlabel("time to first token (s), all requests queued at t=0")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"continuous batching TTFT: {title}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
            files.append(_save(fig, f"{prefix}_{model}_ttft.png"))
        plt.close(fig)
        # roofline fraction at batch 1
        roof = rooflines.get(model, {}).get("roofline_ms_per_step")
        bars = []
        for name, r in systems.items():
            d = r.get("workloads", {}).get("decode", {}).get("batches", {}).get("1", {}) if _ok(r) else {}
            if roof and d.get("ms_per_token"):
                bars.append((name, roof / d["ms_per_token"]))
        if bars:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            ax.barh([b[0] for b in bars], [b[1] for b in bars])
            ax.axvline(0.7, color="k", linestyle="--", linewidth=1, label="70 % goal")
            ax.set_xlabel(f"fraction of roofline ({roof:.3f} ms/step)")
            ax.set_title(f"decode at batch 1: {title}")
            ax.legend(fontsize=8)
            fig.tight_layout()
            files.append(_save(fig, f"{prefix}_{model}_roofline.png"))
            plt.close(fig)
    return dict(files=files)


def plot_tensor_parallel(runs: list[dict], path: str) -> dict:
    """One PNG of ``benchmarks/tensor_parallel.py`` runs (their JSON, one TP size or several each):
    decode tokens/s at every batch size and prefill tokens/s at every length against the TP size,
    one line each. Runs of one shape on one kind of device belong together."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return dict(files=[], message="plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
    by_tp = {r["tp"]: r for run in runs for r in run["results"]}
    sizes = sorted(by_tp)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, kind, unit in ((axes[0], "decode", "batch "), (axes[1], "prefill", "")):
        keys = sorted({k for r in by_tp.values() for k in r[kind]}, key=int)
        for k in keys:
            xs = [tp for tp in sizes if k in by_tp[tp][kind]]
            ax.plot(xs, [by_tp[tp][kind][k]["tokens_per_s"] for tp in xs], marker="o",
                    label=f"{unit}{k}" + (" tokens" if kind == "prefill" else ""))
        ax.set_xticks(sizes)
        ax.set_xlabel("tensor-parallel size (GPUs)")
        ax.set_ylabel(f"{kind} tokens/s")
        ax.set_title(kind)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    model = os.path.basename(str(runs[0].get("model", ""))).rstrip("/")
    fig.suptitle(f"{model} on {runs[0].get('device_name', '')}")
    return dict(files=[_save(fig, path)])


def plot_startup(run: dict, path: str) -> dict:
    """One PNG of a ``benchmarks/startup.py`` run: each process's start-up phases as a stacked bar
    (seconds), labelled with its caches (empty / warm)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return dict(files=[], message="plots skipped: matplotlib is not installed (pip install -e '.[bench]')")
    from hybrid_compile.engine.startup import PHASES

    runs = run["runs"]
    phases = [f"{k}_s" for k in PHASES if any(r["startup"].get(f"{k}_s") for r in runs)]
    fig, ax = plt.subplots(figsize=(1.6 * len(runs) + 3, 4))
    bottom = [0.0] * len(runs)
    labels = [f"run {r['run']}\n({r['caches']})" for r in runs]
    for k in phases:
        vals = [r["startup"].get(k, 0.0) for r in runs]
        ax.bar(labels, vals, bottom=bottom, label=k[:-2])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(runs):
        ax.text(i, bottom[i], f"{r['startup']['total_s']:.1f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(f"start-up of {run['model']}{' (tiny)' if run.get('tiny') else ''} on {run.get('device_name', '')}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return dict(files=[_save(fig, path)])


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/plots.py RUN.json")
    with open(sys.argv[1]) as f:
        result = make_plots(json.load(f), os.path.splitext(sys.argv[1])[0])
    print(result.get("message") or "\n".join(result["files"]))
