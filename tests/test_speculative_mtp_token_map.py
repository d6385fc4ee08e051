"""MTP drafts over a draft token map (``SpeculativeConfig.draft_token_map``, issue 27): the MTP
head's LM head becomes its own linear of the map's rows of the target's, its picks are mapped
back to token ids on the device (eager, window and proposal-graph paths, chains and trees).

- A map of the whole vocabulary (a permutation): every proposal equals the engine's without a map;
  greedy equals HF's.
- A map of half the vocabulary: every draft token is an id of the map; greedy still equals HF's
  ``generate`` and the non-speculative engine (verification keeps it exact), chains k = 1 and 3
  (compiled, no graph break) and a draft tree (topk 2), with the prefix cache and chunked prefill.
- The proposal graphs' body without a capture equals the eager window path with the same map.
- Errors: another method, bad contents, ids outside the vocabulary (tensor parallelism:
  tests/test_tensor_parallel_mtp.py's ``@token_map`` case).
- ``gpu``: the proposal graphs captured, with the map: proposals equal the eager path's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.engine.speculative.token_map import read_token_map

from engine_models import hf_greedy, random_prompts, single_threaded
from mtp_models import (ENGINE_ARGS, assert_compiled_without_breaks, assert_greedy_with_continuations,
                        checkpoint_vocab_size, finish_engine, mtp_checkpoint_fixture, record_proposals)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)

NEW = 8


checkpoint = mtp_checkpoint_fixture("qwen3_next_moe")
dense_checkpoint = mtp_checkpoint_fixture("qwen3_5")  # (a dense head: CUDA graphs capture it in fp32)


def _map(path, fraction: float, seed: int = 0) -> torch.Tensor:
    """``fraction`` of the vocabulary's ids, in a random order."""
    v = checkpoint_vocab_size(path)
    return torch.randperm(v, generator=torch.Generator().manual_seed(seed))[: int(v * fraction)]


def _engine(path, k, token_map=None, device="cpu", topk=1, **kw):
    spec = dict(method="mtp", num_draft_tokens=k, topk=topk, draft_token_map=token_map)
    return hc.from_pretrained(path, dtype=torch.float32, device=device, tokenizer=False, speculative=spec,
                              **{**ENGINE_ARGS, **kw})


def _record_tree_tokens(engine) -> list:
    """Every draft tree's tokens of the engine's draft source from now on."""
    seen = []
    source = engine.speculative.source
    propose_tree = source.propose_tree

    def recording(requests, depth, topk, budget):
        trees = propose_tree(requests, depth, topk, budget)
        seen.extend(t.tokens for t in trees)
        return trees

    source.propose_tree = recording
    return seen


def test_whole_vocabulary_map_proposes_as_without_a_map(checkpoint):
    """A permutation of every id: the head's logits are the full head's columns reordered, so
    every proposal (argmax mapped back) equals the engine's without a map; greedy equals HF's."""
    prompts = random_prompts((5, 40), checkpoint_vocab_size(checkpoint), seed=3)
    runs = []
    for token_map in (_map(checkpoint, 1.0, seed=1), None):
        engine = _engine(checkpoint, 3, token_map, enable_prefix_cache=True)
        proposals = record_proposals(engine)
        stats = assert_greedy_with_continuations(engine, prompts, NEW)
        runs.append((proposals, stats["speculative"]))
        finish_engine(engine)
    (got, with_map), (want, without) = runs
    assert got == want and len(got) >= 2 * len(prompts)
    assert with_map["draft_token_map_size"] == checkpoint_vocab_size(checkpoint)
    assert without["draft_token_map_size"] is None


@pytest.mark.parametrize("k,topk,compile_", [(1, 1, False), (3, 1, True), (3, 2, False)])
def test_half_vocabulary_map_drafts_in_map_greedy_exact(checkpoint, k, topk, compile_):
    """Half the vocabulary: every draft (chain or tree node) is an id of the map; greedy equals
    HF's and the non-speculative engine's with the prefix cache, chunked prefill (a 40-token prompt
    over chunks of 32) and, compiled, no graph break; the head's LM head holds the map's rows of
    the target's, whose own LM head is untouched."""
    token_map = _map(checkpoint, 0.5)
    engine = _engine(checkpoint, k, token_map.tolist(), topk=topk, compile=compile_, enable_prefix_cache=True)
    model, head = engine.model, engine.mtp_head
    assert head.lm_head is not model.lm_head and model.lm_head.weight.shape[0] == checkpoint_vocab_size(checkpoint)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[token_map])
    chains = record_proposals(engine)
    trees = _record_tree_tokens(engine)
    prompts = random_prompts((5, 40), checkpoint_vocab_size(checkpoint), seed=3)
    stats = assert_greedy_with_continuations(engine, prompts, NEW)
    drafted = [row for _, row in chains] if topk == 1 else trees
    ids = set(token_map.tolist())
    assert len(drafted) >= 2 * len(prompts) and all(t in ids for row in drafted for t in row)
    assert sum(len(row) for row in drafted) > 0
    spec = stats["speculative"]
    assert spec["verify_steps"] > 0 and spec["draft_token_map_size"] == token_map.numel()
    if compile_:
        assert_compiled_without_breaks(engine)
    got = engine.generate_batch(prompts, max_new_tokens=NEW)
    finish_engine(engine)
    with hc.wrap(model, **ENGINE_ARGS) as plain:
        assert plain.generate_batch(prompts, max_new_tokens=NEW) == got


