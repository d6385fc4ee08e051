"""CUDA graphs of the engine (hybrid_compile.compilation.cuda_graphs; engine/graph_setup.py captures them,
engine/runner.py replays them, engine/forward_batch.py builds steps into their buffers and pads steps).

CPU (CI):
- config resolution of ``cuda_graphs`` / ``compile`` and its errors; the engine refuses graphs
  on CPU.
- bucket defaults and selection.
- ``pad_requests`` against a brute-force construction of the padded metadata.
- ``GraphBuffers.fill`` against ``pad_requests`` on real ``ForwardBatchBuilder`` output of decode
  steps, and the eager model run over the filled buffers (padding rows included) gives the same
  logits and the same Mamba / KV pool updates as the unpadded step; the same for speculative
  TARGET_VERIFY steps (padding requests of the draft length, every token a logits row, the
  intermediate states of the real rows equal); the same steps sent to another rank as tensor
  parallelism's ``GRAPH`` command does (packed, unpacked into stale buffers) fill its buffers the
  same; which full graph a step replays.
- draft-tree verify graphs (speculative top-k > 1): the buffers a tree verify graph is captured
  with (every row a chain); on real tree verify steps, the buffers hold the step's metadata built
  without graphs (positions prefix + depth, tree mask, parents) row for row, padding rows chains,
  also as sent to another rank, and the model over them gives the step's logits and pool updates;
  the engine's own graph path of tree verify steps (key, build into the buffers, replay) with the
  graphs replaced by eager runs over the buffers gives HF's greedy tokens.

GPU (``@pytest.mark.gpu``): greedy tokens equal between eager ops, compiled, compiled + full
decode graphs, compiled + piecewise graphs and both (tiny Qwen3-Next and Bamba; single
prompts and a continuous batch whose decode batch sizes cross the buckets); zero graph breaks
and recompiles; stats show replays and fallbacks; our Triton kernels run under compile + graphs
(profiler); an exhausted KV pool (retraction) with graphs on; a forward that syncs with the host
(transformers' fp32 MoE fallback in NemotronH) fails at capture with a clear error;
speculative decoding (the target as its own draft, n-gram) replays full verify graphs with
greedy tokens equal to HF's generate and the non-speculative engine (draft trees:
``tests/test_speculative_tree.py::test_gpu_tree_engine_matches_hf_with_graphs``); an MoE family (Qwen3-Next
with MoE blocks) eager and compiled gives HF's greedy tokens.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.engine.forward_batch import pad_requests
from hybrid_compile.layers.context import ForwardContext, ForwardMetadata, ForwardMode, forward_context
from hybrid_compile.compilation import cuda_graphs as cg

from engine_models import (
    assert_pools_restored,
    cached_model,
    hf_greedy,
    hf_next_logits,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


# ---------------------------------------------------------------------------------------------
# config and buckets
# ---------------------------------------------------------------------------------------------


def test_config_cuda_graph_modes():
    cfg = hc.EngineConfig()
    assert cfg.resolved_cuda_graphs(CPU) == (False, False)
    assert cfg.resolved_cuda_graphs(CUDA) == (True, True)  # compile=None: on for CUDA
    assert hc.EngineConfig(compile=False).resolved_cuda_graphs(CUDA) == (False, False)
    assert hc.EngineConfig(cuda_graphs=True).resolved_cuda_graphs(CUDA) == (True, True)
    assert hc.EngineConfig(cuda_graphs="full").resolved_cuda_graphs(CUDA) == (True, False)
    assert hc.EngineConfig(cuda_graphs="piecewise").resolved_cuda_graphs(CUDA) == (False, True)
    assert hc.EngineConfig(cuda_graphs=False).resolved_cuda_graphs(CUDA) == (False, False)
    for mode in (True, "full", "piecewise"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            hc.EngineConfig(cuda_graphs=mode, compile=True).resolved_cuda_graphs(CPU)
        with pytest.raises(ValueError, match="needs the compiled forward"):
            hc.EngineConfig(cuda_graphs=mode, compile=False).resolved_cuda_graphs(CUDA)
    with pytest.raises(ValueError, match="cuda_graphs"):
        hc.EngineConfig.from_args(cuda_graphs="yes")
    for name in ("cuda_graph_batch_sizes", "piecewise_cuda_graph_tokens"):
        with pytest.raises(ValueError, match=name):
            hc.EngineConfig.from_args(**{name: (4, 0)})
        with pytest.raises(ValueError, match=name):
            hc.EngineConfig.from_args(**{name: ()})
    assert hc.EngineConfig.from_args(cuda_graph_batch_sizes=[1, 3]).cuda_graph_batch_sizes == (1, 3)


def test_engine_rejects_cuda_graphs_on_cpu():
    model = cached_model("qwen3_next_dense", 0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine(model, compile=True, cuda_graphs="full")


def test_capture_out_of_memory_names_the_memory_settings(monkeypatch):
    """A capture that runs out of device memory is a sizing problem, not a host sync: its error names
    memory_fraction / chunked_prefill_size / max_running_requests, not cuda_graphs=False."""
    from hybrid_compile.engine.config import EngineConfig
    from hybrid_compile.engine.graph_setup import CompiledGraphs

    graphs = object.__new__(CompiledGraphs)
    graphs.model, graphs.device, graphs.full, graphs.piecewise = torch.nn.Linear(2, 2), torch.device("cpu"), True, False
    graphs.config = EngineConfig(memory_fraction=0.5, chunked_prefill_size=8192, max_running_requests=64)

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 320.00 MiB.")

    monkeypatch.setattr(CompiledGraphs, "_capture_full", oom)
    with pytest.raises(RuntimeError, match="ran out of device memory") as info:
        graphs.capture_cuda_graphs(runner=None)
    msg = str(info.value)
    assert "memory_fraction=0.5" in msg and "chunked_prefill_size (now 8192)" in msg and "(now 64)" in msg
    assert "cuda_graphs=False" not in msg and "Tried to allocate 320.00 MiB" in msg
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    assert "while capturing the full graphs" not in msg  # (a CPU engine: no memory breakdown)

    # on a GPU the message breaks the allocated memory down (device figures stubbed here)
    from types import SimpleNamespace

    from hybrid_compile.engine import graph_setup

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=16 * gib))
    monkeypatch.setattr(graph_setup, "_device_bytes", lambda model, device: 6 * gib)
    graphs.device, graphs._capturing = torch.device("cuda"), "the piecewise graphs of 8192 tokens"
    msg = graphs._capture_oom_message(RuntimeError("CUDA out of memory."),
                                      SimpleNamespace(pools=SimpleNamespace(nbytes=lambda: 3 * gib)))
    assert ("while capturing the piecewise graphs of 8192 tokens (10.0 GiB allocated of 16.0 GiB: weights 6.0, "
            "pools 3.0, the rest 1.0 in captured graphs") in msg, msg


def test_device_bytes_counts_a_shared_storage_once():
    from hybrid_compile.engine.graph_setup import _device_bytes

    model = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Linear(8, 4, bias=False))
    packed = torch.zeros(64)
    model[0].weight.data = packed[:32].view(8, 4)  # two weights in one buffer, as the projection packing lays them
    model[1].weight.data = packed[32:].view(4, 8)
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    assert _device_bytes(model, torch.device("cpu")) == 64 * 4 + 3 * 8


def test_buckets():
    assert cg.default_decode_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert cg.default_decode_batch_sizes(1) == (1,)
    assert cg.default_decode_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert cg.default_decode_batch_sizes(300)[-3:] == (256, 288, 300)
    assert cg.default_token_buckets(2048, 16) == (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 2064)
    assert cg.default_token_buckets(64, 8) == (2, 4, 8, 16, 32, 64, 72)
    assert cg.normalize_buckets([8, 1, 3, 8]) == (2, 3, 8)
    assert cg.normalize_buckets([8, 1, 3, 8], minimum=1) == (1, 3, 8)
    buckets = (2, 4, 8)
    assert [cg.select_bucket(buckets, n) for n in range(1, 10)] == [2, 2, 4, 4, 8, 8, 8, 8, None]
    assert cg.logits_rows_for_tokens(64, 16) == 16 and cg.logits_rows_for_tokens(4, 16) == 4
    assert cg.logits_rows_for_tokens(8, 1) == 2
    # a bucket is replayed padded only up to the padding limit (else the step runs at its own size)
    assert cg.replays_bucket(4159 - 1024, 4096) and not cg.replays_bucket(4159, 8192)
    assert cg.replays_bucket(8192 - cg.MAX_PIECEWISE_PADDING, 8192)
    assert not cg.replays_bucket(8192 - cg.MAX_PIECEWISE_PADDING - 1, 8192)
    assert cg.replays_bucket(7, 8, max_padding=1) and not cg.replays_bucket(6, 8, max_padding=1)
    assert cg.replays_bucket(8, 8, max_padding=0)
    for bad in (-1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="piecewise_max_padding"):
            hc.EngineConfig.from_args(extra={"piecewise_max_padding": bad})
    assert hc.EngineConfig.from_args(extra={"piecewise_max_padding": 0}).extra["piecewise_max_padding"] == 0


# ---------------------------------------------------------------------------------------------
# padding and buffers
# ---------------------------------------------------------------------------------------------


def _metadata(mode, extend, prefix, slots_per_req, mamba, prompt):
    """A hand-built step: request i has prefix[i] cached and extend[i] new tokens, KV slots
    slots_per_req[i] (all of its tokens)."""
    b = len(extend)
    seq = [p + e for p, e in zip(prefix, extend)]
    qsl = [0]
    for e in extend:
        qsl.append(qsl[-1] + e)
    kvp = [0]
    for s in seq:
        kvp.append(kvp[-1] + s)
    i32 = dict(dtype=torch.int32)
    out_loc = [slots_per_req[i][prefix[i] + j] for i in range(b) for j in range(extend[i])]
    md = ForwardMetadata(
        mode=mode,
        positions=torch.tensor([prefix[i] + j for i in range(b) for j in range(extend[i])]),
        query_start_loc=torch.tensor(qsl, **i32),
        seq_lens=torch.tensor(seq, **i32),
        prefix_lens=torch.tensor(prefix, **i32),
        mamba_cache_indices=torch.tensor(mamba, **i32),
        has_initial_state=torch.tensor([p > 0 for p in prefix]),
        out_cache_loc=torch.tensor(out_loc),
        kv_indptr=torch.tensor(kvp, **i32),
        kv_indices=torch.tensor([s for req in slots_per_req for s in req], **i32),
        logits_indices=torch.tensor(qsl[1:]) - 1,
        extend_lens_cpu=list(extend),
        seq_lens_cpu=list(seq),
        prompt_lens=torch.tensor(prompt, **i32),
    )
    return torch.arange(10, 10 + qsl[-1]), md


def test_pad_requests_brute_force():
    ids, md = _metadata(ForwardMode.EXTEND, [3, 1], [0, 4], [[5, 6, 7], [8, 9, 10, 11, 12]], [1, 2], [3, 2])
    pids, p = pad_requests(ids, md, [2, 1], padding_slot=0)
    assert pids.tolist() == ids.tolist() + [0, 0, 0]
    assert p.positions.tolist() == [0, 1, 2, 4, 0, 1, 0]
    assert p.query_start_loc.tolist() == [0, 3, 4, 6, 7]
    assert p.seq_lens.tolist() == [3, 5, 2, 1]
    assert p.prefix_lens.tolist() == [0, 4, 0, 0]
    assert p.mamba_cache_indices.tolist() == [1, 2, -1, -1]
    assert p.has_initial_state.tolist() == [False, True, False, False]
    assert p.out_cache_loc.tolist() == [5, 6, 7, 12, -1, -1, -1]
    assert p.kv_indptr.tolist() == [0, 3, 8, 10, 11]
    assert p.kv_indices.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 0]
    assert p.logits_indices.tolist() == [2, 3, 5, 6]
    assert p.extend_lens_cpu == [3, 1, 2, 1] and p.seq_lens_cpu == [3, 5, 2, 1]
    assert p.prompt_lens.tolist() == [3, 2, 2, 1]
    for t in (p.query_start_loc, p.seq_lens, p.kv_indptr, p.kv_indices, p.mamba_cache_indices):
        assert t.dtype == torch.int32
    # fixed logits rows; nothing to pad
    _, p = pad_requests(ids, md, [3], padding_slot=0, num_logits=5)
    assert p.logits_indices.tolist() == [2, 3, 0, 0, 0] and p.batch_size == 3
    _, p = pad_requests(ids, md, [], padding_slot=0, num_logits=2)
    assert p.logits_indices.tolist() == [2, 3] and p.num_tokens == 4
    with pytest.raises(ValueError, match="do not fit"):
        pad_requests(ids, md, [1], padding_slot=0, num_logits=1)
    with pytest.raises(ValueError, match=">= 1 token"):
        pad_requests(ids, md, [0], padding_slot=0)


def _assert_buffers_equal_padded(buffers, key, ids, md):
    """The buffers hold exactly ``pad_requests`` of the step with requests of the graph's tokens
    per request (DECODE: 1; TARGET_VERIFY: the draft length, every token a logits row)."""
    bs, b, steps = key.batch_size, md.batch_size, key.tokens_per_request
    pids, p = pad_requests(ids, md, [steps] * (bs - b), buffers.padding_slot)
    view = buffers.metadata(key)
    assert torch.equal(buffers.input_ids[: bs * steps], pids)
    total = sum(p.seq_lens_cpu)
    for name in ("positions", "query_start_loc", "seq_lens", "prefix_lens", "mamba_cache_indices", "has_initial_state",
                 "out_cache_loc", "kv_indptr", "logits_indices", "prompt_lens"):
        got, want = getattr(view, name), getattr(p, name)
        if name == "logits_indices" and key.mode is ForwardMode.TARGET_VERIFY:
            want = torch.arange(bs * steps)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert torch.equal(view.kv_indices[:total], p.kv_indices)
    assert view.mode is key.mode and view.extend_lens_cpu == [steps] * bs
    if key.mode is ForwardMode.TARGET_VERIFY:
        assert view.draft_len == steps and view.verify_rows() == bs
    if not key.tree:
        assert view.tree_mask is None and view.tree_parents is None
        return
    # a draft tree: the step's rows as built without graphs, every padding row a chain (each token's
    # parent the one before, its mask bits those of the tokens up to itself)
    n, pads = md.num_tokens, bs - b
    chain_parents = [j - 1 for j in range(steps)]
    chain_bits = [int.from_bytes(((1 << (j + 1)) - 1).to_bytes(8, "little"), "little", signed=True) for j in range(steps)]
    assert view.tree_mask.dtype == torch.int64 and view.tree_parents.dtype == torch.int32
    assert view.tree_parents.shape == (bs, steps) and view.tree_parents.is_contiguous()
    assert torch.equal(view.tree_mask[:n], md.tree_mask) and torch.equal(view.tree_parents[:b], md.tree_parents)
    assert view.tree_mask[n:].tolist() == chain_bits * pads
    assert view.tree_parents[b:].tolist() == [chain_parents] * pads
    assert torch.equal(view.tree_parents, p.tree_parents)  # pad_requests pads a tree's rows with chains too


def _assert_sent_to_another_rank(buffers, key, ids, md, built_md):
    """Tensor parallelism's ``GRAPH`` command (distributed/step.py): the step built into ``buffers``,
    packed as rank 0 sends it and unpacked into another rank's stale buffers, fills them the same."""
    from hybrid_compile.distributed.step import graph_step, graph_step_targets, packed, unpack_into

    fields, tensors = graph_step(buffers, built_md)
    other = cg.GraphBuffers(buffers.max_batch, buffers.kv_indices.numel() // buffers.max_batch, CPU,
                            buffers.kv_indices.dtype, buffers.padding_slot, buffers.max_tokens_per_request)
    for t in other.outputs(cg.GraphKey(key.mode, other.max_batch, key.tokens_per_request)):
        t.fill_(7)  # stale values everywhere
    other.tree_mask.fill_(7)
    other.tree_parents.fill_(7)
    got_key, requests, targets = graph_step_targets(other, fields)
    unpack_into(targets, packed(tensors, CPU))
    assert got_key == key and requests == md.batch_size
    _assert_buffers_equal_padded(other, key, ids, md)


