"""The prefix cache (``EngineConfig.enable_prefix_cache``, on by default) wired into the engine.

Finished requests leave their KV and final recurrent state in the :class:`HybridRadixCache`;
prefills checkpoint their state at chunk-aligned lengths (every ``mamba_align`` tokens of an
extend: the GDN chunk of 64, the Mamba2 ``chunk_size``; with the ``marconi`` policy only at
branch points), tracked by the layer ops inside the extend or forked at its end, and hand them
to the tree while the request still runs. A later request starts from its longest cached
prefix with a state (copy-on-write). Every output must equal HF greedy generate on the same
weights (and the engine with the cache off), and after ``clear_prefix_cache()`` every pool slot
is free.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import mamba2_models as mm
from engine_models import (
    assert_greedy_equal,
    cached_model,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    record_prefix_hits,
    single_threaded,
    vocab_size,
)

MODELS = ("qwen3_next_dense", "qwen3_next_moe", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "bamba")
MAX_NEW = 8


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@functools.lru_cache(maxsize=None)
def _model(name: str):
    if name == "bamba":
        return mm.build_bamba(4)
    return cached_model(name, 0)


def _hf(name, prompt, max_new=MAX_NEW):
    return hf_greedy_cached(_model(name), ("prefix-cache", name), prompt, max_new)


def _engine(name, **kw):
    args = dict(enable_prefix_cache=True, max_running_requests=3, mamba_cache_size=15, chunked_prefill_size=32)
    args.update(kw)
    return make_engine(_model(name), **args)


def _check(name, prompts, outputs, max_new=MAX_NEW):
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        assert_greedy_equal(_model(name), p, o, _hf(name, p, max_new), what=f"{name} prompt {i}")


def _clear_and_check_free(engine):
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    assert engine.stats()["prefix_cache"]["cached_tokens"] == 0
    engine.close()


@pytest.mark.parametrize("name", MODELS)
def test_extension_of_finished_request_hits(name):
    vocab = vocab_size(_model(name))
    p, extra = random_prompts([40, 10], vocab, seed=1)
    engine = _engine(name)
    out = engine.generate_batch([p], max_new_tokens=MAX_NEW)[0]
    _check(name, [p], [out])
    stats = engine.stats()["prefix_cache"]
    # the finish-time state; bamba (chunk_size 16) also checkpointed its first prefill chunk (32)
    assert stats["hits"] == 0 and stats["cached_tokens"] == len(p) + MAX_NEW - 1
    assert stats["mamba_slots"] == (2 if name == "bamba" else 1)
    q = p + out + extra
    out2 = engine.generate_batch([q], max_new_tokens=MAX_NEW)[0]
    _check(name, [q], [out2])
    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] == 1 and stats["hit_tokens"] == len(p) + MAX_NEW - 1 and stats["mamba_hits"] == 1
    # the request slots / running states are back; only the tree holds slots
    used = engine.pools.used_counts()
    assert used["request_slots"] == 0 and used["mamba_slots"] == stats["mamba_slots"]
    _clear_and_check_free(engine)


@pytest.mark.parametrize("name", MODELS)
def test_batch_with_shared_prefixes(name):
    vocab = vocab_size(_model(name))
    base, a, b, c, d, e, f = random_prompts([70, 10, 15, 5, 20, 3, 3], vocab, seed=2)
    p0, p1 = base + a, base + b
    p3 = p0 + _hf(name, p0) + c
    p4 = p1 + _hf(name, p1) + d
    p5 = p3 + _hf(name, p3) + e
    prompts = [p0, p1, list(p0), p3, p4, p5, list(p4), base + f]
    engine = _engine(name)
    outputs = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    _check(name, prompts, outputs)
    stats = engine.stats()["prefix_cache"]
    assert stats["hits"] > 0 and stats["hit_tokens"] > 0
    _clear_and_check_free(engine)


@pytest.mark.parametrize("name", ("qwen3_next_dense", "bamba"))
def test_kv_pressure_evicts_before_retracting(name):
    vocab = vocab_size(_model(name))
    fill = random_prompts([60, 61, 62], vocab, seed=3)
    engine = _engine(name, max_total_tokens=400, max_running_requests=3)
    for p in fill:  # one at a time: ~200 tokens end up cached
        _check(name, [p], engine.generate_batch([p], max_new_tokens=MAX_NEW))
    cached = engine.stats()["prefix_cache"]["cached_tokens"]
    assert cached == sum(len(p) + MAX_NEW - 1 for p in fill)
    # three requests of 106 tokens each do not fit next to the cache: it must give way
    batch = random_prompts([90, 91, 89], vocab, seed=4)
    outputs = engine.generate_batch(batch, max_new_tokens=16)
    _check(name, batch, outputs, max_new=16)
    stats = engine.stats()
    assert stats["prefix_cache"]["kv_evicted_tokens"] > 0
    assert stats["retractions"] == 0
    # more than fits even with an empty cache: retraction still works with the cache on
    more = random_prompts([100, 101, 99], vocab, seed=5)
    outputs = engine.generate_batch(more, max_new_tokens=60)
    _check(name, more, outputs, max_new=60)
    assert engine.stats()["retractions"] > 0
    _clear_and_check_free(engine)


@pytest.mark.parametrize("name", ("qwen3_next_dense", "bamba"))
def test_page_size_4_hits_at_page_aligned_lengths(name):
    vocab = vocab_size(_model(name))
    p, r, extra = random_prompts([37, 38, 6], vocab, seed=6)  # 37 + 8 - 1 = 44 (aligned); 38 + 7 = 45 (not)
    engine = _engine(name, page_size=4)
    out_p, out_r = engine.generate_batch([p, r], max_new_tokens=MAX_NEW)
    _check(name, [p, r], [out_p, out_r])
    stats = engine.stats()["prefix_cache"]
    assert stats["cached_tokens"] == 44 + (32 if name == "bamba" else 0)  # bamba: r's chunk checkpoint at 32
    hits = record_prefix_hits(engine)
    q, s = p + out_p + extra, r + out_r + extra
    outputs = engine.generate_batch([q, s], max_new_tokens=MAX_NEW)
    _check(name, [q, s], outputs)
    # q hits p's finish-time state at 44; s's finish length 45 is no page end: at most its
    # page-aligned chunk checkpoint
    assert hits == [44, 32 if name == "bamba" else 0]
    _clear_and_check_free(engine)


def test_close_resets_the_cache():
    engine = _engine("qwen3_next_dense")
    p = random_prompts([20], vocab_size(_model("qwen3_next_dense")), seed=7)[0]
    engine.generate_batch([p], max_new_tokens=4)
    assert engine.stats()["prefix_cache"]["cached_tokens"] > 0
    engine.close()
    engine.pools.check_all_free()


def test_prefix_cache_on_by_default_and_can_be_turned_off():
    import hybrid_compile as hc

    assert hc.EngineConfig().enable_prefix_cache is True
    assert hc.EngineConfig().prefix_cache_policy == "lru"
    with pytest.raises(ValueError, match="prefix_cache_policy"):
        hc.EngineConfig.from_args(prefix_cache_policy="fifo")
    engine = make_engine(_model("qwen3_next_dense"))
    assert engine.prefix_cache is not None and engine.prefix_cache.mamba_align == 64
    engine.close()
    engine = make_engine(_model("qwen3_next_dense"), enable_prefix_cache=False)
    assert engine.prefix_cache is None and "prefix_cache" not in engine.stats()
    engine.clear_prefix_cache()  # no-op
    engine.close()


def _shared_prefix_workload(vocab: int) -> list[list[int]]:
    """SGLang's generated-shared-prefix shape, tiny: 3 groups, each a system prompt of 150-200
    tokens (> 2 GDN chunks) + questions of varied lengths, interleaved, some repeated."""
    systems = random_prompts([150, 200, 170], vocab, seed=20)
    questions = random_prompts([5, 30, 17, 41, 9, 64, 22, 3, 70], vocab, seed=21)
    prompts = [systems[i % 3] + q for i, q in enumerate(questions)]
    return prompts + [list(prompts[0]), list(prompts[4]), list(prompts[8])]


@pytest.mark.parametrize("policy", ["lru", "marconi"])
def test_shared_prefix_workload_under_memory_pressure(policy):
    """Cache on (small KV and Mamba pools: both evictions happen) gives the same greedy tokens as
    the cache off and as HF; hits land on chunk-aligned prefixes (multiples of 64 that are no
    finished request's length); nothing leaks."""
    name = "qwen3_next_dense"
    prompts = _shared_prefix_workload(vocab_size(_model(name)))
    args = dict(max_running_requests=3, max_total_tokens=700, mamba_cache_size=10, chunked_prefill_size=100)
    off = make_engine(_model(name), enable_prefix_cache=False, **args)
    outputs_off = off.generate_batch(prompts, max_new_tokens=MAX_NEW)
    off.pools.check_all_free()
    off.close()
    engine = make_engine(_model(name), enable_prefix_cache=True, prefix_cache_policy=policy, **args)
    hits = record_prefix_hits(engine)
    outputs = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
    assert outputs == outputs_off
    _check(name, prompts, outputs)
    stats = engine.stats()["prefix_cache"]
    finished_lens = {len(p) + MAX_NEW - 1 for p in prompts}
    aligned = [h for h in hits if h and h % 64 == 0 and h not in finished_lens]
    assert len(aligned) >= 3, hits
    assert 0 < stats["mamba_hits"] <= sum(1 for h in hits if h)  # a waiting request may match again
    assert stats["kv_evicted_tokens"] > 0, stats
    assert stats["policy"] == policy and 0 < stats["token_hit_rate"] < 1
    assert stats["admitted_requests"] == len(prompts) + engine.stats()["retractions"]
    assert stats["memory_bytes"] == stats["kv_bytes"] + stats["mamba_bytes"] > 0
    assert stats["tombstones"] >= 0 and stats["tombstones_created"] >= 0 and stats["mamba_hits"] > 0
    if policy == "lru":  # marconi admits few states (branch points): they fit without Mamba eviction
        assert stats["mamba_evicted"] > 0, stats
        assert stats["checkpoints_tracked"] > 0 and stats["checkpoints_forked"] > 0, stats
    _clear_and_check_free(engine)


def _run_to_completion(engine, prompts, max_new=MAX_NEW) -> tuple[list[list[int]], list[int]]:
    """Submit every prompt at once, step until done; (outputs, rids running after the first step)."""
    import hybrid_compile as hc

    params = hc.SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    first_step = sorted(r.rid for r in engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(rid).output for rid in rids], [rids.index(rid) for rid in first_step]


@pytest.mark.parametrize("policy", ["lru", "marconi"])
@pytest.mark.parametrize("hold", [True, False])
def test_siblings_submitted_together_wait_for_the_shared_prefix(policy, hold):
    """Three prompts sharing a 200-token system prompt arrive in one step with an empty cache (no
    branch point in the tree yet): the first one is admitted and checkpoints its state at the last
    chunk boundary of the shared part (192 = 3 x 64); its siblings wait one step and start there
    (an unrelated prompt behind them is admitted at once). Without the hold they recompute it."""
    name = "qwen3_next_dense"
    system, other = random_prompts([200, 150], vocab_size(_model(name)), seed=40)
    q = random_prompts([10, 20, 30, 12], vocab_size(_model(name)), seed=41)
    prompts = [system + q[0], system + q[1], other + q[3], system + q[2]]
    engine = _engine(name, prefix_cache_policy=policy, max_running_requests=4, chunked_prefill_size=1024)
    if not hold:
        engine.scheduler._wait_for_shared_prefix = lambda request, prefix: False
    hits = record_prefix_hits(engine)
    outputs, first_step = _run_to_completion(engine, prompts)
    _check(name, prompts, outputs)
    stats = engine.stats()["prefix_cache"]
    if hold:
        assert first_step == [0, 2]
        assert stats["admissions_held"] == 2
        assert sorted(h for h in hits if h) == [192, 192], hits
        assert stats["admitted_hit_tokens"] == 2 * 192 and stats["checkpoints_tracked"] >= 1
    else:
        assert first_step == [0, 1, 2, 3]
        assert stats["admissions_held"] == 0 and stats["admitted_hit_tokens"] == 0
    _clear_and_check_free(engine)


def test_common_prefix_len_matches_brute_force():
    import random

    from hybrid_compile.engine.scheduler import common_prefix_len

    rng = random.Random(0)
    for _ in range(500):
        a, b = ([rng.randint(0, 2) for _ in range(rng.randint(0, 12))] for _ in range(2))
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == expected, (a, b)


def test_hold_skips_prefixes_already_cached():
    """A prompt whose shared prefix is already cached (as far as a running request could add) is
    admitted at once: no hold for a gain under one chunk."""
    name = "qwen3_next_dense"
    system, q0, q1, q2 = random_prompts([200, 10, 20, 30], vocab_size(_model(name)), seed=42)
    engine = _engine(name, max_running_requests=4, chunked_prefill_size=1024)
    first, _ = _run_to_completion(engine, [system + q0])
    hits = record_prefix_hits(engine)
    outputs, first_step = _run_to_completion(engine, [system + q1, system + q2])
    _check(name, [system + q0, system + q1, system + q2], first + outputs)
    assert first_step == [0, 1] and engine.stats()["prefix_cache"]["admissions_held"] == 0
    assert hits == [192, 192]  # lru: the first prompt's prefill checkpointed the last chunk boundary
    _clear_and_check_free(engine)


# ----------------------------------------------------------------------------------------
# layer ops: checkpoints tracked inside an extend == the state after a truncated extend
# ----------------------------------------------------------------------------------------
def _extend_metadata(lens, slots, has_initial, track_slots=None, track_lens=None, device="cpu"):
    from hybrid_compile.layers.context import ForwardMetadata, ForwardMode

    lens_t = torch.tensor(lens)
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens_t, 0)
    md = ForwardMetadata(
        mode=ForwardMode.EXTEND, positions=torch.cat([torch.arange(n) for n in lens]), query_start_loc=qsl,
        seq_lens=lens_t.int(), prefix_lens=torch.zeros(len(lens), dtype=torch.int32),
        mamba_cache_indices=torch.tensor(slots, dtype=torch.int32), has_initial_state=torch.tensor(has_initial),
        out_cache_loc=torch.zeros(0, dtype=torch.int64), kv_indptr=torch.zeros(len(lens) + 1, dtype=torch.int32),
        kv_indices=torch.zeros(0, dtype=torch.int64), logits_indices=qsl[1:].long() - 1,
        prompt_lens=lens_t.int(),
    )
    if track_slots is not None:
        md.track_slots = torch.tensor(track_slots, dtype=torch.int32)
        md.track_lens = torch.tensor(track_lens, dtype=torch.int32)
        md.has_tracking = True
    moved = {f: getattr(md, f).to(device) for f in md.__dataclass_fields__ if isinstance(getattr(md, f), torch.Tensor)}
    return dataclasses.replace(md, **moved)