def test_proposal_graph_body_with_map_equals_eager_path(checkpoint):
    """The proposal graphs' body (mtp_graphs.py) without a capture, with a map of half the
    vocabulary: the same proposals as the eager window path with the map (the chain fed the
    mapped ids on the device), greedy equal to HF's."""
    from hybrid_compile.engine.speculative.mtp_graphs import ProposalGraphs

    k, token_map = 3, _map(checkpoint, 0.5, seed=2)
    prompts = random_prompts((5, 40, 11), checkpoint_vocab_size(checkpoint), seed=3)
    runs = []
    for graphs in (True, False):
        engine = _engine(checkpoint, k, token_map, page_size=4, enable_prefix_cache=True)
        source = engine.speculative.source
        if graphs:
            source.graphs = ProposalGraphs(source, k, (1, 2), capture=False)
        proposals = record_proposals(engine)
        assert_greedy_with_continuations(engine, prompts, NEW)
        runs.append((proposals, dict(source.counters)))
        finish_engine(engine)
    (got, counters), (want, eager) = runs
    assert got == want and len(got) >= 2 * len(prompts)
    assert all(t in set(token_map.tolist()) for _, row in got for t in row)
    assert counters["mtp_graph_eager_runs"] > 0 and counters["mtp_graph_fallbacks"] == 0
    assert eager["mtp_graph_eager_runs"] == 0 and eager["window_steps"] > 0


def test_token_map_files_and_errors(checkpoint, tmp_path):
    """The map from .pt / .npy / .json files, a list, a tensor or a numpy array; one clear error for
    another method, bad contents and ids outside the vocabulary."""
    ids = [7, 3, 11]
    torch.save(torch.tensor(ids), tmp_path / "m.pt")
    np.save(tmp_path / "m.npy", np.array(ids, dtype=np.int32))
    (tmp_path / "m.json").write_text(json.dumps(ids))
    for value in (str(tmp_path / "m.pt"), tmp_path / "m.npy", str(tmp_path / "m.json"), ids, torch.tensor(ids),
                  np.array(ids)):
        got = read_token_map(value, 12)
        assert got.dtype == torch.int64 and got.tolist() == ids
    config = hc.EngineConfig.from_args
    with pytest.raises(ValueError, match="draft_token_map is only used with method='mtp', not 'ngram'"):
        config(speculative=dict(method="ngram", draft_token_map=ids))
    bad = [([], "is empty"), ([1, 2, 1], "duplicate token ids .e.g. 1"), ([1, -2], "negative token id"),
           ([1.5], "integer token ids"), ([True], "integer token ids"), (torch.ones(2, 2, dtype=torch.int64), "1-D"),
           (torch.tensor([1.0]), "integer token ids"), (str(tmp_path / "m.txt"), "unknown file type '.txt'"),
           (str(tmp_path / "none.pt"), "no such file"), ("x", "unknown file type")]
    for value, match in bad:
        with pytest.raises(ValueError, match=f"SpeculativeConfig.draft_token_map.*{match}"):
            config(speculative=dict(method="mtp", draft_token_map=value))
    v = checkpoint_vocab_size(checkpoint)
    with pytest.raises(ValueError, match=f"token id {v}, outside the vocabulary of {v} ids"):
        _engine(checkpoint, 2, [0, v])
    engine = _engine(checkpoint, 1, ids)
    with pytest.raises(ValueError, match="restricted already"):
        engine.mtp_head.restrict_vocabulary(torch.tensor(ids))
    prompt = random_prompts((6,), v, seed=1)[0]
    assert engine.generate_batch([prompt], max_new_tokens=4) == [hf_greedy(engine.model, prompt, 4)]
    finish_engine(engine)