def _build_into(runner, buffers, key, batch, drafts=None):
    """The runner's metadata of ``batch`` built into ``buffers`` for the graph ``key``; checks the
    returned metadata are views of the buffers' first rows, marked with the key."""
    steps = key.tokens_per_request
    ids, md = runner.batch_builder.build_uniform(batch, key.mode, steps, drafts, None, graph=key, buffers=buffers)
    assert md.graph_key == key and md.batch_size == len(batch.requests)
    assert ids.data_ptr() == buffers.input_ids.data_ptr() and md.positions.data_ptr() == buffers.positions.data_ptr()
    assert md.kv_indices.data_ptr() == buffers.kv_indices.data_ptr()
    return ids, md


def test_graph_buffers_hold_padded_steps_and_eager_logits():
    """On real decode steps of the CPU engine, the runner's metadata built into a graph's buffers
    equal ``pad_requests`` of the general path's metadata (``ForwardBatchBuilder.build_extend``) up to the
    bucket, and the model over the buffers (rows up to the bucket) gives the step's logits and
    pool updates."""
    model = cached_model("qwen3_next_dense", 0)
    prompts = random_prompts([5, 9, 2], vocab_size(model), seed=3)
    checked = []
    with make_engine(model, max_running_requests=4) as engine:
        engine.overlap = False  # the step's ids from the requests (the general path's input)
        runner = engine.runner
        req_to_token = engine.pools.req_to_token.req_to_token
        buffers = cg.GraphBuffers(6, req_to_token.shape[1], CPU, req_to_token.dtype, engine.pools.kv.PADDING_SLOT)
        original = runner.forward
        mamba_pools = [t for pair in runner.mamba_caches.values() for t in pair]
        kv_pools = [t for pair in runner.kv_caches.values() for t in pair]

        def forward(batch, input_ids=None):
            if batch.mode is not ForwardMode.DECODE:
                return original(batch, input_ids=input_ids)
            before = [t.clone() for t in mamba_pools + kv_pools]
            logits = original(batch, input_ids=input_ids)
            after = [t.clone() for t in mamba_pools + kv_pools]
            for t, saved in zip(mamba_pools + kv_pools, before):
                t.copy_(saved)
            ids, md = runner.batch_builder.build_extend(batch)
            for bs in sorted({md.batch_size, md.batch_size + 1, 6}):
                key = cg.GraphKey(ForwardMode.DECODE, bs)
                for t in buffers.outputs(cg.GraphKey(ForwardMode.DECODE, 6)):  # stale values everywhere
                    t.fill_(7)
                _, built = _build_into(runner, buffers, key, batch)
                _assert_buffers_equal_padded(buffers, key, ids, md)
                _assert_sent_to_another_rank(buffers, key, ids, md, built)
                with torch.inference_mode(), forward_context(
                        ForwardContext(buffers.metadata(key), runner.kv_caches, runner.mamba_caches)):
                    padded = runner._model_forward(buffers.input_ids[:bs], buffers.positions[:bs],
                                                   buffers.logits_indices[:bs])
                torch.testing.assert_close(padded[: md.batch_size], logits, rtol=1e-5, atol=1e-5)
                for t, want in zip(mamba_pools + kv_pools, after):
                    torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-5)
                    t.copy_(want)  # every variant starts from the step's own result
                for t, saved in zip(mamba_pools + kv_pools, before):
                    t.copy_(saved)
            for t, want in zip(mamba_pools + kv_pools, after):
                t.copy_(want)
            checked.append(md.batch_size)
            if md.batch_size == 3:
                with pytest.raises(ValueError, match="does not fit"):
                    _build_into(runner, buffers, cg.GraphKey(ForwardMode.DECODE, 2), batch)
            return logits

        runner.forward = forward
        engine.generate_batch(prompts, max_new_tokens=4)
    assert set(checked) >= {3}


