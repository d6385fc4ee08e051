"""Speculative decoding benchmark (issue 7): decode tokens/s and mean acceptance length against
non-speculative decode, in the same run, on the ~1.9 B random-weight Qwen3-Next reference.

    python benchmarks/speculative.py                     # reference model, bf16, CUDA
    python benchmarks/speculative.py --tiny --device cpu # CPU smoke run (toy model, eager)

Random weights make real drafts meaningless, so besides n-gram lookup and a small draft model
(a random 4-layer Qwen3-Next with the target's vocabulary, served by our engine machinery) the
benchmark uses a *replay draft* (``ReplayDraft``): the target's own greedy continuation of each
prompt, each draft token corrupted with probability q, which sets the acceptance rate (its cost
is that of n-gram lookup). The continuation must be the *speculative* engine's own greedy output:
in bf16 the verify path (extend attention over k + 1 tokens, the recurrent delta rule with
intermediate states) rounds differently from the decode path, and on a random-weight model
near-ties flip an argmax after a few dozen tokens, after which a continuation taken from the
baseline engine is wrong at every step. So per k and batch it is found by a fixed-point iteration
(``self_consistent_continuations``): start from the baseline's greedy output, run the speculative
engine with the replay draft at q = 0, take its output as the next continuation, until it stops
changing (``--replay-rounds`` at most; each round agrees with the previous one strictly further,
since the verify windows coincide up to the first disagreement). Reported per k and batch:
``replay_rounds``, ``replay_converged`` and ``replay_baseline_match`` (leading tokens of the
continuation equal to the baseline's greedy output: bf16 near-ties, not an error).

Per engine mode (``--modes``; eager / compiled / compiled + CUDA graphs) one baseline engine and
one speculative engine per number of draft tokens k (the draft source is swapped in place with
``engine.speculative.use_source``, so each k compiles once). For every batch size (1 and 8),
every k and every source (replay at each q, n-gram, draft model): the prompts are prefilled,
then the decode phase is timed (until every request has ``--new-tokens`` tokens, no EOS):
``tokens_per_s`` (tokens generated in the decode phase / its wall time), ``speedup`` against the
baseline at that batch size, ``mean_acceptance_length`` (tokens emitted per request per verify
step), ``acceptance_rate`` and ``match_tokens`` (how many leading tokens equal the baseline's
greedy output, mean over requests; bf16 near-ties may flip a token), ``replay_match_tokens`` (the
same against the replay continuation), ``phase_ms_per_verify`` (host ms of each part of a verify step, the decoder's ``PHASES``: the GPU's
time shows in the part that waits for it, ``accept``), and the decode phase's
CUDA-graph counters (``cuda_graph_replays`` of decode graphs, ``verify_graph_replays`` of the
full TARGET_VERIFY graphs, ``eager_fallbacks``: with ``--modes graphs`` every verify step of a
batch within the buckets replays a verify graph and, ``commit_graph_replays``, one commit graph), and
``tree_kv_moves`` (kept tokens whose K/V moved into their position: draft trees only).

MTP (``--sources`` with ``mtp``): the reference model gets a random MTP head
(``reference_models.save_random_mtp_head``: random weights, so its own drafts are rejected) and
per chain length k (``--mtp-draft-tokens``, default 1..4) one engine with
``speculative={"method": "mtp"}``. Rows: ``mtp`` (the head's own drafts: the cost of drafting at
acceptance length ~1) and ``mtp_accept<L>`` for each ``--accept-lengths`` L <= k + 1: the head runs
its whole proposal every step (its real cost; ``MTPCostReplay``) but the drafts are the replay
continuation with exactly the first L - 1 right, so every verify step emits L tokens. Each row
also reports ``draft_ms_per_verify`` (the head's proposal per verify step, as the host sees it:
with the proposal graphs the drafts stay on the device and the graph's GPU time is not waited
for, so it shows in tok/s, not here), ``head_forwards_per_verify``
and ``draft_ms_per_head_forward`` against ``decode_step_ms`` (one plain decode step at that batch,
from the baseline) as ``head_forward_vs_decode_step``. With the engine's full CUDA graphs every
proposal is one CUDA-graph replay (``EngineConfig.extra["mtp_draft_graphs"]``, on by default
there; the rows report ``mtp_graph_replays`` / ``mtp_graph_fallbacks``); ``--no-mtp-draft-graphs``
turns it off for the MTP engines (each head step run by the head's own runner).
``--mtp-token-map N``: per k a second MTP engine with ``draft_token_map`` (the head's LM head over
N ids only), so ``draft_ms_per_head_forward`` with the map stands beside the full head's (rows carry
``draft_token_map_size``, None for the full head). The map is the N lowest token ids, or with
``--mtp-token-map-seed S`` N random ids: the random weights have no token frequencies, so neither
is a real hot vocabulary (a real map: the N most frequent tokens of the target's outputs), and the
acceptance of the ``mtp`` rows means nothing here; the cost of a head forward does not depend on
which ids the map holds.
Draft trees (``--trees``, e.g. ``2x3x8,2x3x16,4x3x8,4x3x16``: top-k x depth x node budget): per
tree shape one engine with ``speculative={"method": "custom", "topk": k, "num_draft_tokens": depth,
"num_tree_nodes": budget}`` whose source is the replay draft's tree form
(``ReplayDraft.propose_tree``: each candidate in rank order is the continuation's token with
probability 1 - q, so rank r holds it with probability q^r (1 - q); ``topk = 1`` is the chain
replay at the same q), over the tree engine's own greedy continuation (the same fixed point).
Rows ``tree_replay_q<q>`` carry ``topk``, ``depth``, ``tree_nodes``; compare them with the chain
rows ``replay_q<q>`` at ``k = depth``. A budget over the full tree's size is skipped (printed).
Output: a printed table and
JSON (``--out``, default ``benchmarks/results/speculative_<device>.json``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hybrid_compile as hc  # noqa: E402
from hybrid_compile.engine.speculative import NgramDraft, ReplayDraft, build_draft_source  # noqa: E402
from hybrid_compile.engine.speculative.drafts import fill_drafts  # noqa: E402
from benchmarks.profiling import step_profile  # noqa: E402
from reference_models import build_qwen3_next_reference, save_random_mtp_head  # noqa: E402

MODES = {
    "eager": dict(compile=False),
    "compiled": dict(compile=True, cuda_graphs=False),
    "graphs": dict(compile=True, cuda_graphs=True),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def build_draft_model(target: torch.nn.Module, tiny: bool) -> torch.nn.Module:
    """A small random Qwen3-Next with the target's vocabulary (4 layers, hidden 256; toy sizes
    with ``tiny``), on the target's device and dtype."""
    cfg = copy.deepcopy(target.config)
    hidden = 32 if tiny else 256
    cfg.update(dict(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_only_layers=list(range(4)),
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=hidden // 4, linear_value_head_dim=hidden // 4,
    ))
    p = next(target.parameters())
    with torch.random.fork_rng(devices=[p.device] if p.device.type == "cuda" else []):
        torch.manual_seed(1)
        with torch.device(p.device):
            model = type(target)._from_config(cfg, dtype=p.dtype)
    return model.eval()


