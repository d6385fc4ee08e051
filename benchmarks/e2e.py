"""End-to-end benchmark: our engine in each mode against what users run today (transformers).

    python benchmarks/e2e.py --fla-path .whl               # the full run on a CUDA machine
    python benchmarks/e2e.py --quick                        # fewer tokens and requests
    python benchmarks/e2e.py --tiny --device cpu            # CPU smoke run of everything (toy models)
    python benchmarks/e2e.py --quick --models jamba,kimi_linear --fla-path .whl   # the MoE models

Models (``--models``), random weights (bf16, seed 0) from ``benchmarks/reference_models.py``:
``qwen3_next`` (the reference Qwen3-Next, 1.912 B) and ``nemotron_h`` (a NemotronH of similar
size), the default pair; ``jamba`` (Jamba-v0.1's layer shapes in 8 layers: Mamba1 + attention every
8th layer + MoE of 16 experts every 2nd layer, 13.3 B parameters, 3.4 B active) and
``kimi_linear`` (Kimi-Linear-48B-A3B's layer shapes in 8 layers: ``[KDA x3, MLA] x2``, MoE of 256
experts top 8, 13.9 B parameters, 1.6 B active), selected with ``--models jamba,kimi_linear``: they
are not in the default run, which they would lengthen several-fold (each holds ~7x the default
models' weights, builds once per system process, and transformers' pure-torch paths on them run a
sequential Mamba1 scan / a chunk loop per layer). ``--model DIR`` loads a safetensors checkpoint
directory instead. Where a system cannot run a family, its row says why: ``unavailable`` /
``unsupported`` with a message (``hf_fla`` exists only for the families whose mixers
flash-linear-attention implements: GDN and Kimi Delta Attention, not Mamba1 / Mamba2; an engine
mode our configuration refuses, e.g. an FP8 KV cache for Kimi-Linear's compressed MLA cache), or,
where a workload fails at run time (transformers' static-cache compile on a family, an out of
memory), that workload's ``error`` with the exception, named in the table's row.

Systems (``--systems``), each measured in its own subprocess (transformers picks its kernels at
import; a crash loses only that system's remaining workloads, and the run JSON is rewritten after
every system):

- ``hf_eager``: transformers ``model.generate`` with its pure-torch fallbacks (flash-linear-attention,
  causal-conv1d and mamba-ssm are made unimportable in that process);
- ``hf_fla``: transformers with flash-linear-attention importable (``--fla-path DIR``: a folder
  on ``sys.path`` or a folder of ``.whl`` files, unpacked for that process only);
- ``hf_static_compile``: ``generate(cache_implementation="static")``, transformers' own
  ``torch.compile`` (``mode="reduce-overhead"``: CUDA graphs) of the forward;
- ``ours_*``: our engine, eager ops / compiled / compiled + CUDA graphs (``True``, ``"full"``,
  ``"piecewise"``) / + prefix cache / + n-gram speculative decoding / recurrent state in bf16 or
  FP8, FP8 KV cache / fused MoE experts (``ours_fused_moe``; ``ours_hf_experts``: transformers' experts path, which
  the default replaces on CUDA; MoE models). A mode whose configuration
  raises ``NotImplementedError`` or ``ValueError`` is an "unsupported: <message>" row.

Workloads (``--workloads``): ``check`` (our prefill logits against transformers' on the same
weights: fp32 with a tight tolerance, bf16 against the fp32 logits; and our greedy tokens against
transformers' ``generate`` in fp32, ``CHECK_NEW_TOKENS`` of them), ``decode`` (tokens/s at batch 1,
16, 64; prompt 512, 128 new tokens, no EOS), ``prefill`` (time to first token of one 4k and one 32k
prompt, median of ``PREFILL_REPEATS`` cold runs after a warm-up), ``cb`` (256 requests with seeded
random prompt / output lengths, all queued at t=0: throughput, mean / p99 TTFT and inter-token
latency; transformers runs them as static batches and the best batch size counts) and
``shared_prefix`` (groups of prompts sharing a system prompt, submitted in waves: wave k holds the
k-th prompt of every group, so with the prefix cache every wave after the first reuses the system
prompts). The decode roofline at batch 1 is (weight bytes read + state read and write + KV read) /
the memory bandwidth measured in the same run (the best of a 256 MiB copy, a 1 GiB copy and a 1 GiB
read) (by the parent process, which also rejects modes the engine's configuration refuses on this
device without starting a worker); the weight bytes read are the active parameters' (MoE: the routed
experts at top_k / num_experts; an untied input embedding not at all: a lookup reads one row).
Decode tokens/s counts the tokens produced after every request of the batch has its first token,
over the time from then to the last token; TTFT and token times are host timestamps after a device
sync (one per transformers ``generate`` call, one per engine step).

A long run can be split over several calls into one JSON: ``--out FILE --resume`` keeps the jobs
FILE already holds as finished (measured, unsupported or unavailable) and runs the others.

Output: one JSON file (``--out``, default ``benchmarks/results/e2e_<device>_<date>.json``), a
printed table and PNG plots next to the JSON (``benchmarks/plots.py``; needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the repository's hybrid_compile, installed or not

HF_SYSTEMS = ("hf_eager", "hf_fla", "hf_static_compile")
# our engine's modes: EngineConfig overrides; "base" modes get --ours-base's settings first
OURS_MODES = {
    "ours_eager": dict(compile=False),
    "ours_compiled": dict(compile=True, cuda_graphs=False),
    "ours_cuda_graphs": dict(compile=True, cuda_graphs=True),
    "ours_cuda_graphs_full": dict(compile=True, cuda_graphs="full"),
    "ours_cuda_graphs_piecewise": dict(compile=True, cuda_graphs="piecewise"),
    "ours_prefix_cache": dict(base=True, enable_prefix_cache=True),
    "ours_speculative": dict(base=True, speculative=dict(method="ngram", num_draft_tokens=3)),
    # the recurrent state in bf16 (vLLM's default for these layers; transformers and our default
    # keep fp32): half the state bytes, which at batch 64 outweigh the weights
    "ours_bf16_state": dict(base=True, ssm_state_dtype="bfloat16"),
    # FP8 pools (README "FP8 KV cache and FP8 recurrent state"): e4m3 state / KV cache with scales
    "ours_fp8_state": dict(base=True, ssm_state_dtype="fp8"),
    "ours_fp8_kv_cache": dict(base=True, kv_cache_dtype="fp8"),
    # MoE models: our grouped-GEMM experts and fused softmax routers (README "Fused MoE experts")
    # in place of transformers' experts path; a dense model refuses it (an "unsupported" row)
    "ours_fused_moe": dict(base=True, fused_moe=True),
    # ... and transformers' experts path instead (the default on the CPU, fused_moe=None on CUDA is ours)
    "ours_hf_experts": dict(base=True, fused_moe=False),
}
SYSTEMS = HF_SYSTEMS + tuple(OURS_MODES)
# timed prefills per length after the warm-up; the table reports their median (one 4k prefill
# is ~60 ms on an H100: single samples spread by up to 2x between runs)
PREFILL_REPEATS = 3
WORKLOADS = ("check", "decode", "prefill", "cb", "shared_prefix")
# workloads that tell something about a mode (the prefix cache only matters with shared prefixes)
SYSTEM_WORKLOADS = {
    "ours_prefix_cache": ("shared_prefix", "cb"),
    "ours_speculative": ("decode", "cb"),
    "ours_bf16_state": ("decode", "cb"),
    "ours_fp8_state": ("decode", "cb"),
    "ours_fp8_kv_cache": ("decode", "cb"),
    "ours_fused_moe": ("decode", "prefill", "cb"),
    "ours_hf_experts": ("decode", "prefill", "cb"),
}
MODELS = ("qwen3_next", "nemotron_h")  # the default --models
# every reference model (benchmarks/reference_models.py REFERENCE_BUILDERS; not imported here: the
# worker must block the kernel packages before transformers is imported)
ALL_MODELS = MODELS + ("jamba", "kimi_linear")
# kernel packages transformers uses when they import; hf_eager runs with none of them
KERNEL_PACKAGES = ("fla", "causal_conv1d", "mamba_ssm")
# the model types whose mixers transformers runs on flash-linear-attention's kernels when it imports
# (GDN: chunk / fused_recurrent_gated_delta_rule; Kimi Delta Attention: chunk_kda / fused_recurrent_kda)
FLA_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear")
# where transformers' fast path for a family comes from instead (hf_fla's "unavailable" message)
OTHER_KERNEL_PACKAGES = {"jamba": "mamba-ssm and causal-conv1d", "nemotron_h": "mamba-ssm and causal-conv1d"}
# greedy tokens of the check workload (fp32: ours against transformers' generate)
CHECK_NEW_TOKENS = 8
# correctness tolerances (stated in the JSON): fp32 max |ours - HF| relative to max |HF logit|;
# bf16: our distance to the fp32 logits at most BF16_FACTOR x transformers' own bf16 distance
# (plus BF16_FLOOR x max |logit|, for when transformers' bf16 happens to be nearly exact)
FP32_RTOL = 5e-3
BF16_FACTOR = 2.0
BF16_FLOOR = 1e-2


@dataclasses.dataclass
class Settings:
    """Sizes of every workload (see :func:`settings_for`)."""

    decode_batches: list
    decode_prompt: int
    decode_new: int
    prefill_lens: list
    cb_requests: int
    cb_prompt: tuple
    cb_output: tuple
    hf_static_batches: list
    sp_groups: int
    sp_per_group: int
    sp_system: int
    sp_question: tuple
    sp_output: int
    check_prompt: int
    max_running: int
    chunked_prefill: int


def settings_for(tiny: bool, quick: bool) -> Settings:
    if tiny:
        return Settings(decode_batches=[1, 4], decode_prompt=32, decode_new=6, prefill_lens=[64, 256],
                        cb_requests=10, cb_prompt=(8, 48), cb_output=(2, 8), hf_static_batches=[4],
                        sp_groups=2, sp_per_group=3, sp_system=80, sp_question=(4, 12), sp_output=3,
                        check_prompt=24, max_running=8, chunked_prefill=128)
    if quick:
        return Settings(decode_batches=[1, 16, 64], decode_prompt=512, decode_new=32, prefill_lens=[4096, 32768],
                        cb_requests=64, cb_prompt=(64, 1024), cb_output=(16, 128), hf_static_batches=[64],
                        sp_groups=4, sp_per_group=4, sp_system=4096, sp_question=(64, 256), sp_output=32,
                        check_prompt=64, max_running=64, chunked_prefill=8192)
    # transformers runs the 256 requests as static batches of 64 (our engine's max_running): each
    # batch decodes to the longest output (512 steps), and batches of 16 would take ~4 minutes of
    # an H100 per transformers system while delivering less throughput
    return Settings(decode_batches=[1, 16, 64], decode_prompt=512, decode_new=128, prefill_lens=[4096, 32768],
                    cb_requests=256, cb_prompt=(64, 2048), cb_output=(16, 512), hf_static_batches=[64],
                    sp_groups=4, sp_per_group=8, sp_system=8192, sp_question=(64, 256), sp_output=32,
                    check_prompt=64, max_running=64, chunked_prefill=8192)


# ---------------------------------------------------------------------------------------------
# worker side: one (model, system) per process
# ---------------------------------------------------------------------------------------------

def _block_kernel_packages():
    """Make the optional kernel packages unimportable in this process (transformers' pure-torch path)."""
    for name in KERNEL_PACKAGES:
        sys.modules[name] = None


def _add_fla_path(path: str) -> str:
    """Put flash-linear-attention on sys.path: ``path`` is a folder with the ``fla`` package or a
    folder of wheels (unpacked into a temporary folder). Returns the folder added."""
    wheels = sorted(f for f in os.listdir(path) if f.endswith(".whl"))
    if wheels:
        target = tempfile.mkdtemp(prefix="e2e_fla_")
        for w in wheels:
            with zipfile.ZipFile(os.path.join(path, w)) as z:
                z.extractall(target)
        path = target
    sys.path.insert(0, path)
    return path


def _importable(names) -> dict:
    """{name: {"available": bool, "version" or "error": str}} for each package name."""
    import importlib

    found = {}
    for n in names:
        try:
            mod = importlib.import_module(n)
            found[n] = dict(available=True, version=str(getattr(mod, "__version__", "unknown")))
        except Exception as e:  # noqa: BLE001 - reported
            found[n] = dict(available=False, error=f"{type(e).__name__}: {e}")
    return found


KERNEL_ATTRS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule",
                "causal_conv1d_fn", "causal_conv1d_update", "selective_state_update", "mamba_chunk_scan_combined")