def _verify_graph_setup(engine, steps: int):
    """A speculative engine's runner (``steps`` tokens per verify request), the rows of its intermediate
    buffers, graph buffers of that many rows, and its pools and intermediate buffers (flat lists)."""
    runner = engine.runner
    assert runner.draft_len == steps
    req_to_token = engine.pools.req_to_token.req_to_token
    rows = min(conv.shape[0] for conv, _ in runner.intermediate_caches.values())
    buffers = cg.GraphBuffers(rows, req_to_token.shape[1], CPU, req_to_token.dtype, engine.pools.kv.PADDING_SLOT,
                              max_tokens_per_request=steps)
    pools = [t for pair in list(runner.mamba_caches.values()) + list(runner.kv_caches.values()) for t in pair]
    inter = [t for pair in runner.intermediate_caches.values() for t in pair]
    return runner, rows, buffers, pools, inter


def _assert_verify_over_buffers(runner, buffers, key, b, logits, pools_after, inter_after):
    """The eager model over a verify graph's buffers (every row up to the bucket, the speculative
    intermediate buffers in the context) gives the step's logits of its ``b`` requests at every
    verify position, the pools as the step left them and the real rows' intermediate states."""
    with torch.inference_mode(), forward_context(ForwardContext(
            buffers.metadata(key), runner.kv_caches, runner.mamba_caches, runner.intermediate_caches)):
        n = key.num_tokens
        padded = runner._model_forward(buffers.input_ids[:n], buffers.positions[:n], buffers.logits_indices[:n])
    steps = key.tokens_per_request
    assert padded.shape[0] == key.batch_size * steps
    torch.testing.assert_close(padded[: b * steps], logits, rtol=1e-5, atol=1e-5)
    for t, want in pools_after:
        torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-5)
    for t, want in inter_after:
        torch.testing.assert_close(t[:b], want[:b], rtol=1e-5, atol=1e-5)