GRAPH_COUNTERS = ("cuda_graph_replays", "verify_graph_replays", "eager_fallbacks")


def _graph_counters(engine) -> dict:
    """The engine's CUDA-graph counters (zeros without compile): full decode / verify graph replays
    and steps no graph fitted."""
    c = engine.stats()["compile"]
    return {k: c.get(k, 0) for k in GRAPH_COUNTERS}


def run_decode(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Prefill ``prompts``, then time the decode phase; returns tokens/s, outputs, the
    speculative counters and the CUDA-graph counters of the decode phase."""
    params = hc.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.request(rid) for rid in rids]
    while any(not r.output for r in reqs):  # prefill (+ first token)
        engine.step()
    before = engine.stats().get("speculative", {})
    graphs_before = _graph_counters(engine)
    done = sum(len(r.output) for r in reqs)
    _sync(engine.device)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    after = engine.stats().get("speculative", {})
    graphs_after = _graph_counters(engine)
    outputs = [engine.pop_finished(rid).output for rid in rids]
    tokens = sum(len(o) for o in outputs) - done
    out = {"tokens_per_s": tokens / seconds, "decode_seconds": seconds, "decode_tokens": tokens}
    out.update({k: graphs_after[k] - graphs_before[k] for k in GRAPH_COUNTERS})
    if after:
        d = {k: after.get(k, 0) - before.get(k, 0) for k in ("verify_steps", "verified_requests", "drafted", "accepted",
                                                      "emitted", "draft_seconds", "commit_graph_replays",
                                                      "tree_kv_moves")}
        out.update(d)
        # host ms of each part of a verify step (the decoder's PHASES; the GPU's time lands in the part
        # that waits for it)
        phases_before, phases_after = before.get("phase_seconds", {}), after.get("phase_seconds", {})
        out["phase_ms_per_verify"] = {k: 1000.0 * (v - phases_before.get(k, 0.0)) / max(1, d["verify_steps"])
                                      for k, v in phases_after.items()}
        out["mean_acceptance_length"] = d["emitted"] / d["verified_requests"] if d["verified_requests"] else 0.0
        out["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
    out["outputs"] = outputs
    return out


def profile_row(engine, row: dict, prompts: list[list[int]], args, label: str) -> None:
    """With ``--profile-steps N``: N engine steps of ``prompts`` (the first batch size's; decode steps of
    the baseline, verify steps of a draft source) under torch.profiler, after the row's timed runs,
    into ``row["step_profile"]`` (``benchmarks/profiling.step_profile``: wall and GPU-busy ms per
    forward, the top kernels and host ops), so a verify step's kernels stand beside a decode step's;
    GPU-busy and the top kernels are printed."""
    if not args.profile_steps:
        return
    prof = row["step_profile"] = step_profile(engine, prompts, args.profile_steps, kernels_shown=15,
                                              max_new_tokens=args.new_tokens)
    busy = prof.get("gpu_busy_ms_per_step")
    print(f"      {label} profiled: wall {prof['wall_ms_per_step']:.2f} ms/forward"
          + (f", GPU busy {busy:.3f} ms/forward; top kernels:" if busy is not None else ""), flush=True)
    for k in prof.get("top_kernels", [])[:8]:
        print(f"        {k['ms_per_step']:7.3f} ms x{k['calls_per_step']:<5.1f} {k['name'][:90]}", flush=True)


def _graphs_note(r: dict) -> str:
    note = (f"graph replays decode {r['cuda_graph_replays']} verify {r['verify_graph_replays']} "
            f"fallbacks {r['eager_fallbacks']}")
    phases = r.get("phase_ms_per_verify")
    if phases:
        note += "\n      host ms / verify step: " + " ".join(f"{k} {v:.3f}" for k, v in phases.items())
    return note


def _match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class MTPCostReplay:
    """Replay drafts at a fixed acceptance length, with the MTP head's cost: every proposal runs
    the head's whole proposal (extend + chain; its drafts are dropped) and then proposes each
    request's continuation with its first ``accept`` tokens right and the rest wrong (``t + 1``),
    so a verify step over the engine's own greedy continuation emits ``accept + 1`` tokens. The
    head keeps seeing the target's hidden states (``observe``)."""

    def __init__(self, head, continuations: dict, accept: int, vocab: int) -> None:
        self.head, self.continuations, self.accept, self.vocab = head, continuations, accept, vocab

    @property
    def counters(self) -> dict:
        return self.head.counters

    def observe(self, batch, hidden) -> None:
        self.head.observe(batch, hidden)

    def release(self, rid: int) -> None:
        self.head.release(rid)

    def _rows(self, requests, k: int) -> list[list[int]]:
        out = []
        for r in requests:
            row = self.continuations.get(tuple(r.prompt), [])[len(r.output):len(r.output) + k]
            out.append([t if i < self.accept else (t + 1) % self.vocab for i, t in enumerate(row)])
        return out

    def propose(self, requests, k: int) -> list[list[int]]:
        self.head.propose(requests, k)
        return self._rows(requests, k)

    def propose_on_device(self, requests, k: int):
        """:meth:`propose` through the head's ``propose_on_device``: where the head's drafts stay on
        the device (no sync before the verify step), the replayed rows follow them there by an
        asynchronous copy, so the step costs what the head's own drafts cost."""
        drafts = self.head.propose_on_device(requests, k)
        rows = self._rows(requests, k)
        if not isinstance(drafts, torch.Tensor):
            return rows
        host = torch.tensor(fill_drafts(rows, requests, k, self.vocab), dtype=torch.int64)
        return (host.pin_memory() if drafts.is_cuda else host).to(drafts.device, non_blocking=True)


def self_consistent_continuations(engine, prompts: list[list[int]], start: list[list[int]], vocab: int,
                                  new_tokens: int, max_rounds: int, make_source=None) -> tuple[dict, dict]:
    """The speculative engine's own greedy continuations of ``prompts`` (module docstring):
    iterate "replay the continuation at q = 0, take the output" from ``start`` until the output
    equals the replayed continuation or ``max_rounds`` ran. ``make_source(continuations)``: the
    replay source (default ``ReplayDraft`` at q = 0; another one wraps the engine's own source,
    which then stays open). Returns ({tuple(prompt): continuation}, info: ``rounds``,
    ``converged``)."""
    current = [list(o) for o in start]
    make = make_source or (lambda conts: ReplayDraft(conts, 0.0, vocab))
    for rounds in range(1, max_rounds + 1):
        engine.speculative.use_source(make(dict(zip(map(tuple, prompts), current))), "replay_fixpoint",
                                      close_previous=make_source is None)
        outputs = run_decode(engine, prompts, new_tokens)["outputs"]
        converged = outputs == current
        current = outputs
        if converged:
            break
    return dict(zip(map(tuple, prompts), current)), {"rounds": rounds, "converged": converged}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="toy-size reference model (CPU smoke run)")
    ap.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)} (default: graphs on CUDA, eager on CPU)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--draft-tokens", default="2,3,4")
    ap.add_argument("--qs", default="0,0.1,0.2,0.4,0.7", help="replay corruption probabilities")
    ap.add_argument("--sources", default="replay,ngram,draft_model")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--trees", default="",
                    help="draft tree shapes topk x depth x nodes, comma list (e.g. 2x3x8,4x3x16); empty: none")
    ap.add_argument("--mtp-draft-tokens", default="1,2,3,4", help="MTP chain lengths k (sources with mtp)")
    ap.add_argument("--accept-lengths", default="2,3,4", help="MTP rows at these fixed acceptance lengths")
    ap.add_argument("--replay-rounds", type=int, default=8,
                    help="at most this many fixed-point rounds for the self-consistent replay continuation")
    ap.add_argument("--no-mtp-draft-graphs", action="store_true",
                    help='MTP engines with extra["mtp_draft_graphs"]=False: no proposal CUDA graphs (on by default with full graphs)')
    ap.add_argument("--mtp-token-map", type=int, default=0,
                    help="also run each MTP k with a draft token map of this many ids (0: only the full head)")
    ap.add_argument("--mtp-token-map-seed", type=int, default=None,
                    help="the map's ids drawn at random with this seed (default: the N lowest ids)")
    ap.add_argument("--extra", type=json.loads, default={},
                    help='JSON merged into EngineConfig.extra of every engine, e.g. \'{"speculative_commit_graphs": false}\'')
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many steps of every row's first batch size after its timed runs (step_profile)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mtp_token_map_seed is not None and not args.mtp_token_map:
        ap.error("--mtp-token-map-seed needs --mtp-token-map N (the map's size)")
    if args.profile_steps < 0:
        ap.error(f"--profile-steps must be >= 0 (0: no profile), got {args.profile_steps}")

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    modes = (args.modes or ("graphs" if device.type == "cuda" else "eager")).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.draft_tokens.split(",")]
    qs = [float(q) for q in args.qs.split(",")]
    sources = args.sources.split(",")
    trees = [tuple(int(x) for x in t.split("x")) for t in args.trees.split(",") if t]
    if args.tiny:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 32), min(args.new_tokens, 16)
    model = build_qwen3_next_reference(dtype, device, seed=0, tiny=args.tiny)
    vocab = model.config.vocab_size
    draft_model = build_draft_model(model, args.tiny) if "draft_model" in sources else None
    max_bs = max(batches)
    engine_kw = dict(
        max_running_requests=max_bs, chunked_prefill_size=max(512, max_bs * args.prompt_len),
        max_total_tokens=max_bs * (args.prompt_len + args.new_tokens + max(ks + [n for _, _, n in trees]) + 8) + 64,
        mamba_cache_size=max_bs + 2, enable_prefix_cache=False, extra=dict(args.extra),
    )
    prompts = {b: _prompts(b, args.prompt_len, vocab, seed=100 + b) for b in batches}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "tiny": args.tiny, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "engine": dict(engine_kw), "modes": {},
    }
    out_path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"speculative_{'tiny_' if args.tiny else ''}{device.type}.json")

    if "mtp" in sources:
        import tempfile

        args.mtp_dir = save_random_mtp_head(model, tempfile.mkdtemp(prefix="mtp_head_"))
        args.mtp_map = mtp_token_map(args.mtp_token_map, vocab, args.mtp_token_map_seed)
    for mode in modes:
        print(f"== {mode}", flush=True)
        res = result["modes"][mode] = {"baseline": {}, "speculative": []}
        engine = hc.wrap(model, **MODES[mode], **engine_kw)
        run_decode(engine, prompts[batches[0]][:1], 4)  # warm-up
        greedy = {}
        for b in batches:
            r = run_decode(engine, prompts[b], args.new_tokens)
            greedy[b] = r.pop("outputs")
            res["baseline"][str(b)] = r
            print(f"   baseline b={b}: {r['tokens_per_s']:.1f} tok/s  {_graphs_note(r)}", flush=True)
        profile_row(engine, res["baseline"][str(batches[0])], prompts[batches[0]], args, f"baseline b={batches[0]}")
        engine.close()
        del engine
        gc.collect()
        for k in (ks if set(sources) & {"replay", "ngram", "draft_model"} else []):
            spec = hc.SpeculativeConfig(method="ngram", num_draft_tokens=k)
            engine = hc.wrap(model, **MODES[mode], **engine_kw, speculative=spec)
            run_decode(engine, prompts[batches[0]][:1], 2 * k + 2)  # warm-up: compile the verify shapes
            # the replay continuation of every prompt: this engine's own greedy output (fixed point)
            continuations, replay_info = {}, {}
            if "replay" in sources:
                for b in batches:
                    conts, info = self_consistent_continuations(engine, prompts[b], greedy[b], vocab,
                                                                args.new_tokens, args.replay_rounds)
                    continuations.update(conts)
                    info["baseline_match"] = sum(_match(conts[tuple(p)], g) for p, g in zip(prompts[b], greedy[b])) / b
                    replay_info[b] = info
                    res.setdefault("replay_continuations", []).append(dict(k=k, batch=b, **info))
                    print(f"   k={k} replay continuation b={b}: {info['rounds']} round(s), "
                          f"{'converged' if info['converged'] else 'NOT converged'}, "
                          f"{info['baseline_match']:.0f} leading tokens equal the baseline's greedy", flush=True)
            plan = [(f"replay_q{q}", lambda q=q: ReplayDraft(continuations, q, vocab, seed=7)) for q in qs
                    if "replay" in sources]
            if "ngram" in sources:
                plan.append(("ngram", lambda: NgramDraft()))
            if "draft_model" in sources:
                dm = hc.SpeculativeConfig(method="draft_model", draft_model=draft_model, num_draft_tokens=k)
                plan.append(("draft_model", lambda dm=dm, engine=engine: build_draft_source(dm, engine)))
            for name, make in plan:
                engine.speculative.use_source(make(), name)
                if name == "draft_model":
                    run_decode(engine, prompts[batches[0]][:1], 2 * k + 2)  # warm-up of the draft runner
                for b in batches:
                    r = run_decode(engine, prompts[b], args.new_tokens)
                    outputs = r.pop("outputs")
                    r.update(source=name, k=k, batch=b)
                    r["speedup"] = r["tokens_per_s"] / res["baseline"][str(b)]["tokens_per_s"]
                    r["match_tokens"] = sum(_match(o, g) for o, g in zip(outputs, greedy[b])) / b
                    if name.startswith("replay"):
                        r["replay_match_tokens"] = sum(_match(o, continuations[tuple(p)])
                                                       for o, p in zip(outputs, prompts[b])) / b
                        r.update({f"replay_{key}": v for key, v in replay_info[b].items()})
                    res["speculative"].append(r)
                    print(f"   k={k} {name:>14} b={b}: {r['tokens_per_s']:8.1f} tok/s  x{r['speedup']:.2f}  "
                          f"accept len {r['mean_acceptance_length']:.2f}  match {r['match_tokens']:.0f}  {_graphs_note(r)}",
                          flush=True)
                    if b == batches[0]:
                        first = r
                profile_row(engine, first, prompts[batches[0]], args, f"k={k} {name} b={batches[0]}")
            engine.close()
            del engine
            gc.collect()
        if "mtp" in sources:
            res["mtp"] = run_mtp(model, mode, engine_kw, prompts, greedy, res["baseline"], vocab, args)
        if trees:
            res["trees"] = run_trees(model, mode, engine_kw, prompts, greedy, res["baseline"], vocab, trees, qs, args)

    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {out_path}")


