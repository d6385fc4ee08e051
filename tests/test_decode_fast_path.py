"""The host fast path of decode steps (issue 5), on CPU.

- ``ForwardBatchBuilder.build_decode`` (DECODE steps: the ``uniform_step_metadata`` op) gives
  exactly the tensors of the general ``build_extend`` on real decode steps of a
  continuous batch (every field, dtype and value), and with device input ids takes them as they are.
- ``ReqToTokenPool.set_decode_tokens`` writes what ``set_tokens_batch`` writes (host mirror and
  device map), and rejects what it rejects; the KV allocator's page-size-1 list path hands out
  exactly the slots of the general path; ``check_allocated`` on a list raises the general errors.
- Overlap (engine ``step`` launches the next decode step before reading the tokens): greedy
  tokens equal HF's generate and the engine without overlap, seeded sampling is identical with
  and without overlap, steps are really launched ahead, stats and pools end the same; requests
  with stop tokens, a request added mid-run and requests finishing at different steps mix in.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.layers.context import ForwardMode
from hybrid_compile.memory.allocator import InvalidSlotError, SlotAllocator, TokenSlotAllocator
from hybrid_compile.memory.req_to_token import ReqToTokenPool
from engine_models import (
    assert_greedy_equal,
    assert_metadata_equal,
    assert_pools_restored,
    cached_model,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)

KIND, SEED = "qwen3_next_dense", 0


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(scope="module")
def model():
    return cached_model(KIND, SEED)


def test_decode_metadata_equals_general_path(model):
    prompts = random_prompts([5, 9, 2, 13], vocab_size(model), seed=11)
    checked = []
    with make_engine(model, max_running_requests=4) as engine:
        runner = engine.runner
        builder = runner.batch_builder
        original = runner.forward

        def forward(batch, input_ids=None):
            if batch.mode is ForwardMode.DECODE:
                ids, md = builder.build_decode(batch, input_ids if input_ids is not None else batch.input_ids)
                if batch.input_ids is None:
                    want_ids, want = builder.build_extend(batch)
                    assert torch.equal(ids, want_ids)
                else:  # launched ahead: its tokens are not appended yet; the device ids are taken as they are
                    assert torch.equal(ids, batch.input_ids)
                    want = builder.build_extend(dataclasses.replace(batch, input_ids=None,
                                                                    requests=[_Pending(r, t) for r, t in zip(batch.requests, ids.tolist())]))[1]
                assert_metadata_equal(md, want)
                checked.append((md.batch_size, batch.input_ids is not None))
            return original(batch, input_ids)

        runner.forward = forward
        out = engine.generate_batch(prompts, max_new_tokens=5)
    for p, o in zip(prompts, out):
        assert_greedy_equal(model, p, o, hf_greedy_cached(model, (KIND, SEED), p, 5))
    assert {b for b, _ in checked} >= {4} and any(ahead for _, ahead in checked)


class _Pending:
    """A request as it will be once its in-flight token is appended (for the general path)."""

    def __init__(self, r, token: int) -> None:
        self._r, self._token = r, token
        self.req_slot, self.mamba_slot, self.prompt = r.req_slot, r.mamba_slot, r.prompt

    def token_ids(self, start: int, end: int) -> list[int]:
        ids = self._r.token_ids(0, self._r.seq_len) + [self._token]
        return ids[start:end]


def test_metadata_tensors_start_16_byte_aligned(model):
    """Every metadata tensor of every step kind (extend, mixed, decode fast path, verify) starts at
    a 16-byte aligned address whatever the batch size: Triton specialises kernels on pointer
    alignment, so a batch-size-dependent offset into the packed buffer would JIT-compile new kernel
    variants mid-serving (seconds each on a GPU)."""
    seen = set()

    def check(batch_md):
        input_ids, md = batch_md
        for f in dataclasses.fields(md):
            t = getattr(md, f.name)
            if isinstance(t, torch.Tensor) and t.numel():
                assert t.data_ptr() % 16 == 0, (md.mode.value, md.batch_size, f.name)
        assert input_ids.data_ptr() % 16 == 0
        seen.add((md.mode.value, md.batch_size))
        return batch_md

    for spec in (None, dict(method="ngram", num_draft_tokens=2)):
        with make_engine(model, max_running_requests=5, chunked_prefill_size=16, speculative=spec) as engine:
            builder = engine.runner.batch_builder
            build_uniform, build_extend = builder.build_uniform, builder.build_extend
            builder.build_uniform = lambda *a, **k: check(build_uniform(*a, **k))
            builder.build_extend = lambda *a, **k: check(build_extend(*a, **k))
            prompts = random_prompts([3, 7, 12, 5, 9, 4], vocab_size(model), seed=3)
            engine.generate_batch(prompts, max_new_tokens=6)
    assert {m for m, _ in seen} == {"extend", "decode", "target_verify"}
    assert len({b for m, b in seen if m == "decode"}) >= 3


def test_decode_metadata_rejects_bad_device_ids(model):
    with make_engine(model) as engine:
        engine.overlap = False
        engine.add_request(random_prompts([4], vocab_size(model), seed=1)[0], hc.SamplingParams(max_new_tokens=4))
        engine.step()  # prefill
        batch = engine.scheduler.schedule()
        assert batch.mode is ForwardMode.DECODE
        with pytest.raises(ValueError, match=r"must be \[1\] int64"):
            engine.runner.build_metadata(batch, torch.zeros(2, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"must be \[1\] int64"):
            engine.runner.build_metadata(batch, torch.zeros(1, dtype=torch.int32))
        extend = dataclasses.replace(batch, mode=ForwardMode.EXTEND)
        with pytest.raises(ValueError, match="DECODE steps"):
            engine.runner.build_metadata(extend, torch.zeros(1, dtype=torch.int64))
        engine.runner.forward(batch)
        engine.scheduler.release(batch.requests[0])  # drop the request: pools back to empty
        engine.scheduler.running.clear()
        engine.pools.check_all_free()


def test_set_decode_tokens_equals_set_tokens_batch():
    a = ReqToTokenPool(4, 16)
    b = ReqToTokenPool(4, 16)
    ra, rb = a.alloc(3), b.alloc(3)
    assert torch.equal(ra, rb)
    slots = [int(s) for s in ra]
    a.set_tokens_batch(ra, [0, 0, 0], [5, 2, 7], torch.arange(100, 114))
    b.set_tokens_batch(rb, [0, 0, 0], [5, 2, 7], torch.arange(100, 114))
    a.set_tokens_batch(torch.tensor([slots[2], slots[0]]), [7, 5], [1, 1], torch.tensor([40, 41]))
    b.set_decode_tokens([slots[2], slots[0]], [7, 5], [40, 41])
    assert torch.equal(a.req_to_token, b.req_to_token) and torch.equal(a._req_to_token_host, b._req_to_token_host)
    # the device write left to the caller: the host mirror only
    before = b.req_to_token.clone()
    b.set_decode_tokens([slots[1]], [2], [43], write_device=False)
    a.set_tokens(slots[1], 2, [43])
    assert torch.equal(a._req_to_token_host, b._req_to_token_host) and torch.equal(before, b.req_to_token)
    assert not torch.equal(a.req_to_token, b.req_to_token)
    with pytest.raises(ValueError, match="positions"):
        b.set_decode_tokens([slots[0]], [16], [1])
    with pytest.raises(ValueError, match="one of each"):
        b.set_decode_tokens([slots[0]], [1, 2], [1])
    with pytest.raises(InvalidSlotError, match="not allocated"):
        b.set_decode_tokens([4], [1], [1])
    with pytest.raises(InvalidSlotError, match="more than once"):
        b.set_decode_tokens([slots[0], slots[0]], [1, 2], [1, 2])
    with pytest.raises(InvalidSlotError, match="2\\*\\*31"):
        b.set_decode_tokens([slots[0]], [1], [-1])
    assert torch.equal(a._req_to_token_host, b._req_to_token_host)
    # a uniform step of 3 tokens per request in one call (token slots request-major)
    a.set_tokens_batch(torch.tensor([slots[1], slots[2]]), [4, 9], [3, 3], torch.tensor([50, 51, 52, 60, 61, 62]))
    b.set_decode_tokens([slots[1], slots[2]], [4, 9], [50, 51, 52, 60, 61, 62], steps=3)
    assert torch.equal(a._req_to_token_host, b._req_to_token_host)
    assert b.req_to_token[slots[1], 4:7].tolist() == [50, 51, 52] and b.req_to_token[slots[2], 9:12].tolist() == [60, 61, 62]
    with pytest.raises(ValueError, match="positions"):
        b.set_decode_tokens([slots[0]], [14], [1, 2, 3], steps=3)  # (its last token at 16)
    with pytest.raises(ValueError, match="one of each"):
        b.set_decode_tokens([slots[0]], [1], [1, 2], steps=3)


def test_token_page_list_path_equals_general_path():
    g = torch.Generator().manual_seed(0)
    fast, general = TokenSlotAllocator(64), TokenSlotAllocator(64)
    held = []
    for _ in range(40):
        n = int(torch.randint(1, 5, (1,), generator=g))
        prefix = torch.randint(0, 9, (n,), generator=g).tolist()
        extend = torch.randint(0, 4, (n,), generator=g).tolist()
        got = fast.alloc_extend(prefix, extend)
        want = general.alloc_extend(torch.tensor(prefix), torch.tensor(extend))
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)
            held.append(got)
        if held and bool(torch.randint(0, 2, (1,), generator=g)):
            s = held.pop(int(torch.randint(0, len(held), (1,), generator=g)))
            fast.free(s)
            general.free(s)
        assert fast.used() == general.used() and fast.available() == general.available()
        assert torch.equal(fast._in_use, general._in_use)
    with pytest.raises(ValueError, match="differ in length"):
        fast.alloc_extend([1, 2], [1])
    with pytest.raises(ValueError, match=">= 0"):
        fast.alloc_extend([1], [-1])


def test_check_allocated_list_path_raises_like_tensor_path():
    alloc = SlotAllocator(6, first_index=1)
    got = alloc.alloc(3)
    assert torch.equal(alloc.check_allocated(got.tolist()), got)
    for bad, match in (([0], "out of range"), ([4], "not allocated"), ([1, 1], "more than once")):
        with pytest.raises(InvalidSlotError, match=match):
            alloc.check_allocated(bad)
    assert torch.equal(alloc.check_allocated([1, 1], unique=False), torch.tensor([1, 1]))


def _run(engine, prompts, params, late=None):
    """Step until done (``late``: (prompt, params) added after the third step); outputs by rid order."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if late is not None and steps == 3:
            rids.append(engine.add_request(*late))
    return [engine.pop_finished(rid).output for rid in rids]