def test_verify_graph_buffers_hold_padded_steps_and_eager_logits():
    """TARGET_VERIFY graphs (speculative decoding, k = 2 drafts: 3 tokens per request): on real
    verify steps of the CPU engine, the runner's metadata built into a graph's buffers equal
    ``pad_requests`` of the general path's metadata with 3-token padding requests, and the model
    over the buffers (rows up to the bucket, the speculative intermediate buffers in the context)
    gives the step's logits at every verify position, the same KV / Mamba pool updates (none of
    the main Mamba state) and the same intermediate states of the real rows."""
    model = cached_model("qwen3_next_dense", 0)
    prompts = random_prompts([5, 9, 2], vocab_size(model), seed=3) + [[5, 9, 14, 3] * 4]
    steps, checked = 3, []
    spec = dict(method="ngram", num_draft_tokens=steps - 1, ngram_max=3, ngram_min=1)
    with make_engine(model, max_running_requests=4, speculative=spec) as engine:
        runner, rows, buffers, pools, inter = _verify_graph_setup(engine, steps)
        build, original = runner.build_verify_metadata, runner.forward_verify
        step = {}

        def build_verify_metadata(batch, drafts):
            step.update(batch=batch, drafts=drafts)
            return build(batch, drafts)

        def forward_verify(ids, md):
            before = [t.clone() for t in pools]
            logits = original(ids, md)
            after = [t.clone() for t in pools]
            inter_after = [t.clone() for t in inter]
            b = md.batch_size
            batch, drafts = step["batch"], step["drafts"]
            _, want = runner.batch_builder.build_extend(batch)
            want = dataclasses.replace(want, logits_indices=torch.arange(md.num_tokens), draft_len=steps)
            for bs in sorted({b, b + 1, rows}):
                for t, saved in zip(pools, before):
                    t.copy_(saved)
                for t in inter:
                    t.fill_(float("nan"))  # the real rows must be written again, padding rows may hold anything
                key = cg.GraphKey(ForwardMode.TARGET_VERIFY, bs, steps)
                _, built = _build_into(runner, buffers, key, batch, drafts)
                _assert_buffers_equal_padded(buffers, key, ids, want)
                _assert_sent_to_another_rank(buffers, key, ids, want, built)
                _assert_verify_over_buffers(runner, buffers, key, b, logits, zip(pools, after), zip(inter, inter_after))
            for t, want_t in zip(pools + inter, after + inter_after):
                t.copy_(want_t)
            # a graph of another draft length, or a DECODE graph, does not take a verify step
            for key in (cg.GraphKey(ForwardMode.TARGET_VERIFY, rows, 2), cg.GraphKey(ForwardMode.DECODE, rows)):
                with pytest.raises(ValueError, match="does not fit"):
                    runner.batch_builder.build_uniform(batch, ForwardMode.TARGET_VERIFY, steps, drafts, None,
                                                       graph=key, buffers=buffers)
            checked.append(b)
            return logits

        runner.build_verify_metadata, runner.forward_verify = build_verify_metadata, forward_verify
        got = engine.generate_batch(prompts, max_new_tokens=6)
        assert engine.stats()["speculative"]["verify_steps"] > 0
    with make_engine(model, max_running_requests=4) as plain:
        assert got == plain.generate_batch(prompts, max_new_tokens=6)
    assert max(checked) == 4