def run_trees(model, mode: str, engine_kw: dict, prompts: dict, greedy: dict, baseline: dict, vocab: int,
              trees: list[tuple[int, int, int]], qs: list[float], args) -> list:
    """The draft-tree rows of one engine mode (module docstring)."""
    rows = []
    batches = sorted(prompts)
    for topk, depth, nodes in trees:
        spec = hc.SpeculativeConfig(method="custom", draft_source=ReplayDraft({}, 0.0, vocab), num_draft_tokens=depth,
                                    topk=topk)
        if not depth <= nodes <= spec.max_tree_nodes():
            print(f"   tree {topk}x{depth}x{nodes}: skipped (a tree of depth {depth} and top-k {topk} holds "
                  f"{spec.max_tree_nodes()} nodes)", flush=True)
            continue
        spec.num_tree_nodes = nodes
        engine = hc.wrap(model, **MODES[mode], **engine_kw, speculative=spec)
        run_decode(engine, prompts[batches[0]][:1], 2 * depth + 2)  # warm-up: compile the verify shapes
        continuations = {}
        for b in batches:
            conts, info = self_consistent_continuations(engine, prompts[b], greedy[b], vocab, args.new_tokens,
                                                        args.replay_rounds)
            continuations.update(conts)
            print(f"   tree {topk}x{depth}x{nodes} replay continuation b={b}: {info['rounds']} round(s), "
                  f"{'converged' if info['converged'] else 'NOT converged'}", flush=True)
        for q in qs:
            name = f"tree_replay_q{q}"
            engine.speculative.use_source(ReplayDraft(continuations, q, vocab, seed=7), name)
            for b in batches:
                r = run_decode(engine, prompts[b], args.new_tokens)
                outputs = r.pop("outputs")
                r.update(source=name, topk=topk, depth=depth, tree_nodes=nodes, k=depth, batch=b,
                         speedup=r["tokens_per_s"] / baseline[str(b)]["tokens_per_s"],
                         replay_match_tokens=sum(_match(o, continuations[tuple(p)])
                                                 for o, p in zip(outputs, prompts[b])) / b)
                rows.append(r)
                print(f"   tree {topk}x{depth}x{nodes} {name:>16} b={b}: {r['tokens_per_s']:8.1f} tok/s  "
                      f"x{r['speedup']:.2f}  accept len {r['mean_acceptance_length']:.2f}  {_graphs_note(r)}",
                      flush=True)
                if b == batches[0]:
                    first = r
            profile_row(engine, first, prompts[batches[0]], args, f"tree {topk}x{depth}x{nodes} {name} b={batches[0]}")
        engine.close()
        del engine
        gc.collect()
    return rows