def hf_kernel_report(model) -> dict:
    """Which implementation transformers picked for each kernel function of ``model``'s modeling
    module: ``{function: "module.qualname"}``. Covers the hub-kernel wrappers of newer transformers
    (closure ``implementation``) and the per-layer attributes / module globals of older ones."""
    import inspect

    def where(fn):
        return None if fn is None else f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"

    report = {}
    modeling = sys.modules.get(type(model).__module__)
    for name, obj in sorted(vars(modeling).items()) if modeling else ():
        if inspect.isfunction(obj):
            try:
                nonlocals = inspect.getclosurevars(obj).nonlocals
            except (TypeError, ValueError):
                continue
            if "is_new_implementation" in nonlocals:
                report[nonlocals.get("func_name", name)] = where(nonlocals.get("implementation"))
        elif name in KERNEL_ATTRS:
            report[name] = where(obj)
    for m in model.modules():
        for attr in KERNEL_ATTRS:
            fn = m.__dict__.get(attr)
            if callable(fn) and attr not in report:
                report[attr] = where(fn)
    return report


class Clock:
    """Wall-clock timestamps that wait for the device first."""

    def __init__(self, device):
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.torch = torch

    def now(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
        return time.perf_counter()


def _percentile(values, q):
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _latency_summary(ttfts, itls, out_tokens, seconds, prompt_tokens) -> dict:
    return dict(
        requests=len(ttfts), seconds=seconds, output_tokens=out_tokens, prompt_tokens=prompt_tokens,
        output_tokens_per_s=out_tokens / seconds, total_tokens_per_s=(out_tokens + prompt_tokens) / seconds,
        ttft_mean_s=sum(ttfts) / len(ttfts), ttft_p50_s=_percentile(ttfts, 50), ttft_p99_s=_percentile(ttfts, 99),
        itl_mean_s=(sum(itls) / len(itls)) if itls else None, itl_p99_s=_percentile(itls, 99),
        ttft_s=ttfts,
    )


def random_prompts(n, length, vocab, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = [length] * n if isinstance(length, int) else length
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lens]


def request_list(s: Settings, vocab: int, seed: int = 1):
    """The continuous-batching workload: seeded random prompt and output lengths."""
    import random

    rng = random.Random(seed)
    plens = [rng.randint(*s.cb_prompt) for _ in range(s.cb_requests)]
    olens = [rng.randint(*s.cb_output) for _ in range(s.cb_requests)]
    return random_prompts(len(plens), plens, vocab, seed), olens


def shared_prefix_waves(s: Settings, vocab: int, seed: int = 2):
    """Waves of (prompt, output length): wave k = the k-th prompt of every group."""
    import random

    rng = random.Random(seed)
    systems = random_prompts(s.sp_groups, s.sp_system, vocab, seed)
    waves = []
    for k in range(s.sp_per_group):
        qs = random_prompts(s.sp_groups, [rng.randint(*s.sp_question) for _ in range(s.sp_groups)], vocab, seed + 1 + k)
        waves.append([(systems[g] + qs[g], s.sp_output) for g in range(s.sp_groups)])
    return waves


class HFSystem:
    """transformers' ``generate`` in one of its configurations."""

    def __init__(self, model, name: str, device):
        import torch
        from transformers import LogitsProcessor

        self.model, self.name, self.clock = model, name, Clock(device)
        self.device = torch.device(device)
        clock = self.clock

        class FirstTokenTimer(LogitsProcessor):
            """Records when the first token's logits exist (one device sync per generate call)."""

            def __init__(self):
                self.t_first = None

            def __call__(self, input_ids, scores):
                if self.t_first is None:
                    self.t_first = clock.now()
                return scores

        self.timer_class = FirstTokenTimer
        self.extra = {}
        if name == "hf_static_compile":
            self.extra["cache_implementation"] = "static"
            if self.device.type != "cuda":  # transformers compiles automatically on CUDA only
                from transformers import CompileConfig

                cc = CompileConfig()
                cc._compile_all_devices = True
                self.extra["compile_config"] = cc

    def run_batch(self, prompts, max_new: int, pad_to: int | None = None) -> tuple[float, float, float]:
        """Greedy ``generate`` of left-padded prompts; returns (t0, t_first_token, t_end)."""
        import torch
        from transformers import LogitsProcessorList

        width = max(pad_to or 0, max(len(p) for p in prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        timer = self.timer_class()
        t0 = self.clock.now()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                eos_token_id=None, pad_token_id=0, logits_processor=LogitsProcessorList([timer]), **self.extra,
            )
        t_end = self.clock.now()
        if out.shape[1] != width + max_new:
            raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, expected {max_new}")
        return t0, timer.t_first, t_end

    def decode(self, prompts, new):
        self.run_batch(prompts, new)  # warm-up (and, for the static cache, compile) with the same shapes
        t0, tf, te = self.run_batch(prompts, new)
        return dict(t0=t0, t_all_first=tf, t_end=te, decode_tokens=len(prompts) * (new - 1))

    def prefill(self, prompt) -> float:
        """Time to first token of one prompt."""
        t0, tf, _ = self.run_batch([prompt], 1)
        return tf - t0

    def request_runs(self, prompts, out_lens, batch_sizes) -> dict:
        """The requests as static batches of each size (in arrival order, all queued at t=0); the
        static-cache system pads every batch to one shape (one compiled graph)."""
        results = {}
        static = self.name == "hf_static_compile"
        for bs in batch_sizes:
            chunks = [list(range(i, min(i + bs, len(prompts)))) for i in range(0, len(prompts), bs)]
            pad_to = max(len(p) for p in prompts) if static else None
            max_new_all = max(out_lens)

            def batch_of(idx):
                ps = [prompts[i] for i in idx]
                if static:
                    ps += [ps[-1]] * (bs - len(ps))
                return ps, (max_new_all if static else max(out_lens[i] for i in idx))

            ps, n = batch_of(chunks[0])
            self.run_batch(ps, min(n, 4) if not static else n, pad_to)  # warm-up
            ttfts, itls, start = [], [], self.clock.now()
            for idx in chunks:
                ps, n = batch_of(idx)
                _, tf, te = self.run_batch(ps, n, pad_to)
                ttfts += [tf - start] * len(idx)
                if n > 1:
                    itls += [(te - tf) / (n - 1)] * len(idx)
            seconds = self.clock.now() - start
            results[bs] = _latency_summary(ttfts, itls, sum(out_lens), seconds, sum(len(p) for p in prompts))
        best = max(results, key=lambda b: results[b]["output_tokens_per_s"])
        return dict(results[best], static_batch_size=best,
                    per_batch_size={b: {k: v for k, v in r.items() if k != "ttft_s"} for b, r in results.items()})

    def waves(self, waves) -> dict:
        """Each wave as one batch (the static-cache system pads every wave to one shape)."""
        ttfts, itls = [], []
        pad_to = max(len(p) for w in waves for p, _ in w) if self.name == "hf_static_compile" else None
        self.run_batch([p for p, _ in waves[0]], waves[0][0][1], pad_to)  # warm-up
        t_total = 0.0
        for wave in waves:
            t0, tf, te = self.run_batch([p for p, _ in wave], wave[0][1], pad_to)
            ttfts += [tf - t0] * len(wave)
            itls += [(te - tf) / max(1, wave[0][1] - 1)] * len(wave)
            t_total += te - t0
        out = sum(n for w in waves for _, n in w)
        return _latency_summary(ttfts, itls, out, t_total, sum(len(p) for w in waves for p, _ in w))


class OurSystem:
    """Our engine (one :class:`HybridEngine` per process, reused by every workload)."""

    def __init__(self, engine, device):
        self.engine, self.clock = engine, Clock(device)

    def run(self, prompts, out_lens) -> tuple[float, dict, dict]:
        """Queue every prompt, step until all finish; returns (t0, first-token time, token times) per rid.
        A token's time is when ``step()`` handed it to the caller."""
        from hybrid_compile import SamplingParams

        eng = self.engine
        t0 = self.clock.now()
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, out_lens)]
        times = {r: [] for r in rids}
        pending = set(rids)
        while pending:
            outs = eng.step()
            # no device sync here: the tokens step() returns are already on the host (it waited for
            # them), and a sync would also wait for the decode step launched ahead of them, i.e.
            # undo the engine's overlap of host work with the GPU that a user's loop keeps
            t = time.perf_counter()
            for o in outs:
                if o.token is not None and o.rid in times:
                    times[o.rid].append(t)
                if o.finished:
                    pending.discard(o.rid)
        for r, n in zip(rids, out_lens):
            req = eng.pop_finished(r)
            if len(req.output) != n:
                raise RuntimeError(f"request {r}: {len(req.output)} tokens, expected {n}")
        return t0, rids, times

    def decode(self, prompts, new):
        self.run(prompts, [min(new, 4)] * len(prompts))  # warm-up
        t0, rids, times = self.run(prompts, [new] * len(prompts))
        t_all_first = max(times[r][0] for r in rids)
        t_end = max(times[r][-1] for r in rids)
        after = sum(1 for r in rids for t in times[r] if t > t_all_first)
        return dict(t0=t0, t_all_first=t_all_first, t_end=t_end, decode_tokens=after)

    def prefill(self, prompt) -> float:
        """Time to first token of one prompt, cold (the prefix cache would serve a repeat)."""
        self._clear_cache()
        t0, rids, times = self.run([prompt], [1])
        return times[rids[0]][0] - t0

    def _summary(self, t0, rids, times, prompts, out_lens, t_end):
        ttfts = [times[r][0] - t0 for r in rids]
        itls = [b - a for r in rids for a, b in zip(times[r], times[r][1:])]
        return _latency_summary(ttfts, itls, sum(out_lens), t_end - t0, sum(len(p) for p in prompts))

    def request_runs(self, prompts, out_lens, batch_sizes=None) -> dict:
        self.run(prompts[:4], [min(4, n) for n in out_lens[:4]])  # warm-up
        self._clear_cache()
        t0, rids, times = self.run(prompts, out_lens)
        return self._summary(t0, rids, times, prompts, out_lens, self.clock.now())

    def waves(self, waves) -> dict:
        warm = [p[: len(p) // 2] for p, _ in waves[0]]
        self.run(warm, [2] * len(warm))
        self._clear_cache()
        ttfts, itls, total = [], [], 0.0
        for wave in waves:
            prompts, outs = [p for p, _ in wave], [n for _, n in wave]
            t0, rids, times = self.run(prompts, outs)
            s = self._summary(t0, rids, times, prompts, outs, self.clock.now())
            ttfts += s["ttft_s"]
            itls += [b - a for r in rids for a, b in zip(times[r], times[r][1:])]
            total += s["seconds"]
        out = sum(n for w in waves for _, n in w)
        res = _latency_summary(ttfts, itls, out, total, sum(len(p) for w in waves for p, _ in w))
        stats = self.engine.stats()
        if "prefix_cache" in stats:
            res["prefix_cache"] = stats["prefix_cache"]
        return res

    def _clear_cache(self):
        self.engine.clear_prefix_cache()


def _load_model(spec, dtype):
    sys.path.insert(0, HERE)
    if spec["model_path"] and spec["device"] == "meta":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec["model_path"]), dtype=dtype)
    if spec["model_path"]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=dtype, device_map=spec["device"]).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.do_sample = False
        return model
    from reference_models import REFERENCE_BUILDERS

    return REFERENCE_BUILDERS[spec["model"]](dtype, spec["device"], seed=spec["seed"], tiny=spec["tiny"])