def test_overlap_equals_sequential_steps(model):
    vocab = vocab_size(model)
    prompts = random_prompts([6, 11, 3, 8, 15], vocab, seed=21)
    late = (random_prompts([7], vocab, seed=22)[0], hc.SamplingParams(max_new_tokens=6))
    greedy_first = hf_greedy_cached(model, (KIND, SEED), prompts[0], 9)
    params = [
        hc.SamplingParams(max_new_tokens=9),
        hc.SamplingParams(max_new_tokens=4),
        hc.SamplingParams(max_new_tokens=7, do_sample=True, temperature=1.3, top_k=20, seed=5),
        # a stop token (prompt 0's 5th greedy token never appears in prompt 3's greedy run, or it does:
        # either way this request has stop ids, so no step is launched ahead while it runs)
        hc.SamplingParams(max_new_tokens=8, stop_token_ids=(greedy_first[4],)),
        hc.SamplingParams(max_new_tokens=10, do_sample=True, temperature=0.9, top_p=0.8, seed=9),
    ]
    runs = {}
    for overlap in (False, True):
        with make_engine(model, max_running_requests=4) as engine:
            initial = engine.pools.free_counts()
            engine.overlap = overlap
            outs = _run(engine, prompts, [dataclasses.replace(p) for p in params], late)
            # all requests without stop ids: every decode step but the last of a streak launched ahead
            solo = _run(engine, prompts[:2], [hc.SamplingParams(max_new_tokens=9)] * 2)
            stats = engine.stats()
            assert_pools_restored(engine, initial)
        runs[overlap] = (outs, solo, stats)
    (outs_seq, solo_seq, s_seq), (outs_ov, solo_ov, s_ov) = runs[False], runs[True]
    assert outs_ov == outs_seq and solo_ov == solo_seq
    for key in ("steps", "decode_steps", "extend_steps", "prefill_tokens", "decode_tokens", "generated_tokens",
                "requests_finished", "retractions"):
        assert s_ov[key] == s_seq[key], key
    assert s_seq["overlapped_steps"] == 0 and s_ov["overlapped_steps"] >= 7
    for p, o, n in zip(prompts[:2], solo_ov, (9, 9)):
        assert_greedy_equal(model, p, o, hf_greedy_cached(model, (KIND, SEED), p, n))
    assert_greedy_equal(model, prompts[0], outs_ov[0], greedy_first)