def _gdn_case(g, device):
    hk, dk, hv, dv, w = 2, 8, 4, 8, 4
    dim = 2 * hk * dk + hv * dv
    weights = (torch.randn(dim, w, generator=g) * 0.3, torch.randn(dim, generator=g) * 0.1,
               torch.randn(hv, generator=g) * 0.5, torch.randn(hv, generator=g) * 0.5)
    weights = tuple(t.to(device) for t in weights)

    def run(x, md):
        a, b = x[:, dim: dim + hv], x[:, dim + hv:]
        conv_w, conv_b, A_log, dt_bias = weights
        return torch.ops.hybrid_compile.gdn_layer(x[:, :dim].contiguous(), a.contiguous(), b.contiguous(), conv_w,
                                                  conv_b, A_log, dt_bias, 0, hk, dk, hv, dv, "silu")

    return dim + 2 * hv, (w - 1, dim), (hv, dk, dv), 64, run


def _mamba2_case(g, device):
    h, p, ng, n, w, chunk = 4, 8, 2, 8, 4, 16
    dim = h * p + 2 * ng * n
    weights = (torch.randn(dim, w, generator=g) * 0.3, torch.randn(dim, generator=g) * 0.1,
               torch.randn(h, generator=g) * 0.5, torch.randn(h, generator=g), torch.randn(h, generator=g) * 0.5)
    weights = tuple(t.to(device) for t in weights)

    def run(x, md):
        conv_w, conv_b, A_log, D, dt_bias = weights
        return torch.ops.hybrid_compile.mamba2_layer(x[:, :dim].contiguous(), x[:, dim:].contiguous(), conv_w, conv_b,
                                                     A_log, D, dt_bias, 0, h, p, ng, n, "silu", chunk, 0.0,
                                                     float("inf"), False)

    return dim + h, (w - 1, dim), (h, p, n), chunk, run


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.smoke])])
@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_layer_op_tracks_chunk_aligned_checkpoints(kind, device):
    """An EXTEND of three requests (one continuing from a state) with checkpoints at whole chunks
    of two of them: the tracked slots hold exactly the conv window and SSM state that an extend
    of only the tokens before the checkpoint leaves; outputs and final states are unchanged
    (CPU ops; the Triton kernels on CUDA)."""
    from hybrid_compile.layers.context import ForwardContext, forward_context

    g = torch.Generator().manual_seed(0)
    width, conv_shape, state_shape, chunk, run = (_gdn_case if kind == "gdn" else _mamba2_case)(g, device)
    lens, track = [150, 70, 30], [2 * chunk, chunk, -1]
    xs = [torch.randn(n, width, generator=g).to(device) for n in lens]
    init_conv, init_ssm = torch.randn(1, *conv_shape, generator=g), torch.randn(1, *state_shape, generator=g)

    def pools():
        conv, ssm = torch.zeros(8, *conv_shape, device=device), torch.zeros(8, *state_shape, device=device)
        conv[0], ssm[0] = init_conv[0], init_ssm[0]  # request 0 continues from slot 0
        return {0: (conv, ssm)}

    def forward(parts, md, caches):
        with torch.no_grad(), forward_context(ForwardContext(md, {}, caches)):
            return run(torch.cat(parts), md)

    tracked = pools()
    md = _extend_metadata(lens, [0, 1, 2], [True, False, False], [4, 5, -1], track, device=device)
    out = forward(xs, md, tracked)
    plain = pools()
    md = _extend_metadata(lens, [0, 1, 2], [True, False, False], device=device)
    torch.testing.assert_close(out, forward(xs, md, plain))
    for i in range(3):  # the requests' own slots are as without tracking
        for t, p in zip(tracked[0], plain[0]):
            torch.testing.assert_close(t[i], p[i])
    # the oracle: extends of the first track[i] tokens only
    short = pools()
    forward([xs[0][: track[0]], xs[1][: track[1]]], _extend_metadata(track[:2], [0, 1], [True, False], device=device),
            short)
    tol = 1e-5 if device == "cpu" else 2e-3  # the Triton kernels' dots may run in TF32
    for slot, ref in ((4, 0), (5, 1)):
        for t, s in zip(tracked[0], short[0]):
            torch.testing.assert_close(t[slot], s[ref], rtol=tol, atol=tol)
    assert not tracked[0][0][6:].any() and not tracked[0][1][6:].any()