def test_restricted_lm_head_is_the_map_rows_with_bias(checkpoint):
    """``MTPHead.restrict_vocabulary`` on an LM head with a bias: the head's linear gives the full
    head's logits of the map's columns, the full module untouched; a patched (vocab-parallel)
    LM head is refused."""
    import types

    from transformers import AutoModelForCausalLM

    from hybrid_compile.models.mtp import load_mtp_head

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    head = load_mtp_head(model, checkpoint)
    v, h = model.lm_head.weight.shape
    full = torch.nn.Linear(h, v, bias=True)
    head.lm_head = full
    before = full.weight.clone()
    token_map = _map(checkpoint, 0.25, seed=4)
    head.restrict_vocabulary(token_map)
    x = torch.randn(3, h)
    assert head.lm_head.bias is not None and head.lm_head.weight.shape == (token_map.numel(), h)
    torch.testing.assert_close(head.lm_head(x), full(x)[:, token_map])
    assert torch.equal(full.weight, before) and torch.equal(head.token_map, token_map)
    patched = load_mtp_head(model, checkpoint)
    patched.lm_head.forward = types.MethodType(lambda self, x: x, patched.lm_head)
    with pytest.raises(ValueError, match="patched forward"):
        patched.restrict_vocabulary(token_map)
    del patched.lm_head.forward


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_cuda_mtp_draft_graphs_with_token_map(dense_checkpoint, k):
    """On CUDA with the proposal graphs captured (``mtp_draft_graphs`` True) and a map of half the
    vocabulary: every proposal replays a graph, every draft is an id of the map, the proposals
    equal the engine's without the graphs (same map; 90 %: fp32 matmuls of other shapes may flip a
    near-tie), greedy equals HF's and the plain engine's."""
    checkpoint = dense_checkpoint
    token_map = _map(checkpoint, 0.5)
    prompts = random_prompts((5, 40, 11), checkpoint_vocab_size(checkpoint), seed=3)
    runs = []
    for graphs in (True, False):
        engine = _engine(checkpoint, k, token_map, device="cuda", compile=True, enable_prefix_cache=True,
                         extra={"mtp_draft_graphs": graphs})
        assert (engine.speculative.source.graphs is not None) == graphs
        proposals = record_proposals(engine)
        assert_greedy_with_continuations(engine, prompts, NEW)
        runs.append((list(proposals), engine.stats()["speculative"]["draft_source"]))
        if graphs:
            with hc.from_pretrained(checkpoint, dtype=torch.float32, device="cuda", tokenizer=False,
                                    **ENGINE_ARGS) as plain:
                assert plain.generate_batch(prompts, max_new_tokens=NEW) == engine.generate_batch(prompts, max_new_tokens=NEW)
        finish_engine(engine)
    (got, counters), (want, _) = runs
    ids = set(token_map.tolist())
    assert all(t in ids for _, row in got for t in row)
    same = sum(g == w for g, w in zip(got, want))
    assert len(got) == len(want) > 0 and same >= 0.9 * len(got), f"{same} of {len(got)} proposals equal"
    assert counters["mtp_graph_replays"] > 0 and counters["mtp_graph_fallbacks"] == 0


def test_benchmark_mtp_token_map_tiny_smoke(tmp_path):
    """``benchmarks/speculative.py --mtp-token-map N --mtp-token-map-seed S`` on CPU with --tiny: per k
    a row of the full head and one of the mapped head, each with its head-forward cost (numbers not
    asserted, only that the rows are there and the replay's acceptance is unchanged by the map)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(root / "benchmarks" / "speculative.py"), "--tiny", "--device", "cpu", "--batches", "1",
           "--sources", "mtp", "--mtp-draft-tokens", "2", "--accept-lengths", "3", "--new-tokens", "7",
           "--mtp-token-map", "40", "--mtp-token-map-seed", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {(r["source"], r["draft_token_map_size"]): r for r in json.loads(out.read_text())["modes"]["eager"]["mtp"]}
    assert set(rows) == {("mtp", None), ("mtp_accept3", None), ("mtp", 40), ("mtp_accept3", 40)}
    for size in (None, 40):
        assert rows[("mtp_accept3", size)]["mean_acceptance_length"] == 3.0
        assert rows[("mtp", size)]["head_forwards_per_verify"] >= 2 and rows[("mtp", size)]["draft_ms_per_head_forward"] > 0
    seed_alone = subprocess.run([*cmd[:2], "--mtp-token-map-seed", "0"], capture_output=True, text=True, timeout=120,
                                cwd=root)
    assert seed_alone.returncode == 2 and "--mtp-token-map-seed needs --mtp-token-map" in seed_alone.stderr
