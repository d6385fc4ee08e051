"""A mixed step's decode rows run as a DECODE part (``ForwardMetadata.mixed_parts``): the parts'
metadata against a brute-force split of the whole step, and ``MixedParts.run`` (token order, padding
rows, the context's metadata restored). Token-level parity of mixed steps against transformers is
``tests/test_engine_parity.py`` (every kind) and ``tests/family_parity.py`` (the other families)."""

from __future__ import annotations

import pytest
import torch

import hybrid_compile as hc
from engine_models import assert_greedy_equal, cached_model, hf_greedy_cached, make_engine, random_prompts, vocab_size
from hybrid_compile.engine.forward_batch import pad_requests
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, by_mixed_parts, forward_context

# two prefill requests (3 tokens from 0, 2 tokens after 4 cached), then two decode rows (prefix 5 and 7)
PREFIX = [0, 4, 5, 7]
EXTEND = [3, 2, 1, 1]


def _step(decode_rows=(2, 4)) -> ForwardMetadata:
    seq = [p + n for p, n in zip(PREFIX, EXTEND)]
    i32 = dict(dtype=torch.int32)
    cum = torch.tensor([0] + EXTEND).cumsum(0)
    kv_cum = torch.tensor([0] + seq).cumsum(0)
    md = ForwardMetadata(
        mode=ForwardMode.EXTEND,
        positions=torch.cat([torch.arange(p, p + n) for p, n in zip(PREFIX, EXTEND)]),
        query_start_loc=cum.to(**i32), seq_lens=torch.tensor(seq, **i32), prefix_lens=torch.tensor(PREFIX, **i32),
        mamba_cache_indices=torch.tensor([3, 1, 4, 2], **i32), has_initial_state=torch.tensor(PREFIX) > 0,
        out_cache_loc=torch.arange(100, 100 + sum(EXTEND)), kv_indptr=kv_cum.to(**i32),
        kv_indices=torch.arange(500, 500 + sum(seq), dtype=torch.int32), logits_indices=cum[1:] - 1,
        extend_lens_cpu=list(EXTEND), seq_lens_cpu=seq, prompt_lens=torch.tensor([3, 6, 5, 2], **i32),
        track_slots=torch.tensor([-1, 9, -1, -1], **i32), track_lens=torch.tensor([-1, 1, -1, -1], **i32),
        has_tracking=True, decode_rows=decode_rows,
    )
    return md


def test_parts_are_the_whole_step_split_in_two():
    md = _step()
    parts = md.mixed_parts()
    assert parts is md.mixed_parts()  # built once per step
    assert (parts.extend_tokens, parts.decode_tokens) == (5, 2)
    ext, dec = parts.extend, parts.decode
    assert ext.mode is ForwardMode.EXTEND and dec.mode is ForwardMode.DECODE
    assert ext.mixed_parts() is None and dec.mixed_parts() is None
    # the prefill part: the first two requests, as the whole step had them
    assert ext.positions.tolist() == [0, 1, 2, 4, 5] and ext.query_start_loc.tolist() == [0, 3, 5]
    assert ext.kv_indptr.tolist() == [0, 3, 9] and ext.kv_indices[:9].tolist() == list(range(500, 509))
    assert ext.out_cache_loc.tolist() == [100, 101, 102, 103, 104]
    assert ext.track_slots.tolist() == [-1, 9] and ext.track_lens.tolist() == [-1, 1] and ext.has_tracking
    assert ext.extend_lens_cpu == [3, 2] and ext.seq_lens_cpu == [3, 6] and ext.prompt_lens.tolist() == [3, 6]
    # the decode part: rows 2 and 3, each one token, their KV indices rebased to 0
    assert dec.positions.tolist() == [5, 7] and dec.query_start_loc.tolist() == [0, 1, 2]
    assert dec.seq_lens.tolist() == [6, 8] and dec.prefix_lens.tolist() == [5, 7]
    assert dec.mamba_cache_indices.tolist() == [4, 2] and dec.has_initial_state.tolist() == [True, True]
    assert dec.out_cache_loc.tolist() == [105, 106] and dec.prompt_lens.tolist() == [5, 2]
    assert dec.kv_indptr.tolist() == [0, 6, 14] and dec.kv_indices.tolist() == list(range(509, 523))
    assert dec.track_slots is None and not dec.has_tracking and dec.extend_lens_cpu == [1, 1]
    # the decode part's tensors are fresh (a slice's offset would specialise a Triton kernel anew)
    whole = {t.untyped_storage().data_ptr() for t in (md.positions, md.seq_lens, md.kv_indices, md.kv_indptr,
                                                       md.out_cache_loc, md.mamba_cache_indices)}
    for t in (dec.positions, dec.seq_lens, dec.kv_indices, dec.kv_indptr, dec.out_cache_loc, dec.mamba_cache_indices):
        assert t.untyped_storage().data_ptr() not in whole and t.storage_offset() == 0