def _model_type(spec) -> str:
    """The spec's model's ``model_type`` without building it: a checkpoint's config.json, or the
    reference model's name (each is its model type: tests/test_benchmarks.py checks it)."""
    if spec["model_path"]:
        with open(os.path.join(spec["model_path"], "config.json")) as f:
            return json.load(f)["model_type"]
    return spec["model"]


def _dtype(name):
    import torch

    return getattr(torch, name)


def _memory(device, reset=False):
    import torch

    if torch.device(device).type != "cuda":
        return None
    if reset:
        torch.cuda.reset_peak_memory_stats()
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def engine_config(spec, s: Settings, system: str) -> dict:
    overrides = dict(OURS_MODES[system])
    if overrides.pop("base", False):
        overrides = {**OURS_MODES[spec["ours_base"]], **overrides}
    max_context = max(s.prefill_lens + [s.decode_prompt + s.decode_new, s.cb_prompt[1] + s.cb_output[1],
                                        s.sp_system + s.sp_question[1] + s.sp_output]) + 64
    return dict(max_running_requests=s.max_running, chunked_prefill_size=s.chunked_prefill,
                max_context_len=max_context, memory_fraction=spec["memory_fraction"], **overrides)


def worker(spec_path: str, result_path: str) -> None:
    """Runs one (model, system) and writes its results to ``result_path`` after every workload."""
    with open(spec_path) as f:
        spec = json.load(f)
    system = spec["system"]
    result = dict(system=system, model=spec["model"], status="running", workloads={})

    def save():
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(tmp, result_path)

    if system == "hf_eager":
        _block_kernel_packages()
    if system == "hf_fla":
        model_type = _model_type(spec)
        if model_type not in FLA_MODEL_TYPES:  # decided before anything loads: no --fla-path would help
            other = OTHER_KERNEL_PACKAGES.get(model_type)
            result.update(status="unavailable", message=f"flash-linear-attention has no kernels for {model_type}'s "
                          "mixers" + (f" (transformers' fast path for them needs {other}, not part of this system)"
                                      if other else ""))
            return save()
        if not spec["fla_path"]:
            result.update(status="unavailable", message="flash-linear-attention not available: pass --fla-path DIR")
            return save()
        result["fla_path"] = _add_fla_path(spec["fla_path"])
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    result["kernel_packages"] = _importable(KERNEL_PACKAGES)
    fla = result["kernel_packages"]["fla"]
    if system == "hf_fla" and not fla["available"]:
        result.update(status="unavailable",
                      message=f"flash-linear-attention not importable from {spec['fla_path']}: {fla['error']}")
        return save()
    s = Settings(**spec["settings"])
    if system == "check":
        return check_worker(spec, s, result, save)
    model = _load_model(spec, _dtype(spec["dtype"]))
    vocab = model.config.vocab_size
    if system in HF_SYSTEMS:
        result["hf_kernels"] = hf_kernel_report(model)
        result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
        if system == "hf_fla" and not any(v and v.startswith("fla.") for v in result["hf_kernels"].values()):
            result.update(status="unavailable", message="flash-linear-attention imports but transformers did not "
                          f"pick its kernels (kernels: {result['hf_kernels']})")
            return save()
        runner = HFSystem(model, system, spec["device"])
    else:
        import hybrid_compile as hc

        cfg = engine_config(spec, s, system)
        result["engine_config"] = cfg
        t = time.perf_counter()
        try:
            engine = hc.wrap(model, **cfg)
        except (NotImplementedError, ValueError) as e:
            result.update(status="unsupported", message=f"{type(e).__name__}: {e}")
            return save()
        result["engine_setup_s"] = time.perf_counter() - t
        runner = OurSystem(engine, spec["device"])
    result["status"] = "ok"
    save()
    workloads = [w for w in spec["workloads"] if w in SYSTEM_WORKLOADS.get(system, WORKLOADS) and w != "check"]
    for w in workloads:
        _memory(spec["device"], reset=True)
        t = time.perf_counter()
        try:
            res = run_workload(w, runner, s, vocab)
            res["peak_memory_gib"] = _memory(spec["device"])
        except Exception as e:  # noqa: BLE001 - one failed workload must not lose the others
            res = dict(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            result["status"] = "partial"
        res["wall_s"] = time.perf_counter() - t
        result["workloads"][w] = res
        save()
    result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    if system in HF_SYSTEMS:  # did transformers compile (and how often did Dynamo break the graph)?
        counters = torch._dynamo.utils.counters
        result["dynamo"] = dict(unique_graphs=counters["stats"]["unique_graphs"],
                                graph_breaks=sum(counters["graph_break"].values()))
    else:
        st = runner.engine.stats()
        result["engine_stats"] = st
    if result["status"] == "running":
        result["status"] = "ok"
    save()


def _each(items, measure) -> dict:
    """{str(item): measure(item)}; an item that fails (e.g. out of memory at batch 64) becomes an
    error entry and the next one still runs."""
    import torch

    out = {}
    for item in items:
        try:
            out[str(item)] = measure(item)
        except Exception as e:  # noqa: BLE001 - reported
            out[str(item)] = dict(status="error", error=f"{type(e).__name__}: {e}",
                                  traceback=traceback.format_exc()[-2000:])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def run_workload(name, runner, s: Settings, vocab: int) -> dict:
    if name == "decode":
        def decode(b):
            r = runner.decode(random_prompts(b, s.decode_prompt, vocab, seed=100 + b), s.decode_new)
            dt = r["t_end"] - r["t_all_first"]
            return dict(
                batch=b, ttft_s=r["t_all_first"] - r["t0"], decode_s=dt, decode_tokens=r["decode_tokens"],
                decode_tokens_per_s=r["decode_tokens"] / dt, ms_per_token=1e3 * dt / (s.decode_new - 1),
                e2e_tokens_per_s=b * s.decode_new / (r["t_end"] - r["t0"]),
            )

        return dict(prompt=s.decode_prompt, new_tokens=s.decode_new, batches=_each(s.decode_batches, decode))
    if name == "prefill":
        def prefill(L):
            prompt = random_prompts(1, L, vocab, seed=200 + L)[0]
            runner.prefill(prompt)  # warm-up
            ttfts = [runner.prefill(prompt) for _ in range(PREFILL_REPEATS)]
            ttft = statistics.median(ttfts)
            return dict(tokens=L, ttft_s=ttft, tokens_per_s=L / ttft, ttft_samples_s=ttfts)

        return dict(lengths=_each(s.prefill_lens, prefill))
    if name == "cb":
        prompts, out_lens = request_list(s, vocab)
        return runner.request_runs(prompts, out_lens, s.hf_static_batches)
    if name == "shared_prefix":
        res = runner.waves(shared_prefix_waves(s, vocab))
        res.update(groups=s.sp_groups, per_group=s.sp_per_group, system_prompt=s.sp_system)
        return res
    raise ValueError(name)


def memory_bandwidth(dev) -> dict:
    """Bytes/s the device's memory delivers, measured three ways: a device-to-device copy of 256 MiB
    and of 1 GiB of bf16 (read + write bytes) and a read-only sum over 1 GiB. Decode at batch 1 reads
    its weights once per step, so the roofline uses the largest (``best``): on an H200 the 1 GiB
    copy reached only ~2.7 TB/s where the 256 MiB copy and the read reached ~4.2 TB/s."""
    import torch

    out = {}
    mib = (256, 1024) if dev.type == "cuda" else (16, 16)
    for name, size, fn in (("copy_256MiB", mib[0], "copy"), ("copy_1GiB", mib[1], "copy"), ("read_1GiB", mib[1], "read")):
        a = torch.ones(size * (1 << 20) // 2, dtype=torch.bfloat16, device=dev)
        b = torch.empty_like(a) if fn == "copy" else None

        def op(a=a, b=b):
            return b.copy_(a) if b is not None else a.sum()

        if dev.type == "cuda":
            sys.path.insert(0, HERE)
            from kernels import cuda_graph_ms

            ms = cuda_graph_ms(op, iters=30)
        else:
            op()
            clock, reps = Clock(dev), 10
            t = clock.now()
            for _ in range(reps):
                op()
            ms = 1e3 * (clock.now() - t) / reps
        moved = a.numel() * a.element_size() * (2 if fn == "copy" else 1)
        out[name] = moved / (ms * 1e-3)
        del a, b
    out["best"] = max(out.values())
    return out


def measure_env(spec, s: Settings) -> dict:
    """Device, versions, memory bandwidth and the decode roofline at batch 1 of each model (models
    built on the meta device: no weights). Runs in the parent process."""
    import torch
    import transformers

    import hybrid_compile as hc
    from hybrid_compile.memory import kv_bytes_per_token, mamba_bytes_per_slot
    from hybrid_compile.models import family_of

    sys.path.insert(0, HERE)
    from reference_models import active_params

    dev = torch.device(spec["device"])
    result = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        torch=torch.__version__, transformers=transformers.__version__, hybrid_compile=hc.__version__,
        python=platform.python_version(),
    )
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    bws = memory_bandwidth(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    bw = bws["best"]
    result["bandwidth_GBps"] = {k: v / 1e9 for k, v in bws.items()}
    result["copy_bandwidth_GBps"] = bw / 1e9  # (the roofline's bandwidth: the best of the three)
    rooflines = {}
    for model_name in spec["models"]:
        model = _load_model(dict(spec, model=model_name, device="meta"), _dtype(spec["dtype"]))
        layout = family_of(model).layout(model, kv_dtype=model.dtype, conv_dtype=model.dtype, ssm_dtype=torch.float32)
        weights = active_params(model, as_bytes=True) - _untied_input_embedding_bytes(model)
        ctx = s.decode_prompt + s.decode_new // 2
        state = 2 * mamba_bytes_per_slot(layout.mamba)  # read + write of one request's conv and SSM state
        kv = kv_bytes_per_token(layout.attention) * ctx
        total = weights + state + kv
        rooflines[model_name] = dict(
            params=sum(p.numel() for p in model.parameters()), active_params=active_params(model),
            weight_bytes=weights, state_bytes=state, kv_bytes=kv, context=ctx,
            roofline_ms_per_step=1e3 * total / bw, roofline_tokens_per_s=bw / total,
        )
    result.update(rooflines=rooflines, status="ok")
    return result


def _untied_input_embedding_bytes(model) -> int:
    """Bytes of the input embedding table where the LM head does not share it (a decode step reads
    one row of it per token, not the table); 0 when tied (the LM head reads all of it)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight is emb:
        return 0
    return emb.numel() * emb.element_size()


def _tap_logits(engine):
    """Last-position logits of every runner forward of ``engine`` (a list the caller reads)."""
    captured = []
    forward = engine.runner.forward

    def tapped(batch):
        out = forward(batch)
        captured.append(out.detach().float().cpu())
        return out

    engine.runner.forward = tapped
    return captured


def check_worker(spec, s: Settings, result, save) -> None:
    """Our prefill logits vs transformers' on the same weights: fp32 (tight) and bf16 (vs fp32);
    our greedy tokens vs transformers' ``generate`` (fp32 must be equal; bf16 is reported only:
    rounding may flip a near-tie of a random-weight model)."""
    import torch

    import hybrid_compile as hc

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = _load_model(spec, torch.float32)
    prompt = random_prompts(1, s.check_prompt, model.config.vocab_size, seed=300)[0]
    ids = torch.tensor([prompt], device=model.device)

    def hf_logits():
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits[0, -1].float().cpu()

    def hf_tokens():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHECK_NEW_TOKENS,
                                 min_new_tokens=CHECK_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    def ours():
        """(our prefill's last-position logits, our CHECK_NEW_TOKENS greedy tokens)."""
        engine = hc.wrap(model, compile=False, max_running_requests=1,
                         max_context_len=s.check_prompt + CHECK_NEW_TOKENS + 8, chunked_prefill_size=s.chunked_prefill)
        try:
            captured = _tap_logits(engine)
            engine.generate_batch([prompt], max_new_tokens=1, ignore_eos=True)
            logits = captured[-1][0]  # the one request's row (a padding row would come last)
            engine.clear_prefix_cache()  # the tokens from a cold prefill too
            tokens = engine.generate_batch([prompt], max_new_tokens=CHECK_NEW_TOKENS, ignore_eos=True)[0]
            return logits, list(tokens)
        finally:
            engine.close()

    def tokens_compare(ours_t, ref_t):
        first = next((i for i, (a, b) in enumerate(zip(ours_t, ref_t)) if a != b), None)
        return dict(ours=ours_t, hf=ref_t, equal=ours_t == ref_t, first_mismatch=first)

    def compare(ours, ref):
        scale = ref.abs().max().item()
        return dict(max_abs_diff=(ours - ref).abs().max().item(), max_abs_logit=scale,
                    rel_diff=(ours - ref).abs().max().item() / scale, top1_equal=bool(ours.argmax() == ref.argmax()))

    ref32, ref_tokens32 = hf_logits(), hf_tokens()
    ours32, our_tokens32 = ours()
    fp32 = compare(ours32, ref32)
    fp32.update(tolerance_rel=FP32_RTOL, passed=fp32["rel_diff"] <= FP32_RTOL)
    greedy32 = tokens_compare(our_tokens32, ref_tokens32)
    model.to(torch.bfloat16)
    hf16, hf_tokens16 = hf_logits(), hf_tokens()
    ours16, our_tokens16 = ours()
    hf_err, our_err = compare(hf16, ref32), compare(ours16, ref32)
    tol = BF16_FACTOR * hf_err["max_abs_diff"] + BF16_FLOOR * hf_err["max_abs_logit"]
    bf16 = dict(ours_vs_hf_bf16=compare(ours16, hf16), ours_vs_fp32=our_err, hf_bf16_vs_fp32=hf_err,
                tolerance=f"max|ours_bf16 - fp32| <= {BF16_FACTOR} x max|hf_bf16 - fp32| + {BF16_FLOOR} x max|logit|",
                tolerance_abs=tol, passed=our_err["max_abs_diff"] <= tol)
    result.update(prompt_tokens=len(prompt), fp32=fp32, bf16=bf16, new_tokens=CHECK_NEW_TOKENS,
                  greedy_fp32=greedy32, greedy_bf16=tokens_compare(our_tokens16, hf_tokens16),
                  passed=fp32["passed"] and bf16["passed"] and greedy32["equal"], status="ok")
    save()


# ---------------------------------------------------------------------------------------------
# parent side: runs every job in a subprocess, merges, prints, plots
# ---------------------------------------------------------------------------------------------

def missing_workloads(earlier: dict, system: str, wanted) -> list:
    """The workloads of ``wanted`` that ``system`` runs and ``earlier`` (its result from a previous
    call, or {}) has not measured successfully."""
    done = {w for w, res in earlier.get("workloads", {}).items() if res.get("status") != "error"}
    return [w for w in wanted if w != "check" and w in SYSTEM_WORKLOADS.get(system, WORKLOADS) and w not in done]


def merge_result(earlier: dict | None, new: dict) -> dict:
    """A system's result from this call on top of its result from an earlier call (``--resume``):
    workloads measured now replace theirs, the others stay; the status says whether anything failed."""
    if not earlier or new.get("status") in ("unsupported", "unavailable"):
        return new
    merged = dict(earlier, **{k: v for k, v in new.items() if k != "workloads"})
    merged["workloads"] = dict(earlier.get("workloads", {}), **new.get("workloads", {}))
    if merged["status"] == "ok" and any(res.get("status") == "error" for res in merged["workloads"].values()):
        merged["status"] = "partial"  # an earlier workload's error that this call did not redo
    merged["job_wall_s"] = earlier.get("job_wall_s", 0.0) + new.get("job_wall_s", 0.0)
    return merged


def run_job(spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="e2e_") as tmp:
        spec_path, result_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "result.json", "log.txt"))
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", spec_path, result_path]
        t = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        result = dict(system=spec["system"], model=spec["model"], status="crashed", workloads={})
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
        result["job_wall_s"] = time.perf_counter() - t
        if rc != 0:
            with open(log_path) as f:
                tail = f.read()[-4000:]
            result.update(status="crashed" if rc != "timeout" else "timeout", returncode=rc, log_tail=tail)
        return result