def test_tree_verify_graph_buffers_hold_padded_steps_and_eager_logits():
    """Draft-tree TARGET_VERIFY graphs (speculative top-k 2, depth 2, 4 nodes: 5 tokens per request,
    a replay draft): on real tree verify steps of the CPU engine, the metadata built into a tree
    graph's buffers equal the step's own (built without graphs: positions ``prefix + depth``, tree
    mask, parents) row for row, padding rows verifying a chain; sent to another rank they fill its
    stale buffers the same; the model over the buffers gives the step's logits, KV / Mamba pool
    updates and the real rows' intermediate states. Greedy tokens equal HF's."""
    from hybrid_compile.engine.speculative import ReplayDraft

    model = cached_model("qwen3_next_dense", 0)
    prompts = random_prompts([5, 9, 2], vocab_size(model), seed=3)
    new = 6
    expected = [hf_greedy(model, p, new) for p in prompts]
    source = ReplayDraft({tuple(p): e for p, e in zip(prompts, expected)}, q=0.5, vocab_size=vocab_size(model), seed=1)
    spec = dict(method="custom", draft_source=source, num_draft_tokens=2, topk=2, num_tree_nodes=4)
    steps, checked = 5, []
    V = ForwardMode.TARGET_VERIFY
    with make_engine(model, max_running_requests=3, speculative=spec) as engine:
        runner, rows, buffers, pools, inter = _verify_graph_setup(engine, steps)
        build, original = runner.build_verify_metadata, runner.forward_verify
        step = {}

        def build_verify_metadata(batch, drafts, tree=None):
            assert tree is not None
            step.update(batch=batch, drafts=drafts, tree=tree)
            return build(batch, drafts, tree)

        def forward_verify(ids, md):
            assert md.graph_key is None and md.tree_mask is not None  # the oracle: built without graphs
            before = [t.clone() for t in pools]
            logits = original(ids, md)
            after = [t.clone() for t in pools]
            inter_after = [t.clone() for t in inter]
            b = md.batch_size
            batch, drafts, tree = step["batch"], step["drafts"], step["tree"]
            for bs in sorted({b, b + 1, rows}):
                for t, saved in zip(pools, before):
                    t.copy_(saved)
                for t in inter:
                    t.fill_(float("nan"))  # the real rows must be written again, padding rows may hold anything
                for t in (*buffers.outputs(cg.GraphKey(V, rows, steps)), buffers.tree_mask, buffers.tree_parents):
                    t.fill_(7)  # stale values everywhere
                key = cg.GraphKey(V, bs, steps, tree=True)
                built_ids, built = runner.batch_builder.build_tree_verify(batch, drafts, tree, graph=key,
                                                                          buffers=buffers)
                assert built.graph_key == key and built.batch_size == b
                assert built.positions.data_ptr() == buffers.positions.data_ptr()
                assert built.tree_mask.data_ptr() == buffers.tree_mask.data_ptr()
                assert built.tree_parents.data_ptr() == buffers.tree_parents.data_ptr()
                assert torch.equal(built.positions, md.positions) and torch.equal(built.tree_mask, md.tree_mask)
                assert torch.equal(built.tree_parents, md.tree_parents) and torch.equal(built_ids, ids)
                _assert_buffers_equal_padded(buffers, key, ids, md)
                _assert_sent_to_another_rank(buffers, key, ids, md, built)
                _assert_verify_over_buffers(runner, buffers, key, b, logits, zip(pools, after), zip(inter, inter_after))
            for t, want_t in zip(pools + inter, after + inter_after):
                t.copy_(want_t)
            # a chain verify graph does not take a tree step
            with pytest.raises(ValueError, match="chain verify graph"):
                runner.batch_builder.build_tree_verify(batch, drafts, tree, graph=cg.GraphKey(V, rows, steps),
                                                       buffers=buffers)
            checked.append(b)
            return logits

        runner.build_verify_metadata, runner.forward_verify = build_verify_metadata, forward_verify
        got = engine.generate_batch(prompts, max_new_tokens=new)
        assert engine.stats()["speculative"]["verify_steps"] > 0
    assert got == expected
    assert max(checked) == 3


class _EagerReplay:
    """A captured graph's stand-in on CPU: ``replay()`` runs the forward over the graph's buffers
    (what a CUDA graph of it replays) into the output tensor the "capture" returned."""

    def __init__(self, full: cg.FullGraphRunner, key: cg.GraphKey, out: torch.Tensor) -> None:
        self.full, self.key, self.out = full, key, out

    def replay(self) -> None:
        self.out.copy_(self.full._run(self.key))


def test_tree_verify_steps_replay_full_graphs_through_the_engine():
    """The engine's own path of a draft-tree verify step with full graphs, on CPU (the graphs replaced
    by :class:`_EagerReplay`, everything else as on CUDA): each verify step picks a tree verify graph
    (``key_for``), is built into its buffers (the forward batch builder) and replays it (the model
    runner); the greedy tokens equal HF's, and every verify step replayed a graph."""
    from hybrid_compile.engine.speculative import ReplayDraft

    model = cached_model("qwen3_next_dense", 0)
    prompts = random_prompts([5, 9, 2, 30], vocab_size(model), seed=5)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    source = ReplayDraft({tuple(p): e for p, e in zip(prompts, expected)}, q=0.5, vocab_size=vocab_size(model), seed=2)
    spec = dict(method="custom", draft_source=source, num_draft_tokens=2, topk=2, num_tree_nodes=4)
    with make_engine(model, max_running_requests=3, speculative=spec) as engine:
        runner, rows, buffers, _, _ = _verify_graph_setup(engine, 5)
        full = cg.FullGraphRunner(runner._model_forward, buffers, (rows,), runner.kv_caches, runner.mamba_caches, None,
                                  verify_batch_sizes=(2, rows), draft_len=5,
                                  intermediate_caches=runner.intermediate_caches, tree=True)
        with torch.inference_mode():
            for key in full.keys():  # the "capture": a run over padding rows only, which touches no pool
                buffers.reset(key)
                out = full._run(key)
                full.graphs[key] = (_EagerReplay(full, key, out), out)
        assert sorted(k.batch_size for k in full.graphs if k.tree) == [2, rows]
        runner.graphs.full_graphs = runner.batch_builder.full_graphs = full
        got = engine.generate_batch(prompts, max_new_tokens=8)
        spec_stats = engine.stats()["speculative"]
    assert got == expected
    assert full.verify_replays == spec_stats["verify_steps"] > 0 and spec_stats["tree_kv_moves"] > 0