def test_padding_requests_keep_the_split_and_run_concatenates_in_token_order():
    ids, md = pad_requests(torch.arange(sum(EXTEND)), _step(), [3], padding_slot=0)
    assert md.decode_rows == (2, 4) and md.num_tokens == 10
    seen = []

    def layer(x, y):
        m = ctx.metadata
        seen.append((m.mode, x.tolist(), None if y is None else y.tolist()))
        return x.float()[:, None] * 10 + (0 if m.mode is ForwardMode.EXTEND else 1)

    ctx = ForwardContext(md, {}, {})
    x = torch.arange(1, 11)
    with forward_context(ctx):
        out = by_mixed_parts(layer, x, None)
    assert seen == [(ForwardMode.EXTEND, [1, 2, 3, 4, 5], None), (ForwardMode.DECODE, [6, 7], None)]
    assert out[:, 0].tolist() == [10, 20, 30, 40, 50, 61, 71, 0, 0, 0]  # padding tokens: zeros
    assert ctx.metadata is md

    def failing(x, y):
        raise RuntimeError("boom")

    with forward_context(ctx), pytest.raises(RuntimeError, match="boom"):
        by_mixed_parts(failing, x, x)
    assert ctx.metadata is md  # restored after a failure inside a part


def test_no_split_outside_mixed_steps_and_bad_rows_are_refused():
    assert _step(decode_rows=None).mixed_parts() is None
    assert by_mixed_parts(lambda x: x, torch.zeros(3)) is None  # outside a forward
    decode = _step()
    decode.mode = ForwardMode.DECODE
    assert decode.mixed_parts() is None
    with pytest.raises(ValueError, match="decode rows are one-token requests"):
        _step(decode_rows=(1, 4)).mixed_parts()  # request 1 has 2 new tokens
    with pytest.raises(ValueError, match="decode rows are one-token requests"):
        _step(decode_rows=(0, 0)).mixed_parts()  # no prefill request before them


def test_tensor_parallel_forward_command_carries_the_decode_rows(monkeypatch):
    """Rank 0's FORWARD command of a mixed step (``distributed/step.py``) gives a follower the same
    metadata, its decode rows included, so that every rank splits the step alike: the command's
    broadcasts recorded on the sending side and replayed on the receiving one."""
    from types import SimpleNamespace

    from hybrid_compile.distributed import step

    sent = []
    monkeypatch.setattr(step.dist, "broadcast", lambda t, src, group=None: sent.append(t.clone()))
    tp = SimpleNamespace(control=None, group=None, device=torch.device("cpu"))
    for decode_rows in ((2, 4), None):
        sent.clear()
        md = _step(decode_rows)
        ids = torch.arange(sum(EXTEND))
        with forward_context(ForwardContext(md, {}, {})):
            step.StepBroadcaster(tp).forward(False, ids)
        replay = iter(sent)
        monkeypatch.setattr(step.dist, "broadcast", lambda t, src, group=None: t.copy_(next(replay)))
        seen = []

        def model_forward(input_ids, positions, logits_indices, *extra):
            seen.append((input_ids.clone(), step.get_forward_context().metadata))

        runner = SimpleNamespace(extra_inputs=(), kv_caches={}, mamba_caches={}, intermediate_caches={},
                                 _model_forward=model_forward)
        step._forward(SimpleNamespace(runner=runner), tp, step._receive(tp))
        (got_ids, got), = seen
        assert torch.equal(got_ids, ids) and got.decode_rows == decode_rows and got.mode is ForwardMode.EXTEND
        assert got.extend_lens_cpu == md.extend_lens_cpu and torch.equal(got.kv_indices, md.kv_indices)
        monkeypatch.setattr(step.dist, "broadcast", lambda t, src, group=None: sent.append(t.clone()))


def test_split_mixed_steps_switch_both_ways_match_hf():
    """``extra={"split_mixed_steps": False}`` keeps a mixed step's decode rows in the extend paths; both
    ways give transformers' greedy tokens, and only the split engine counts mixed steps."""
    model = cached_model("qwen3_next_dense", 0)
    prompts = random_prompts([30, 5, 70, 12], vocab_size(model), seed=3)
    expected = [hf_greedy_cached(model, ("qwen3_next_dense", 0), p, 8) for p in prompts]
    for split in (True, False):
        with make_engine(model, chunked_prefill_size=32, max_running_requests=3,
                         extra={"split_mixed_steps": split}) as engine:
            got = engine.generate_batch(prompts, max_new_tokens=8, do_sample=False)
            stats = engine.stats()
        for p, g, e in zip(prompts, got, expected):
            assert_greedy_equal(model, p, g, e, f"split_mixed_steps={split}")
        assert stats["extend_steps"] > 0 and (stats["mixed_steps"] > 0) == split, stats
    with pytest.raises(ValueError, match="split_mixed_steps"):
        hc.EngineConfig.from_args(extra={"split_mixed_steps": "no"})