def default_out(device_name: str) -> str:
    slug = "".join(c if c.isalnum() else "_" for c in device_name.lower()).strip("_")[:40] or "device"
    return os.path.join(HERE, "results", f"e2e_{slug}_{datetime.date.today().isoformat()}.json")


def _fmt(v, spec="{:.1f}"):
    return "-" if v is None else spec.format(v)


def summary_rows(run: dict) -> list[dict]:
    """One row per (model, system) with the headline numbers."""
    rows = []
    bw_roof = run.get("env", {}).get("rooflines", {})
    for model, systems in run["results"].items():
        roof = bw_roof.get(model, {}).get("roofline_ms_per_step")
        for system, r in systems.items():
            w = r.get("workloads", {})
            dec = w.get("decode", {}).get("batches", {})
            pre = w.get("prefill", {}).get("lengths", {})
            b1 = dec.get("1", {}).get("ms_per_token")
            row = dict(model=model, system=system, status=r.get("status"), message=r.get("message"),
                       ms_token_b1=b1, roofline_fraction=(roof / b1) if (roof and b1) else None,
                       peak_gib=r.get("peak_memory_gib"))
            for b, d in dec.items():
                row[f"decode_b{b}"] = d.get("decode_tokens_per_s")
            for L, d in pre.items():
                row[f"prefill_{L}"] = d.get("tokens_per_s")
            for key in ("cb", "shared_prefix"):
                d = w.get(key, {})
                row[f"{key}_tok_s"] = d.get("output_tokens_per_s")
                row[f"{key}_ttft_mean"] = d.get("ttft_mean_s")
                row[f"{key}_ttft_p99"] = d.get("ttft_p99_s")
            errors = [k for k, d in w.items() if d.get("status") == "error"]
            errors += [f"{k} {item}" for k, d in w.items() for item, v in (d.get("batches") or d.get("lengths") or {}).items()
                       if v.get("status") == "error"]
            if errors:
                row["message"] = (row["message"] or "") + f" errors in: {', '.join(errors)}"
            rows.append(row)
    return rows