def test_compiled_forward_tracks_checkpoints_like_eager():
    """With ``compile=True`` the checkpoint metadata reaches the layer ops at run time (nothing
    enters the graph; a one-request step is padded with a non-tracking row): same tokens as the
    eager engine, same hits, checkpoints tracked inside extends."""
    name = "qwen3_next_dense"
    system, *questions = random_prompts([150, 9, 30, 17], vocab_size(_model(name)), seed=30)
    prompts = [system + q for q in questions]
    args = dict(max_running_requests=2, chunked_prefill_size=256)  # whole prompts: checkpoints inside
    results = []
    for compile_ in (False, True):
        engine = make_engine(_model(name), compile=compile_, **args)
        hits = record_prefix_hits(engine)
        outputs = engine.generate_batch(prompts[:1], max_new_tokens=4)
        outputs += engine.generate_batch(prompts[1:], max_new_tokens=4)
        stats = engine.stats()
        results.append((outputs, hits, stats["prefix_cache"]["checkpoints_tracked"]))
        if compile_:
            assert stats["compile"]["graph_breaks"] == 0 and stats["compile"]["recompiles"] == 0
        _clear_and_check_free(engine)
    assert results[0] == results[1]
    assert results[1][2] > 0 and max(results[1][1]) == 128, results[1]


