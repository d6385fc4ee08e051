"""MTP proposals as uniform steps (hybrid_compile/engine/speculative/mtp.py, issue 27): the head's
first forward of each proposal is a window of ``k + 1`` rows per request from its first
unprocessed position, the rows past the valid ones masked.

- Every proposal equals the general EXTEND path's (``MTPDraft.use_window = False``) on the tiny
  Qwen3-Next checkpoint with ``mtp.*`` tensors, with chunked prefill, the prefix cache, KV pages
  of 4 and compile; greedy outputs equal transformers' ``generate`` and the plain engine's.
- A window step with masked rows stores K/V only in the valid rows' slots (the masked rows store
  none, no other layer is touched) and leaves the padding slot in their ``req_to_token``
  entries, never -1 and never a live slot.
- The body of the proposal graphs (``mtp_graphs.py``: every step staged at once into stable
  buffers, the chain fed on the device), run without a capture, equals the general path (eager
  and compiled); the ``mtp_draft_graphs`` option's errors.
- ``gpu`` (a dense Qwen3.5 head, fp32): the window equalities on CUDA with the engine's CUDA
  graphs; with ``extra={"mtp_draft_graphs": True}`` every proposal replays a captured graph and the
  proposals and outputs equal the engine's without it, HF's and the plain engine's.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile as hc

from engine_models import random_prompts, single_threaded, vocab_size
from mtp_models import (ENGINE_ARGS, assert_compiled_without_breaks, assert_greedy_with_continuations,
                        checkpoint_vocab_size, finish_engine, mtp_checkpoint_fixture, record_proposals)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)

NEW = 8


checkpoint = mtp_checkpoint_fixture("qwen3_next_moe")
# Qwen3.5 (a dense head): CUDA graphs capture it in fp32 (transformers' fp32 MoE experts loop syncs
# with the host, see tests/test_cuda_graphs.py)
dense_checkpoint = mtp_checkpoint_fixture("qwen3_5")


def _engine(path, k, device="cpu", **kw):
    return hc.from_pretrained(path, dtype=torch.float32, device=device, tokenizer=False,
                              speculative=dict(method="mtp", num_draft_tokens=k), **{**ENGINE_ARGS, **kw})


def _assert_same_proposals(got: list, want: list, exact: bool) -> None:
    """Every proposal equal; on CUDA (``exact`` False) at least 90 %: the two paths pad their steps
    differently, so fp32 matmuls of other shapes may flip a near-tie of the random tiny head."""
    assert len(got) == len(want) and len(got) > 0
    same = sum(g == w for g, w in zip(got, want))
    assert same == len(got) if exact else same >= 0.9 * len(got), f"{same} of {len(got)} proposals equal"


def _assert_window_equals_general_path(path, prompts, k, device="cpu", **kw) -> tuple[list, dict]:
    """Two engines, one with the window proposals and one with the general path: the same
    proposals (every chain; :func:`_assert_same_proposals`), the same greedy outputs (HF's);
    returns (proposals, window stats)."""
    runs = []
    for window in (True, False):
        engine = _engine(path, k, device, **kw)
        engine.speculative.source.use_window = window
        proposals = record_proposals(engine)
        stats = assert_greedy_with_continuations(engine, prompts, NEW)
        runs.append((proposals, stats["speculative"]["draft_source"], stats))
        finish_engine(engine)
    (got, window, stats), (want, general, _) = runs
    _assert_same_proposals(got, want, exact=device == "cpu")
    assert len(got) >= 2 * len(prompts)
    assert window["window_steps"] > 0 and window["window_fallbacks"] == 0
    assert general["window_steps"] == 0
    assert window["head_decode_steps"] == general["head_decode_steps"] > 0
    return got, stats


def _prompts(path, lengths, seed):
    return random_prompts(lengths, checkpoint_vocab_size(path), seed=seed)


def test_window_proposals_equal_general_path_prefix_cache_pages_compile(checkpoint):
    """A prompt longer than the prefill chunk, continuations that hit the prefix cache."""
    _, stats = _assert_window_equals_general_path(checkpoint, _prompts(checkpoint, (5, 40, 11), 3), 3, compile=True,
                                                  page_size=4, enable_prefix_cache=True)
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["speculative"]["verify_steps"] > 0


def test_window_masked_rows_store_no_kv_and_map_to_the_padding_slot(checkpoint):
    """Around every window step: the head's KV changes only in the valid rows' slots, no target
    layer's KV changes, the masked positions' req_to_token entries are the padding slot and the
    positions before them keep their slots."""
    engine = _engine(checkpoint, 3)
    source = engine.speculative.source
    kv, r2t = engine.pools.kv, engine.pools.req_to_token.req_to_token
    head_layer = engine.mtp_head.layer_id
    window_step = source._advance_window
    seen = dict(windows=0, masked_rows=0)

    def checked(requests, window):
        spans = [(r, *source._span(r)) for r in requests]
        spans = [(r, m, end) for r, m, end in spans if end > m]
        before = {layer: [t.clone() for t in kv.kv_cache(layer)] for layer in kv.layer_ids}
        rows_before = {r.rid: r2t[r.req_slot].clone() for r, _, _ in spans}
        out = window_step(requests, window)
        assert out is not None
        valid = torch.cat([r.kv_slots[m:end] for r, m, end in spans])
        for layer, tensors in before.items():
            for old, new in zip(tensors, kv.kv_cache(layer)):
                changed = (old != new).flatten(1).any(1).nonzero().flatten()
                if layer != head_layer:
                    assert changed.numel() == 0, layer
                else:
                    assert set(changed.tolist()) <= set(valid.tolist())
                    assert kv.PADDING_SLOT not in changed.tolist()
        for r, m, end in spans:
            row, old = r2t[r.req_slot], rows_before[r.rid]
            assert torch.equal(row[:end], old[:end])  # live slots untouched
            assert row[end: m + window].eq(kv.PADDING_SLOT).all()
            assert row[: m + window].ge(0).all()
            seen["masked_rows"] += m + window - end
        seen["windows"] += 1
        return out

    source._advance_window = checked
    prompts = random_prompts((6, 37), vocab_size(engine.model), seed=5)
    assert_greedy_with_continuations(engine, prompts, NEW)
    assert seen["windows"] > 0 and seen["masked_rows"] > 0
    finish_engine(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_cuda_mtp_draft_graphs_greedy_equals_without_them(dense_checkpoint, k):
    """extra={"mtp_draft_graphs": True} on CUDA: every chain proposal of a batch within the buckets
    replays a proposal graph (counted, no fallback), the proposals equal the engine's without the
    option, greedy equals HF's and the plain engine's."""
    checkpoint = dense_checkpoint
    prompts = _prompts(checkpoint, (5, 40, 11), 3)
    runs = []
    for graphs in (True, False):
        engine = _engine(checkpoint, k, device="cuda", compile=True, enable_prefix_cache=True,
                         extra={"mtp_draft_graphs": graphs})
        source = engine.speculative.source
        assert (source.graphs is not None) == graphs
        proposals = record_proposals(engine)
        assert_greedy_with_continuations(engine, prompts, NEW)
        runs.append((list(proposals), engine.stats()["speculative"]["draft_source"]))
        if graphs:  # (after the snapshot: this run's proposals are not compared)
            with hc.from_pretrained(checkpoint, dtype=torch.float32, device="cuda", tokenizer=False,
                                    **ENGINE_ARGS) as plain:
                assert plain.generate_batch(prompts, max_new_tokens=NEW) == engine.generate_batch(prompts, max_new_tokens=NEW)
        finish_engine(engine)
    (got, counters), (want, without) = runs
    _assert_same_proposals(got, want, exact=False)
    assert counters["mtp_graph_replays"] > 0 and counters["mtp_graph_fallbacks"] == 0
    assert counters["mtp_graph_eager_runs"] == 0 and without["mtp_graph_replays"] == 0


@pytest.mark.gpu
def test_cuda_window_proposals_equal_general_path_with_graphs(dense_checkpoint):
    """On CUDA with the engine's CUDA graphs (full graphs for the target's decode / verify, the
    head's piecewise graphs; the proposal graphs off) the window proposals equal the general path's and greedy equals HF's."""
    checkpoint = dense_checkpoint
    _, stats = _assert_window_equals_general_path(checkpoint, _prompts(checkpoint, (5, 40, 11), 3), 3, device="cuda", compile=True,
                                                  enable_prefix_cache=True, extra={"mtp_draft_graphs": False})
    assert stats["speculative"]["verify_steps"] > 0


@pytest.mark.parametrize("compile_,k", [(False, 1), (False, 3), (True, 3)])
def test_proposal_graph_body_equals_general_path(checkpoint, compile_, k):
    """The body of the proposal graphs (mtp_graphs.py: every step's metadata staged at once into
    stable buffers, the chain fed on the device), run without a capture: the same proposals as the
    general path, greedy equal to HF's, with the prefix cache and KV pages of 4; every proposal of
    a batch within the buckets goes through it."""
    from hybrid_compile.engine.speculative.mtp_graphs import ProposalGraphs

    prompts = _prompts(checkpoint, (5, 40, 11), 3)
    kw = dict(compile=compile_, page_size=4, enable_prefix_cache=True)
    runs = []
    for graphs in (True, False):
        engine = _engine(checkpoint, k, **kw)
        source = engine.speculative.source
        if graphs:
            source.graphs = ProposalGraphs(source, k, (1, 2), capture=False)
        else:
            source.use_window = False
        proposals = record_proposals(engine)
        assert_greedy_with_continuations(engine, prompts, NEW)
        if compile_:
            assert_compiled_without_breaks(engine)
        runs.append((proposals, dict(source.counters), engine.stats()["speculative"]["device_draft_steps"]))
        finish_engine(engine)
    (got, counters, device_steps), (want, _, none) = runs
    assert got == want
    assert counters["mtp_graph_eager_runs"] > 0 and counters["mtp_graph_fallbacks"] == 0
    # every proposal graph run left its drafts on the device for the verify step
    assert device_steps == counters["mtp_graph_eager_runs"] and none == 0
    assert counters["mtp_graph_replays"] == 0 and counters["window_fallbacks"] == 0


def test_mtp_draft_graphs_option_errors(checkpoint):
    """The option is True, False or None; True needs full CUDA graphs (not on this CPU engine) and a
    chain; None (the default) leaves a CPU engine without proposal graphs."""
    with pytest.raises(ValueError, match="mtp_draft_graphs.*must be True, False or None"):
        _engine(checkpoint, 2, extra={"mtp_draft_graphs": "yes"})
    with pytest.raises(ValueError, match="mtp_draft_graphs.*needs the engine's full CUDA graphs"):
        _engine(checkpoint, 2, extra={"mtp_draft_graphs": True})
    for extra in ({"mtp_draft_graphs": False}, {}):
        engine = _engine(checkpoint, 2, extra=extra)
        assert engine.speculative.source.graphs is None
        finish_engine(engine)


@pytest.mark.parametrize("extra,spec,cuda_graphs,want", [
    ({}, dict(num_draft_tokens=2), None, True),  # the default: on with full graphs and a chain
    ({}, dict(num_draft_tokens=2), "piecewise", False),
    ({}, dict(num_draft_tokens=2, topk=2), None, False),  # a draft tree proposes eagerly
    ({"mtp_draft_graphs": False}, dict(num_draft_tokens=2), None, False),
    ({"mtp_draft_graphs": True}, dict(num_draft_tokens=2), None, True),
    ({"mtp_draft_graphs": True}, dict(num_draft_tokens=2, topk=2), None, "topk 1"),
    ({"mtp_draft_graphs": True}, dict(num_draft_tokens=2), "piecewise", "full CUDA graphs"),
])
def test_mtp_draft_graphs_resolution_on_a_cuda_config(extra, spec, cuda_graphs, want):
    """How the option resolves for a compiled CUDA engine's config (no GPU needed: config only)."""
    from hybrid_compile.engine.config import EngineConfig
    from hybrid_compile.engine.speculative.mtp_graphs import resolve_option

    config = EngineConfig.from_args(compile=True, cuda_graphs=cuda_graphs, extra=extra,
                                    speculative=dict(method="mtp", **spec))
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            resolve_option(config, torch.device("cuda"))
    else:
        assert resolve_option(config, torch.device("cuda")) is want


def test_kernel_warm_up_leaves_the_head_counters_as_they_were(checkpoint):
    """The wrap-time warm-up (``warmup_kernels``, on by default on CUDA) drafts with the head, then
    restores every counter: the head's (``stats()["speculative"]["draft_source"]``) too."""
    engine = _engine(checkpoint, 2, warmup_kernels=False)
    before = engine.stats()["speculative"]["draft_source"]
    proposals = record_proposals(engine)
    engine._warm_up_kernels()
    assert len(proposals) > 0 and engine.stats()["speculative"]["draft_source"] == before
    assert before["head_extend_steps"] == before["window_steps"] == 0
    finish_engine(engine)


def test_chain_staging_equals_one_uniform_step_each(checkpoint):
    """``ForwardBatchBuilder.stage_chain`` (a proposal's k - 1 chain steps staged at once, one write of
    their ``req_to_token`` host entries) gives, at every proposal of a served batch, the rows that
    ``stage_uniform`` gives for each step on its own, and the same host map entries."""
    from hybrid_compile.engine.scheduler import ScheduledBatch
    from hybrid_compile.engine.speculative.mtp_graphs import ProposalGraphs
    from hybrid_compile.layers.context import ForwardMode

    k = 3
    engine = _engine(checkpoint, k)
    source = engine.speculative.source
    source.graphs = ProposalGraphs(source, k, (1, 2), capture=False)
    builder = source.runner.batch_builder
    r2t = engine.pools.req_to_token
    chains = []
    staged = builder.stage_chain

    def checked(batch, steps, pad_to):
        rows = staged(batch, steps, pad_to)
        host = r2t._req_to_token_host.clone()
        b = len(batch.requests)
        per_request = batch.out_cache_loc.view(b, steps)
        want = [builder.stage_uniform(ScheduledBatch(batch.requests, [p + j for p in batch.prefix_lens], [1] * b,
                                                     per_request[:, j].contiguous(), ForwardMode.DECODE),
                                      1, None, True, pad_to)[0] for j in range(steps)]
        assert rows == want
        assert torch.equal(r2t._req_to_token_host, host)  # (each step's own write: the entries stage_chain wrote)
        chains.append((b, steps))
        return rows

    builder.stage_chain = checked
    assert_greedy_with_continuations(engine, _prompts(checkpoint, (5, 40, 11), 3), NEW)
    assert chains and all(steps == k - 1 for _, steps in chains) and {b for b, _ in chains} == {1, 2}
    finish_engine(engine)