def print_table(run: dict) -> str:
    rows = summary_rows(run)
    cols = [k for k in rows[0] if k not in ("model", "system", "status", "message")] if rows else []
    cols = [c for c in cols if any(r.get(c) is not None for r in rows)]
    lines = []
    env = run.get("env", {})
    lines.append(f"device: {env.get('device')}  torch {env.get('torch')}  transformers {env.get('transformers')}  "
                 f"memory bandwidth {_fmt(env.get('copy_bandwidth_GBps'))} GB/s (best of copy / read)")
    for model, roof in env.get("rooflines", {}).items():
        active = roof.get("active_params", roof["params"])
        lines.append(f"{model}: {roof['params'] / 1e6:,.1f} M params"
                     + (f" ({active / 1e6:,.1f} M active)" if active != roof["params"] else "")
                     + ", decode roofline at batch 1 "
                     f"{roof['roofline_ms_per_step']:.3f} ms/step ({roof['roofline_tokens_per_s']:.0f} tok/s)")
    for model, c in run.get("checks", {}).items():
        if c.get("status") == "ok":
            greedy = c.get("greedy_fp32")  # (absent in JSON files from before the token check)
            tokens = "" if greedy is None else (
                f"; fp32 greedy tokens {'equal' if greedy['equal'] else 'differ at ' + str(greedy['first_mismatch'])}"
                f" ({len(greedy['hf'])}), bf16 {'equal' if c['greedy_bf16']['equal'] else 'differ'}")
            lines.append(f"{model} logits check: {'PASS' if c['passed'] else 'FAIL'} (fp32 rel diff "
                         f"{c['fp32']['rel_diff']:.2e} <= {c['fp32']['tolerance_rel']:.0e}; bf16 |ours-fp32| "
                         f"{c['bf16']['ours_vs_fp32']['max_abs_diff']:.3g} <= {c['bf16']['tolerance_abs']:.3g}{tokens})")
        else:
            lines.append(f"{model} logits check: {c.get('status')} {c.get('message') or c.get('log_tail', '')[-300:]}")
    head = ["model", "system"] + cols
    table = [head]
    for r in rows:
        if r["status"] not in ("ok", "partial"):
            table.append([r["model"], r["system"], f"{r['status']}: {(r.get('message') or '')[:100]}"])
            continue
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else (f"{v:.3f}" if ("ms" in c or "ttft" in c or "fraction" in c
                                                               or "gib" in c) else f"{v:.0f}"))
        table.append([r["model"], r["system"]] + cells)
    widths = [max(len(str(row[i])) for row in table if i < len(row) and len(row) == len(head)) for i in range(len(head))]
    for row in table:
        if len(row) != len(head):
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]}")
        else:
            lines.append("  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths)))
    lines.append("units: decode_bN / prefill_L / *_tok_s in tokens/s; ms_token_b1: ms per generated token of the "
                 "request; ttft s; peak_gib GiB")
    text = "\n".join(lines)
    print(text)
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma list of {ALL_MODELS} (default: {','.join(MODELS)}; see the module docstring)")
    p.add_argument("--model", default=None, help="a safetensors checkpoint directory instead of the reference models")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {WORKLOADS}")
    p.add_argument("--ours-base", default=None, choices=list(OURS_MODES)[:5],
                   help="the mode that ours_prefix_cache and ours_speculative add to (default: ours_cuda_graphs on "
                        "CUDA, ours_compiled on CPU, where CUDA graphs do not exist)")
    p.add_argument("--fla-path", default=None, help="folder with flash-linear-attention (or its .whl files) for hf_fla")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-fraction", type=float, default=0.5, help="EngineConfig.memory_fraction of our engine")
    p.add_argument("--quick", action="store_true", help="fewer new tokens and requests")
    p.add_argument("--tiny", action="store_true", help="toy-sized models and workloads (CPU smoke run)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per (model, system) subprocess")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_<device>_<date>.json)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="add to the JSON at --out: keep its finished jobs, run only the missing or failed ones")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, allowed in (("systems", SYSTEMS), ("workloads", WORKLOADS), ("models", ALL_MODELS)):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = sorted(set(values) - set(allowed))
        if bad:
            p.error(f"--{name}: unknown {', '.join(bad)}; choose from {', '.join(allowed)}")
        setattr(args, name, values)
    if args.model:
        args.models = [os.path.basename(os.path.normpath(args.model))]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return {}
    import torch
    from tqdm import tqdm

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    s = settings_for(args.tiny, args.quick)
    args.ours_base = args.ours_base or ("ours_cuda_graphs" if torch.device(device).type == "cuda" else "ours_compiled")
    base = dict(device=device, dtype=args.dtype, seed=args.seed, tiny=args.tiny, model_path=args.model,
                fla_path=args.fla_path, settings=dataclasses.asdict(s), ours_base=args.ours_base,
                memory_fraction=args.memory_fraction, threads=args.threads, models=args.models,
                workloads=args.workloads)
    run = dict(command=" ".join([os.path.basename(sys.executable), "benchmarks/e2e.py"] + list(argv or sys.argv[1:])),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               settings=dataclasses.asdict(s), tolerances=dict(fp32_rel=FP32_RTOL, bf16_factor=BF16_FACTOR,
                                                                bf16_floor=BF16_FLOOR),
               env={}, checks={}, results={m: {} for m in args.models})
    previous = {}
    if args.resume:
        if not args.out or not os.path.exists(args.out):
            raise SystemExit("--resume needs --out pointing at the JSON of an earlier run")
        with open(args.out) as f:
            previous = json.load(f)
        if previous.get("settings") != json.loads(json.dumps(run["settings"])):
            raise SystemExit(f"--resume: {args.out} was measured with other settings (--tiny / --quick differ)")
        run.update(env=previous.get("env", {}), checks=previous.get("checks", {}))
        for m, systems in previous.get("results", {}).items():
            run["results"].setdefault(m, {}).update(systems)
    if not run["env"] or run["env"].get("status") != "ok" or any(m not in run["env"].get("rooflines", {}) for m in args.models):
        # every model's roofline from this call's bandwidth (with --resume, the earlier models' too)
        env_models = list(dict.fromkeys(list(run["env"].get("rooflines", {})) + args.models))
        try:
            run["env"] = measure_env(dict(base, models=env_models), s)
        except Exception as e:  # noqa: BLE001 - the systems are still worth measuring
            run["env"] = dict(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
    out = args.out or default_out(run["env"].get("device") or device)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def save():
        with open(out, "w") as f:
            json.dump(run, f, indent=1, default=str)

    save()
    jobs = [(m, "check") for m in args.models if "check" in args.workloads]
    jobs += [(m, sysname) for m in args.models for sysname in args.systems]
    # with --resume, a finished check is kept, and a system runs only the workloads its earlier
    # result lacks (or that failed there); unsupported / unavailable systems stay as they were
    todo = {}
    for m, j in jobs:
        earlier = (run["checks"].get(m, {}) if j == "check" else run["results"][m].get(j, {})) if args.resume else {}
        if j == "check":
            todo[m, j] = [] if earlier.get("status") == "ok" else ["check"]
        elif earlier.get("status") in ("unsupported", "unavailable"):
            todo[m, j] = []
        else:
            todo[m, j] = missing_workloads(earlier, j, args.workloads)
    jobs = [job for job in jobs if todo[job]]
    import hybrid_compile as hc

    for model, system in tqdm(jobs, desc="e2e", unit="job"):
        tqdm.write(f"[e2e] {model} / {system}")
        r = None
        if system in OURS_MODES:  # a mode the engine does not support here needs no process
            try:
                cfg = hc.EngineConfig.from_args(**engine_config(base, s, system))
                # the device-dependent checks (wrap repeats them in the worker in any case)
                resolve_graphs = getattr(cfg, "resolved_cuda_graphs", None)
                if resolve_graphs is not None:
                    resolve_graphs(torch.device(device))
            except (NotImplementedError, ValueError) as e:
                r = dict(system=system, model=model, status="unsupported", message=f"{type(e).__name__}: {e}",
                         workloads={})
        if system == "check":
            run["checks"][model] = r or run_job(dict(base, system=system, model=model), args.timeout)
        else:
            r = r or run_job(dict(base, system=system, model=model, workloads=todo[model, system]), args.timeout)
            run["results"][model][system] = merge_result(run["results"][model].get(system), r)
        save()
    run["table"] = print_table(run)
    if not args.no_plots:
        sys.path.insert(0, HERE)
        from plots import make_plots

        run["plots"] = make_plots(run, os.path.splitext(out)[0])
        print(run["plots"].get("message") or "plots: " + ", ".join(run["plots"]["files"]))
    save()
    print(f"results: {out}")
    return run


if __name__ == "__main__":
    main()