def mtp_token_map(size: int, vocab: int, seed: int | None) -> list[int] | None:
    """``--mtp-token-map``'s map (module docstring): the ``size`` lowest ids, or ``size`` random ids
    drawn with ``seed``; None for size 0."""
    if size == 0:
        return None
    if not 0 < size <= vocab:
        raise SystemExit(f"--mtp-token-map must be in 1..{vocab} (the vocabulary), got {size}")
    if seed is None:
        return list(range(size))
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].tolist()


def run_mtp(model, mode: str, engine_kw: dict, prompts: dict, greedy: dict, baseline: dict, vocab: int, args) -> list:
    """The MTP rows of one engine mode (module docstring)."""
    rows = []
    batches = sorted(prompts)
    maps = [None] if args.mtp_map is None else [None, args.mtp_map]  # (the full head, then the map's)
    for k, draft_map in [(k, m) for k in (int(x) for x in args.mtp_draft_tokens.split(",")) for m in maps]:
        spec = hc.SpeculativeConfig(method="mtp", num_draft_tokens=k, mtp_checkpoint=args.mtp_dir,
                                    draft_token_map=draft_map)
        map_size = None if draft_map is None else len(draft_map)
        label = f"k={k}" + (f" map={map_size}" if map_size else "")
        kw = dict(engine_kw)
        if args.no_mtp_draft_graphs:
            kw["extra"] = {**engine_kw["extra"], "mtp_draft_graphs": False}
        engine = hc.wrap(model, **MODES[mode], **kw, speculative=spec)
        head = engine.speculative.source
        run_decode(engine, prompts[batches[0]][:1], 2 * k + 2)  # warm-up: compile the verify and head shapes
        continuations = {}
        for b in batches:
            conts, info = self_consistent_continuations(
                engine, prompts[b], greedy[b], vocab, args.new_tokens, args.replay_rounds,
                make_source=lambda c, k=k: MTPCostReplay(head, c, k, vocab))
            continuations.update(conts)
            print(f"   mtp {label} replay continuation b={b}: {info['rounds']} round(s), "
                  f"{'converged' if info['converged'] else 'NOT converged'}", flush=True)
        plan = [("mtp", head)] + [(f"mtp_accept{length}", MTPCostReplay(head, continuations, length - 1, vocab))
                                  for length in (int(x) for x in args.accept_lengths.split(",")) if length <= k + 1]
        for name, source in plan:
            engine.speculative.use_source(source, name, close_previous=False)
            for b in batches:
                before = dict(head.counters)
                r = run_decode(engine, prompts[b], args.new_tokens)
                r.pop("outputs")
                forwards = sum(head.counters[c] - before[c] for c in ("head_extend_steps", "head_decode_steps"))
                verifies = max(1, r["verify_steps"])
                decode_ms = 1000.0 * b / baseline[str(b)]["tokens_per_s"]
                r.update({c: head.counters[c] - before[c] for c in ("mtp_graph_replays", "mtp_graph_fallbacks")})
                r.update(source=name, k=k, batch=b, draft_token_map_size=map_size,
                         speedup=r["tokens_per_s"] / baseline[str(b)]["tokens_per_s"],
                         draft_ms_per_verify=1000.0 * r["draft_seconds"] / verifies,
                         head_forwards_per_verify=forwards / verifies,
                         draft_ms_per_head_forward=1000.0 * r["draft_seconds"] / max(1, forwards),
                         decode_step_ms=decode_ms)
                r["head_forward_vs_decode_step"] = r["draft_ms_per_head_forward"] / decode_ms
                rows.append(r)
                print(f"   mtp {label} {name:>12} b={b}: {r['tokens_per_s']:8.1f} tok/s  x{r['speedup']:.2f}  accept len "
                      f"{r['mean_acceptance_length']:.2f}  head fwd {r['draft_ms_per_head_forward']:.2f} ms "
                      f"({100 * r['head_forward_vs_decode_step']:.0f}% of a decode step)  {_graphs_note(r)}  proposal graphs "
                      f"{r['mtp_graph_replays']} fallbacks {r['mtp_graph_fallbacks']}", flush=True)
                if b == batches[0]:
                    first = r
            profile_row(engine, first, prompts[batches[0]], args, f"mtp {label} {name} b={batches[0]}")
        engine.speculative.use_source(head, "mtp", close_previous=False)  # (engine.close closes the head)
        engine.close()
        del engine
        gc.collect()
    return rows


if __name__ == "__main__":
    main()