def test_full_graph_keys_for_decode_and_verify():
    """Which full graph a step replays (no CUDA needed: nothing is captured)."""
    buffers = cg.GraphBuffers(4, 16, CPU, torch.int32, 0, max_tokens_per_request=3)
    inter = {0: (torch.zeros(5, 3, 1, 1), torch.zeros(5, 3, 1))}
    runner = cg.FullGraphRunner(None, buffers, (1, 4), {}, {}, None, verify_batch_sizes=(2, 4), draft_len=3,
                                intermediate_caches=inter)
    V, D = ForwardMode.TARGET_VERIFY, ForwardMode.DECODE
    assert runner.keys() == [cg.GraphKey(V, 4, 3), cg.GraphKey(V, 2, 3), cg.GraphKey(D, 4), cg.GraphKey(D, 1)]
    for b, bs in ((1, 2), (2, 2), (3, 4), (4, 4)):
        assert runner.key_for(V, b, 3) == cg.GraphKey(V, bs, 3)
    assert runner.key_for(V, 2, 2) is None  # another draft length
    assert runner.key_for(V, 5, 3) is None  # larger than every bucket
    assert runner.key_for(D, 3, 1) == cg.GraphKey(D, 4)
    # batch 1 decodes in its own graph (of the forward specialised to one token), not in the bucket of 2
    assert runner.key_for(D, 1, 1) == cg.GraphKey(D, 1)
    assert runner.key_for(ForwardMode.EXTEND, 1, 2) is None
    with pytest.raises(ValueError, match="intermediate buffers"):
        cg.FullGraphRunner(None, cg.GraphBuffers(8, 16, CPU, torch.int32, 0, 3), (8,), {}, {}, None,
                           verify_batch_sizes=(8,), draft_len=3, intermediate_caches=inter)
    with pytest.raises(ValueError, match="draft_len 4"):
        cg.FullGraphRunner(None, buffers, (4,), {}, {}, None, verify_batch_sizes=(4,), draft_len=4)
    # draft trees: tree verify graphs, which chain verify steps do not replay (nor tree steps chain graphs)
    assert runner.key_for(V, 3, 3, tree=True) is None
    trees = cg.FullGraphRunner(None, buffers, (1, 4), {}, {}, None, verify_batch_sizes=(2, 4), draft_len=3,
                               intermediate_caches=inter, tree=True)
    assert trees.keys() == [cg.GraphKey(V, 4, 3, True), cg.GraphKey(V, 2, 3, True), cg.GraphKey(D, 4), cg.GraphKey(D, 1)]
    assert trees.key_for(V, 3, 3, tree=True) == cg.GraphKey(V, 4, 3, True)
    assert trees.key_for(V, 3, 3) is None and trees.key_for(D, 3, 1) == cg.GraphKey(D, 4)
    with pytest.raises(ValueError, match="TARGET_VERIFY graph"):
        buffers.metadata(cg.GraphKey(D, 4, 1, True))


def test_tree_graph_buffers_capture_layout():
    """What a tree verify graph is captured with (``GraphBuffers.reset`` then ``metadata``): every row a
    padding request verifying a chain; views of the tree buffers, contiguous ``[bs, L]`` parents for
    any ``L`` up to the buffers' tokens per request; a chain verify graph carries no tree metadata."""
    V = ForwardMode.TARGET_VERIFY
    buffers = cg.GraphBuffers(4, 16, CPU, torch.int32, 0, max_tokens_per_request=3)
    for bs, steps in ((4, 3), (2, 2), (3, 1)):
        key = cg.GraphKey(V, bs, steps, tree=True)
        buffers.tree_mask.fill_(7)
        buffers.tree_parents.fill_(7)
        buffers.reset(key)
        md = buffers.metadata(key)
        assert md.tree_mask.data_ptr() == buffers.tree_mask.data_ptr()
        assert md.tree_parents.data_ptr() == buffers.tree_parents.data_ptr()
        assert md.tree_parents.shape == (bs, steps) and md.tree_parents.is_contiguous()
        assert md.tree_parents.tolist() == [[j - 1 for j in range(steps)]] * bs
        assert md.tree_mask.tolist() == [(1 << (j + 1)) - 1 for j in range(steps)] * bs
        assert md.positions.tolist() == list(range(steps)) * bs and md.mamba_cache_indices.tolist() == [-1] * bs
        assert len(buffers.step_tensors(key, bs * steps)) == len(buffers.outputs(key)) + 2
    chain = buffers.metadata(cg.GraphKey(V, 4, 3))
    assert chain.tree_mask is None and chain.tree_parents is None
    assert len(buffers.step_tensors(cg.GraphKey(V, 4, 3), 12)) == len(buffers.outputs(cg.GraphKey(V, 4, 3)))
    with pytest.raises(ValueError, match="not a draft-tree verify graph"):
        buffers.tree_outputs(cg.GraphKey(V, 4, 3))
    with pytest.raises(ValueError, match="tree_rows"):
        buffers.tree_rows(cg.GraphKey(V, 2, 3, True), [[-1, 0, 1]] * 3, [[1, 3, 7]] * 3)
    # the rows of the step, then chains: 64 tokens per request, the last one's bits the sign bit too
    parents, bits = cg.GraphBuffers.tree_rows(cg.GraphKey(V, 2, 64, True), [[-1] + [0] * 63], [[1] + [3] * 63])
    assert parents[:64] == [-1] + [0] * 63 and bits[:64] == [1] + [3] * 63
    assert parents[64:] == list(range(-1, 63)) and bits[64:-1] == [(1 << (j + 1)) - 1 for j in range(63)]
    assert bits[-1] == -1


# ---------------------------------------------------------------------------------------------
# GPU: the engine with graphs
# ---------------------------------------------------------------------------------------------

