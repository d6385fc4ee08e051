"""Mamba2 families (Mamba2, NemotronH, Falcon-H1, Bamba, GraniteMoeHybrid, Zamba2) through the
engine: greedy tokens equal transformers' own ``generate`` per prompt, for one prompt and for a
continuous batch with chunked prefill; pools are all free afterwards; the patched model still
gives HF's result outside the engine; the ``mamba2_layer`` op matches the HF mixer over a packed,
chunked extend.

Tiny random fp32 models from :mod:`mamba2_models`; the HF references are computed once per
model (with an explicit all-ones attention mask, so HF never mistakes a token for padding).
"""

from __future__ import annotations

import functools

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from hybrid_compile.models import FAMILIES

import mamba2_models as mm
from engine_models import record_prefix_hits

MAX_NEW = 8
PROMPT_LENS = (1, 150, 17, 64, 5, 33, 100)  # chunked_prefill_size 32, chunk_size 16
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=256, max_total_tokens=2048,
                   mamba_cache_size=8)

# case -> (builder, model seed); two seeds per family (the second only in the batch test)
CASES = {
    "mamba2": (mm.build_mamba2, 0),
    "nemotron_h": (mm.build_nemotron_h, 1),
    "falcon_h1": (mm.build_falcon_h1, 6),
    "falcon_h1_gated_norm": (functools.partial(mm.build_falcon_h1, rms_norm=True), 3),
    "bamba": (mm.build_bamba, 4),
    "granitemoehybrid": (mm.build_granitemoehybrid, 5),
    "zamba2": (mm.build_zamba2, 6),
}
SECOND_SEED = {f"{name}-seed{seed + 10}": (build, seed + 10) for name, (build, seed) in CASES.items()
               if name != "falcon_h1_gated_norm"}
ALL_CASES = {**CASES, **SECOND_SEED}


def _hf_generate(model, prompt: list[int], max_new: int = MAX_NEW, logits: bool = False):
    """HF greedy tokens (and, with ``logits``, the raw logits of every generated position)."""
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                             return_dict_in_generate=True, output_logits=logits)
    tokens = out.sequences[0, len(prompt):].tolist()
    return (tokens, torch.cat(out.logits).float()) if logits else tokens