@pytest.mark.gpu
@pytest.mark.smoke
def test_shared_prefix_workload_on_cuda_matches_cache_off():
    """The Triton path: tracked checkpoints (GDN chunk states + conv windows on the device) give
    the same greedy tokens as the cache off, with hits at chunk-aligned prefixes."""
    import copy

    model = copy.deepcopy(_model("qwen3_next_dense")).to("cuda")
    prompts = _shared_prefix_workload(vocab_size(model))
    args = dict(max_running_requests=3, max_total_tokens=700, mamba_cache_size=10, chunked_prefill_size=100)
    outputs = {}
    for policy in ("off", "lru", "marconi"):
        cache = dict(enable_prefix_cache=False) if policy == "off" else dict(prefix_cache_policy=policy)
        engine = make_engine(model, **args, **cache)
        hits = record_prefix_hits(engine) if policy != "off" else []
        outputs[policy] = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        if policy != "off":
            assert any(h and h % 64 == 0 for h in hits), hits
            _clear_and_check_free(engine)
        else:
            engine.close()
    assert outputs["lru"] == outputs["off"] and outputs["marconi"] == outputs["off"]


@pytest.mark.parametrize("name", ["qwen3_next_dense", "bamba"])
def test_decode_checkpoints_make_partial_outputs_reusable(name):
    """``prefix_cache_track_interval``: a decoding request forks its state into the cache every
    32 tokens of its sequence, so a prompt that shares only part of another request's output
    hits there (marconi keeps only the finish-time state: no hit)."""
    vocab = vocab_size(_model(name))
    p, extra = random_prompts([20, 5], vocab, seed=40)
    out = _hf(name, p, 60)
    q = p + out[:50] + extra  # leaves the first request's sequence after 70 tokens
    for policy, expected_hit in (("lru", 64), ("marconi", 0)):
        engine = _engine(name, prefix_cache_track_interval=32, prefix_cache_policy=policy)
        hits = record_prefix_hits(engine)
        outputs = [engine.generate_batch([p], max_new_tokens=60)[0]]
        outputs += engine.generate_batch([q], max_new_tokens=MAX_NEW)
        _check(name, [p], outputs[:1], max_new=60)
        _check(name, [q], outputs[1:])
        assert hits == [0, expected_hit], (policy, hits)
        _clear_and_check_free(engine)
    with pytest.raises(ValueError, match="prefix_cache_track_interval"):
        _engine(name, prefix_cache_track_interval=-1)


def test_benchmark_smoke_run(tmp_path):
    """``benchmarks/prefix_cache.py --tiny`` runs every system and writes its JSON (no speed asserted)."""
    import importlib.util
    import json
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("prefix_cache_bench", root / "benchmarks" / "prefix_cache.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        out = tmp_path / "run.json"
        bench.main(["--tiny", "--groups", "2", "--prompts-per-group", "3", "--system-len", "140", "--output-len", "3",
                    "--out", str(out)])
    finally:
        sys.path.remove(str(root))
    run = json.loads(out.read_text())
    shared = run["shared_prefix"]
    assert set(shared) == {"no_cache", "lru", "marconi"}
    assert shared["no_cache"]["requests"] == shared["lru"]["requests"] == 6
    assert shared["lru"]["cache"]["token_hit_rate"] > 0 and "cache" not in shared["no_cache"]
    for r in shared.values():  # TTFT = queue wait + prefill
        assert abs(r["mean_queue_s"] + r["mean_prefill_s"] - r["mean_ttft_s"]) < 1e-6
    assert set(run["pressure"]) == {"lru", "marconi"}