# decode buckets (1 -> 2), 4: batches of 5..8 decode requests fall back; token buckets up to 64
# (the chunked prefill size is 64, so a full chunk plus decode tokens falls back)
GRAPH_KW = dict(cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
MODES = {
    "eager": dict(compile=False),
    "compiled": dict(compile=True, cuda_graphs=False),
    "full": dict(compile=True, cuda_graphs="full", **GRAPH_KW),
    "piecewise": dict(compile=True, cuda_graphs="piecewise", **GRAPH_KW),
    "both": dict(compile=True, cuda_graphs=True, **GRAPH_KW),
    # a step replays a bucket only with at most 3 padding tokens (one request's decode: bucket 4), else the
    # compiled forward runs at its own size (the 8 requests' decode: 8 tokens, bucket 16)
    "piecewise_unpadded": dict(compile=True, cuda_graphs="piecewise", extra={"piecewise_max_padding": 3}, **GRAPH_KW),
}


def _gpu_model(kind: str):
    if kind in ("bamba", "nemotron_h"):
        from mamba2_models import BUILDERS

        model = BUILDERS[kind](0)
    else:
        model = copy.deepcopy(cached_model(kind, 0))
    return model.to(CUDA)


def _run_mode(model, mode: str, **extra):
    prompts = random_prompts([37, 1, 90, 5, 64, 3, 20, 11], vocab_size(model), seed=7)
    singles = random_prompts([1, 130], vocab_size(model), seed=9)
    new = 10
    with make_engine(model, **MODES[mode], **extra) as engine:
        initial = engine.pools.free_counts()
        single = [engine.generate(torch.tensor([p], device=CUDA), max_new_tokens=new)[0, len(p):].tolist()
                  for p in singles]
        batch = engine.generate_batch(prompts, max_new_tokens=new)
        assert_pools_restored(engine, initial)
        stats = engine.stats()["compile"]
    return single + batch, stats


_eager_tokens: dict[str, list] = {}


def _eager_reference(kind: str, model) -> list:
    """The eager engine's tokens of :func:`_run_mode` for ``kind``, run once per test process (the
    modes below are separate tests so that pytest-xdist workers compile them in parallel)."""
    if kind not in _eager_tokens:
        _eager_tokens[kind] = _run_mode(model, "eager")[0]
    return _eager_tokens[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [pytest.param("qwen3_next_dense", marks=pytest.mark.smoke), "bamba"])
@pytest.mark.parametrize("mode", ["compiled", "full", "piecewise", "both", "piecewise_unpadded"])
def test_greedy_equal_across_modes(kind, mode):
    model = _gpu_model(kind)
    reference = _eager_reference(kind, model)
    got, stats = _run_mode(model, mode)
    assert got == reference, f"{kind} {mode}: {got} != eager {reference}"
    assert stats["graphs"] == 1 + stats["one_token_graph"], stats
    assert stats["recompiles"] == 0 and stats["graph_breaks"] == 0, stats
    if mode in ("full", "both"):  # batch 1: a graph of the forward compiled for one token
        assert stats["decode_batch_sizes"] == [4, 1] and stats["full_graphs"] == 2 and stats["one_token_graph"]
        assert stats["cuda_graph_replays"] > 0, stats
    if mode in ("piecewise", "both", "piecewise_unpadded"):
        assert stats["token_buckets"] == [4, 16, 64] and stats["piecewise_graphs"] == 3 * stats["pieces"]
        assert stats["piecewise_replays"] > 0, stats
    assert (stats["unpadded_steps"] > 0) == (mode == "piecewise_unpadded"), stats
    if mode != "compiled":
        assert stats["eager_fallbacks"] > 0 and stats["capture_seconds"] > 0, stats


@pytest.mark.gpu
def test_our_triton_kernels_run_under_graphs():
    """The profiler sees our Triton kernels (attention decode/extend, conv, GDN recurrent and
    chunked, the skinny matmul of the projections at decode) inside the full decode graphs and
    between the piecewise graphs."""
    model = _gpu_model("qwen3_next_dense")
    prompts = random_prompts([20, 3], vocab_size(model), seed=5)
    with make_engine(model, **MODES["both"]) as engine:
        engine.generate_batch(prompts, max_new_tokens=2)  # warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate_batch(prompts, max_new_tokens=4)
            engine.generate_batch(prompts[:1], max_new_tokens=4)  # batch 1: the one-row skinny matmuls
            torch.cuda.synchronize()
        stats = engine.stats()["compile"]
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    assert stats["cuda_graph_replays"] > 0 and stats["piecewise_replays"] > 0
    for kernel in ("_decode_kernel", "_extend_kernel", "_store_kv_kernel", "_conv1d_update_kernel",
                   "_gdn_recurrent_kernel", "_chunk_output_kernel", "_skinny_mm_kernel"):
        assert any(kernel in n for n in names), f"{kernel} not among the CUDA kernels: {sorted(names)[:60]}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_next_dense", "bamba"])
@pytest.mark.parametrize("mode", ["both", "eager"])
def test_no_triton_compiles_after_wrap(kind, mode):
    """After ``wrap`` (its kernel warm-up and graph captures), a continuous batch of varied batch
    sizes and lengths with prefix-cache hits, checkpoints and mixed steps JIT-compiles no Triton
    kernel: no constexpr or specialisation of ours depends on the batch's shape (each compile
    costs about a second, inside some request's time to first token)."""
    from hybrid_compile.compilation.compile_counts import TritonCompiles

    model = _gpu_model(kind)
    vocab = vocab_size(model)
    shared = random_prompts([150], vocab, seed=1)[0]
    prompts = random_prompts([5, 33, 70, 1, 129, 17, 260, 9, 64, 48, 3], vocab, seed=2)
    prompts += [shared[: 140 + i] + p[:7] for i, p in enumerate(prompts[:5])]
    with make_engine(model, **MODES[mode], max_total_tokens=4096, max_running_requests=8,
                     chunked_prefill_size=96) as engine:
        with TritonCompiles() as compiles:
            for count in (1, 3, 16):
                engine.generate_batch(prompts[:count], max_new_tokens=5)
        hits = engine.stats()["prefix_cache"]["admitted_hit_tokens"]
    assert hits > 0
    assert compiles.total == 0, compiles.by_kernel


@pytest.mark.gpu
def test_pool_exhaustion_retracts_with_graphs():
    model = _gpu_model("qwen3_next_dense")
    prompts = random_prompts([60, 58, 62, 55, 61, 59, 63, 57], vocab_size(model), seed=13)
    kw = dict(max_total_tokens=200, max_running_requests=8, chunked_prefill_size=64)
    with make_engine(model, compile=False, **kw) as eager:
        expected = eager.generate_batch(prompts, max_new_tokens=20)
    with make_engine(model, **MODES["both"], **kw) as engine:
        initial = engine.pools.free_counts()
        got = engine.generate_batch(prompts, max_new_tokens=20)
        assert_pools_restored(engine, initial)
        stats = engine.stats()
    assert stats["retractions"] > 0
    assert stats["compile"]["cuda_graph_replays"] > 0
    assert got == expected