@functools.lru_cache(maxsize=None)
def _case(name: str):
    """(model, prompts, HF greedy tokens per prompt, HF logits per prompt), built once per case."""
    build, seed = ALL_CASES[name]
    model = build(seed)
    g = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(0, mm.VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    refs, ref_logits = zip(*(_hf_generate(model, p, logits=True) for p in prompts))
    return model, prompts, list(refs), list(ref_logits)


def _check_all_free(engine) -> None:
    """Nothing leaked: the prefix cache (on by default) is checked and emptied, then every pool is free."""
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()


def _record_logits(engine) -> dict[int, list[torch.Tensor]]:
    """Capture, per request id, the logits row of every step that samples a token for it."""
    records: dict[int, list[torch.Tensor]] = {}
    forward = engine.runner.forward
    # one step at a time: a decode step launched ahead (overlap) runs before the previous
    # step's tokens are appended, so `pending` would not say which requests sample
    engine.overlap = False

    def recording_forward(batch):
        logits = forward(batch)
        for row, (r, n) in enumerate(zip(batch.requests, batch.extend_lens)):
            if r.pending == n:  # all of its pending tokens are in this step: it samples now
                records.setdefault(r.rid, []).append(logits[row].float().clone())
        return logits

    engine.runner.forward = recording_forward
    return records


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only add overhead (and thrash on a busy machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param, *_case(request.param)[:3]


@pytest.fixture(params=list(ALL_CASES))
def any_case(request):
    return request.param, *_case(request.param)


def test_families_registered():
    for model_type in ("mamba2", "nemotron_h", "falcon_h1", "bamba", "granitemoehybrid", "zamba2"):
        assert model_type in hc.supported_model_types()
        assert FAMILIES[model_type].MODEL_TYPES.count(model_type) == 1


def test_generate_single_prompt(case):
    name, model, prompts, refs = case
    ref_logits = _case(name)[3]
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        records = _record_logits(engine)
        for rid, i in enumerate((1, 0)):  # 150 tokens: prefilled in 5 chunks; then a 1-token prompt
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            assert out[0, len(prompts[i]):].tolist() == refs[i], f"{name}: prompt {i}"
            torch.testing.assert_close(torch.stack(records[rid]), ref_logits[i], rtol=1e-4, atol=1e-4)
        _check_all_free(engine)


def test_generate_batch_continuous(any_case):
    """Continuous batching with chunked prefill (mixed prefill + decode steps): same greedy tokens
    as HF, and the logits of every sampled position close to HF's (catches errors too small to
    flip an argmax, e.g. a dt clamp applied where HF does not apply it)."""
    name, model, prompts, refs, ref_logits = any_case
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        records = _record_logits(engine)
        outs = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        _check_all_free(engine)
    assert sorted(records) == list(range(len(prompts)))  # a fresh engine numbers requests 0, 1, ...
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out == ref, f"{name}: prompt {i} (length {len(prompts[i])})"
        torch.testing.assert_close(torch.stack(records[i]), ref_logits[i], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: prompt {i} logits: {m}")
    assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0
    assert stats["requests_finished"] == len(prompts)


@pytest.mark.parametrize("policy", ["lru", "marconi"])
def test_prefix_cache_hits_at_chunk_aligned_prefixes(case, policy):
    """Prompts sharing a 60-token prefix, in flight together and again after it is cached: the
    chunk-aligned checkpoints (chunk_size 16) give hits at multiples of 16 that are no finished
    request's length (lru: every chunk, so already between requests in flight together; marconi:
    at the branch points of the second round, hit in the third), and every greedy output equals
    HF's."""
    name, model, prompts, refs = case
    base = prompts[1][:60]
    tails = [prompts[2][:9], prompts[5][:20], prompts[3][:3]]
    shared = [base + t for t in tails]
    order = [0, 1, 0, 2, 1, 2, 0]  # rounds of 2, 3 and 2 requests in flight together
    batch = [shared[i] for i in order]
    refs = [_hf_generate(model, p) for p in shared]
    expected = [refs[i] for i in order]
    with hc.wrap(model, **ENGINE_ARGS, prefix_cache_policy=policy) as engine:
        hits = record_prefix_hits(engine)
        outs = []
        for start, end in ((0, 2), (2, 5), (5, 7)):
            outs += engine.generate_batch(batch[start:end], max_new_tokens=MAX_NEW)
        stats = engine.stats()["prefix_cache"]
        _check_all_free(engine)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out == ref, f"{name} ({policy}): prompt {i}"
    finished_lens = {len(p) + MAX_NEW - 1 for p in batch}
    aligned = [h for h in hits if h and h % 16 == 0 and h not in finished_lens]
    assert all(h in aligned or h in finished_lens for h in hits if h), f"{name} ({policy}): hits {hits}"
    assert hits[-2:] == [48, 64] or policy == "lru", f"{name} ({policy}): hits {hits}"  # the branch points
    assert max(aligned, default=0) >= 48, f"{name} ({policy}): hits {hits}"
    assert 0 < stats["mamba_hits"] <= sum(1 for h in hits if h)  # a waiting request may match again
    if policy == "lru":  # a checkpoint every chunk: the second prompt hits while the first is in flight
        assert hits[1] == 32 and stats["checkpoints_tracked"] + stats["checkpoints_forked"] > 0


def test_patched_model_generate_outside_engine(case):
    name, model, prompts, refs = case
    engine = hc.wrap(model, **ENGINE_ARGS)
    try:
        engine.generate_batch(prompts[:2], max_new_tokens=2)
        assert _hf_generate(model, prompts[2]) == refs[2], f"{name}: patched model, HF generate"
    finally:
        engine.close()
    assert _hf_generate(model, prompts[3]) == refs[3], f"{name}: after close"


def test_layout():
    model = _case("mamba2")[0]
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        assert engine.layout.attention == [] and engine.pools.kv.layer_ids == []
        assert [s.layer_ids for s in engine.layout.mamba] == [(0,), (1,), (2,)]
        assert engine.layout.ssm_chunk_size == model.config.chunk_size
        spec = engine.layout.mamba[0]
        assert spec.conv_window_shape == (3, 64 + 2 * 2 * 16) and spec.state_shape == (8, 8, 16)

    # Falcon-H1: attention and Mamba2 in every layer -> distinct pool ids for the two branches
    model = _case("falcon_h1")[0]
    n = model.config.num_hidden_layers
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        assert engine.pools.kv.layer_ids == list(range(n))
        assert engine.pools.mamba.layer_ids == [n + i for i in range(n)]

    # Zamba2: every layer has a mixer; each use of a shared attention block gets its own KV id
    model = _case("zamba2")[0]
    n = model.config.num_hidden_layers
    hybrid = [i for i, t in enumerate(model.config.layers_block_type) if t == "hybrid"]
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        assert engine.pools.mamba.layer_ids == list(range(n))
        assert engine.pools.kv.layer_ids == [n + i for i in hybrid]
    assert all(layer.shared_transformer.self_attn.layer_idx == -1 for layer in model.model.layers
               if hasattr(layer, "shared_transformer")), "close() restores HF's attention layer_idx"


def _mixer_reference(mixer, hidden: torch.Tensor) -> torch.Tensor:
    """HF's own mixer forward over one whole sequence, no cache (the chunked path)."""
    with torch.no_grad():
        return type(mixer).forward(mixer, hidden[None])[0]


def packed_extend_outputs(mixer, layer_id: int, conv: torch.Tensor, ssm: torch.Tensor, hidden_size: int):
    """Two requests (37 and 21 tokens) packed in one EXTEND step of the patched ``mixer``, then
    continued from their pool state (slots 2 and 5) in a second one. Returns ``(sequences, outputs)``
    with the mixer's output over each whole sequence."""
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randn(n, hidden_size, generator=g) for n in (37, 21)]
    slots = torch.tensor([2, 5], dtype=torch.int32)
    outs = [[], []]
    for first, (a, b) in ((True, (0, 19)), (False, (19, 37))):  # step 2 continues both from the pools
        parts = [s[a:b] for s in seqs]
        lens = torch.tensor([len(p) for p in parts])
        qsl = torch.zeros(3, dtype=torch.int32)
        qsl[1:] = torch.cumsum(lens, 0)
        md = ForwardMetadata(
            mode=ForwardMode.EXTEND, positions=torch.cat([torch.arange(a, a + n) for n in lens.tolist()]),
            query_start_loc=qsl, seq_lens=lens.int(), prefix_lens=torch.zeros(2, dtype=torch.int32),
            mamba_cache_indices=slots, has_initial_state=torch.tensor([not first, not first]),
            out_cache_loc=torch.zeros(0, dtype=torch.int64), kv_indptr=torch.zeros(3, dtype=torch.int32),
            kv_indices=torch.zeros(0, dtype=torch.int64), logits_indices=qsl[1:].long() - 1,
            prompt_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32),
        )
        ctx = ForwardContext(md, {}, {layer_id: (conv, ssm)})
        with torch.no_grad(), forward_context(ctx):
            y = mixer(torch.cat(parts)[None])[0]
        outs[0].append(y[: lens[0]])
        outs[1].append(y[lens[0]:])
    return seqs, [torch.cat(o) for o in outs]


@pytest.mark.parametrize("name", ["mamba2", "nemotron_h", "falcon_h1", "zamba2"])
def test_mixer_layer_op_matches_hf_chunked_extend(name):
    """Two requests packed in one EXTEND step, then continued from their pool state in a second
    one; the patched mixer's output equals HF's mixer over each whole sequence."""
    model = _case(name)[0]
    with hc.wrap(model, **ENGINE_ARGS) as engine:
        mixer = next(m for m in model.modules() if hasattr(m, "A_log") and hasattr(m, "in_proj"))
        layer_id = next(lid for m, lid in FAMILIES[model.config.model_type].mamba_layers(model) if m is mixer)
        conv, ssm = engine.pools.mamba.conv(layer_id), engine.pools.mamba.ssm(layer_id)
        seqs, outs = packed_extend_outputs(mixer, layer_id, conv, ssm, model.config.hidden_size)
        for seq, out in zip(seqs, outs):
            torch.testing.assert_close(out, _mixer_reference(mixer, seq), rtol=1e-4, atol=1e-5)


def test_unsupported_model_type_lists_mamba2_families():
    class Cfg:
        model_type = "not_a_family"

    class Dummy(torch.nn.Module):
        config = Cfg()

    with pytest.raises(ValueError, match="supported model types: .*falcon_h1.*mamba2.*zamba2"):
        hc.wrap(Dummy())


def test_layer_op_fake_shape_and_verify_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    H, P, G, N, W = 8, 8, 2, 16, 4
    conv_dim = H * P + 2 * G * N
    args = lambda n: (torch.randn(n, conv_dim), torch.randn(n, H), torch.randn(conv_dim, W), torch.randn(conv_dim),
                      torch.zeros(H), torch.ones(H), torch.zeros(H))
    with FakeTensorMode():
        out = torch.ops.hybrid_compile.mamba2_layer(*args(5), 0, H, P, G, N, "silu", 16, 0.0, float("inf"), False)
    assert out.shape == (5, H, P)
    with pytest.raises(ValueError, match="xBC must be"):
        torch.ops.hybrid_compile.mamba2_layer(torch.randn(5, conv_dim + 1), *args(5)[1:], 0, H, P, G, N, "silu",
                                              16, 0.0, float("inf"), False)

    md = ForwardMetadata(
        mode=ForwardMode.TARGET_VERIFY, positions=torch.arange(4), query_start_loc=torch.tensor([0, 2, 4]),
        seq_lens=torch.tensor([5, 5]), prefix_lens=torch.tensor([3, 3]), mamba_cache_indices=torch.tensor([0, 1]),
        has_initial_state=torch.tensor([True, True]), out_cache_loc=torch.zeros(0, dtype=torch.int64),
        kv_indptr=torch.zeros(3, dtype=torch.int32), kv_indices=torch.zeros(0, dtype=torch.int64),
        logits_indices=torch.arange(4), draft_len=2,
    )
    pools = {0: (torch.zeros(2, W - 1, conv_dim), torch.zeros(2, H, P, N))}
    with forward_context(ForwardContext(md, {}, pools)), pytest.raises(RuntimeError, match="speculative buffers"):
        torch.ops.hybrid_compile.mamba2_layer(*args(4), 0, H, P, G, N, "silu", 16, 0.0, float("inf"), False)