def test_close_with_a_step_in_flight(model):
    with make_engine(model) as engine:
        engine.add_request(random_prompts([5], vocab_size(model), seed=3)[0], hc.SamplingParams(max_new_tokens=8))
        for _ in range(3):
            engine.step()
        assert engine.stats()["overlapped_steps"] >= 1 and engine._ahead is not None
    assert engine._ahead is None


def test_host_overhead_benchmark_smoke(tmp_path, monkeypatch):
    """``benchmarks/host_overhead.py`` runs on CPU and writes every phase (no speed asserted)."""
    import json
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", [str(script), "--device", "cpu", "--tiny", "--batches", "1,2", "--prompt-len", "8",
                                      "--new-tokens", "10", "--out", str(out)])
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(script), run_name="__main__")
    result = json.loads(out.read_text())
    for overlap in ("off", "on"):
        for b in ("1", "2"):
            row = result["modes"]["eager"][f"overlap_{overlap}"][b]
            assert row["steps"] > 0 and row["model"] > 0 and row["host"] > 0
            assert set(row) >= {"schedule", "build_metadata", "dispatch", "model", "sample", "bookkeeping", "step"}


@pytest.mark.gpu
def test_overlap_with_full_cuda_graphs_equals_sequential_steps():
    """On the GPU with full decode graphs (buckets 1 -> 2 and 4): tokens (greedy and seeded
    sampling) equal with overlap off and on, steps are launched ahead and replay graphs."""
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = copy.deepcopy(cached_model(KIND, SEED)).to("cuda")
    prompts = random_prompts([9, 1, 30, 4], vocab_size(model), seed=31)
    params = [hc.SamplingParams(max_new_tokens=12),
              hc.SamplingParams(max_new_tokens=7, do_sample=True, temperature=1.2, seed=3),
              hc.SamplingParams(max_new_tokens=10),
              hc.SamplingParams(max_new_tokens=5, do_sample=True, top_k=10, seed=4)]
    runs = {}
    for overlap in (False, True):
        with make_engine(model, compile=True, cuda_graphs="full", cuda_graph_batch_sizes=(1, 4)) as engine:
            initial = engine.pools.free_counts()
            engine.overlap = overlap
            single = _run(engine, prompts[:1], [hc.SamplingParams(max_new_tokens=12)])
            batch = _run(engine, prompts, [dataclasses.replace(p) for p in params])
            assert_pools_restored(engine, initial)
            stats = engine.stats()
        assert stats["compile"]["cuda_graph_replays"] > 0 and stats["compile"]["recompiles"] == 0, stats["compile"]
        runs[overlap] = (single, batch, stats["overlapped_steps"])
    assert runs[True][:2] == runs[False][:2]
    assert runs[False][2] == 0 and runs[True][2] >= 10