@pytest.mark.gpu
def test_capture_of_a_host_syncing_forward_fails_clearly():
    """transformers' fp32 grouped-mm fallback of NemotronH's MoE calls ``.tolist()``: on that path
    (``fused_moe=False``) no graph, and the error names ``fused_moe=True``, whose experts path holds
    no host sync: with it (the default on CUDA) the same fp32 model captures full graphs and serves
    the eager engine's greedy tokens."""
    model = _gpu_model("nemotron_h")
    graphs = dict(compile=True, cuda_graphs="full", cuda_graph_batch_sizes=(2,))
    with pytest.raises(RuntimeError, match="CUDA graph capture.*cuda_graphs=False.*fused_moe=True"):
        make_engine(model, **graphs, fused_moe=False)
    prompts = random_prompts([5, 33], vocab_size(model), seed=4)
    with make_engine(model, compile=False, cuda_graphs=False) as eager:
        expected = eager.generate_batch(prompts, max_new_tokens=6)
    with make_engine(model, **graphs) as engine:
        got = engine.generate_batch(prompts, max_new_tokens=6)
        stats = engine.stats()
    assert stats["fused_moe_modules"] > 0 and stats["compile"]["cuda_graph_replays"] > 0, stats["compile"]
    assert got == expected


def _assert_greedy_close(cpu_model, prompt: list[int], got: list[int], expected: list[int], what: str) -> None:
    """``got`` (the engine on the GPU) == ``expected`` (HF's greedy tokens of the same weights on
    the CPU, the path the CPU tests check the engine against), except a divergence where HF's
    top-2 logits are within CPU/GPU rounding (1e-4 relative) of each other and the engine picked
    one of them (tokens after it are not compared: the sequences differ from there)."""
    assert len(got) == len(expected), f"{what}: {got} vs HF {expected}"
    i = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if i is None:
        return
    logits = hf_next_logits(cpu_model, prompt + expected[:i])
    top = torch.topk(logits, 2)
    gap = float(top.values[0] - top.values[1])
    assert got[i] in top.indices.tolist() and gap <= 1e-4 * max(1.0, float(top.values[0].abs())), (
        f"{what}: engine diverges from HF greedy at new token {i} (engine {got[i]}, HF {expected[i]}, top-2 logits "
        f"{top.values.tolist()} at {top.indices.tolist()}):\n  engine {got}\n  HF     {expected}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["draft_self", "ngram"])
@pytest.mark.parametrize("kind", ["qwen3_next_dense", "bamba"])
def test_speculative_verify_replays_full_graphs(kind, method):
    """Speculative decoding with CUDA graphs: verify steps of <= 4 requests replay full TARGET_VERIFY
    graphs (k = 3: 4 tokens per request; buckets 2 and 4), larger ones run the compiled forward;
    greedy tokens equal HF's generate and the non-speculative engine; pools all free afterwards."""
    model = _gpu_model(kind)
    cpu_model = copy.deepcopy(model).to(CPU)
    prompts = random_prompts([37, 1, 90, 5, 64, 3], vocab_size(model), seed=7) + [[5, 9, 14, 3] * 5]
    single = random_prompts([20], vocab_size(model), seed=9)[0]
    new, k = 10, 3
    expected = [hf_greedy(cpu_model, p, new) for p in [single] + prompts]
    spec = (dict(method="draft_model", draft_model=model, num_draft_tokens=k) if method == "draft_self"
            else dict(method="ngram", num_draft_tokens=k, ngram_max=3, ngram_min=1))
    with make_engine(model, **MODES["both"]) as engine:
        plain = ([engine.generate(torch.tensor([single], device=CUDA), max_new_tokens=new)[0, len(single):].tolist()]
                 + engine.generate_batch(prompts, max_new_tokens=new))
    with make_engine(model, **MODES["both"], speculative=spec) as engine:
        initial = engine.pools.free_counts()
        got = ([engine.generate(torch.tensor([single], device=CUDA), max_new_tokens=new)[0, len(single):].tolist()]
               + engine.generate_batch(prompts, max_new_tokens=new))
        assert_pools_restored(engine, initial)
        stats = engine.stats()
    for p, g, pl, e in zip([single] + prompts, got, plain, expected):
        _assert_greedy_close(cpu_model, p, g, e, f"{kind} {method} speculative")
        _assert_greedy_close(cpu_model, p, pl, e, f"{kind} plain")
    c, s = stats["compile"], stats["speculative"]
    assert c["graphs"] == 2 and c["one_token_graph"] and c["recompiles"] == 0 and c["graph_breaks"] == 0, c
    assert c["decode_batch_sizes"] == [4, 1] and c["verify_batch_sizes"] == [4, 2], c
    assert c["full_graphs"] == 4 and c["capture_seconds"] > 0, c
    assert c["verify_graph_replays"] > 0, c
    assert s["verify_steps"] > 0 and s["drafted"] == s["verified_requests"] * k, s
    if method == "draft_self":
        assert s["acceptance_rate"] > 0.9, s  # the target drafting for itself (up to GPU near-ties)


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_moe_family_on_gpu_matches_hf(mode):
    """An MoE family on the GPU (Qwen3-Next with MoE blocks, fp32): the eager engine and the compiled
    forward give HF's greedy tokens on the CPU (up to CPU/GPU near-ties), pools all free afterwards.
    No CUDA graphs: transformers' fp32 expert path syncs with the host (the NemotronH test above)."""
    cpu_model = cached_model("qwen3_next_moe", 0)
    model = copy.deepcopy(cpu_model).to(CUDA)
    prompts = random_prompts([37, 1, 90, 5], vocab_size(model), seed=7)
    new = 8
    expected = [hf_greedy(cpu_model, p, new) for p in prompts]
    with make_engine(model, **MODES[mode]) as engine:
        initial = engine.pools.free_counts()
        got = engine.generate_batch(prompts, max_new_tokens=new)
        assert_pools_restored(engine, initial)
        stats = engine.stats()["compile"]
    for p, g, e in zip(prompts, got, expected):
        _assert_greedy_close(cpu_model, p, g, e, f"qwen3_next_moe {mode}")
    if mode == "compiled":
        assert stats["recompiles"] == 0 and stats["graph_breaks"] == 0, stats
