"""Speculative draft trees (``SpeculativeConfig.topk > 1``, engine/speculative/tree.py): greedy
output equal to transformers' ``generate`` and the non-speculative engine with top-k 2 and 4,
depth 3, KV pages of 4 and the prefix cache on, on Qwen3-Next (GDN) and NemotronH (Mamba2),
drafted by a replay tree (the continuation at random ranks, so accepted paths run through
later siblings and their K/V moves into place) and by a draft model; tree construction and greedy acceptance against
brute force; tree rejection sampling exact on a tiny vocabulary; the option errors.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.engine.speculative import (
    DraftTree,
    ReplayDraft,
    SpeculativeConfig,
    accept_tree_greedy,
    accept_tree_sampled,
    tree_from_topk_chain,
)
from hybrid_compile.engine.speculative.tree import ancestor_bits, chain_first, depths, fill_tree, verify_parents
from hybrid_compile.ops.reference.tree import root_path

import mamba2_models as mm
from engine_models import (
    assert_greedy_equal,
    cached_model,
    hf_greedy,
    hf_greedy_cached,
    make_engine,
    random_prompts,
    single_threaded,
    vocab_size,
)

KIND, SEED = "qwen3_next_moe", 0
MAX_NEW = 12
ENGINE_ARGS = dict(max_running_requests=3, mamba_cache_size=16, chunked_prefill_size=64, enable_prefix_cache=True,
                   page_size=4)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)


def _finish(engine) -> None:
    engine.prefix_cache.check_invariants()
    engine.clear_prefix_cache()
    engine.pools.check_all_free()
    engine.close()


def _tree_spec(source, topk: int) -> dict:
    return dict(method="custom", draft_source=source, num_draft_tokens=3, topk=topk, num_tree_nodes=3 * topk + 2)


@pytest.mark.parametrize("topk", [2, 4])
def test_qwen3_next_tree_greedy_equals_hf_and_plain_engine(topk):
    model = cached_model(KIND, SEED)
    prompts = random_prompts((3, 70, 11, 25, 6), vocab_size(model), seed=7)
    expected = [hf_greedy_cached(model, (KIND, SEED), p, MAX_NEW) for p in prompts]
    follow = [p + e for p, e in zip(prompts, expected)]
    follow_expected = [hf_greedy_cached(model, (KIND, SEED), p, MAX_NEW // 2) for p in follow]
    conts = {tuple(p): e for p, e in zip(prompts + follow, expected + follow_expected)}
    source = ReplayDraft(conts, q=0.5, vocab_size=vocab_size(model), seed=topk)
    engine = make_engine(model, speculative=_tree_spec(source, topk), **ENGINE_ARGS)
    for p, g, e in zip(prompts, engine.generate_batch(prompts, max_new_tokens=MAX_NEW), expected):
        assert_greedy_equal(model, p, g, e, f"tree topk={topk}")
    # continuations of the finished requests hit the prefix cache: the committed path states are exact
    for p, g, e in zip(follow, engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2), follow_expected):
        assert_greedy_equal(model, p, g, e, f"tree topk={topk} cached")
    stats = engine.stats()
    spec = stats["speculative"]
    assert spec["draft_nodes"] == 3 * topk + 2 and spec["drafted"] == spec["verified_requests"] * (3 * topk + 2)
    assert spec["tree_kv_moves"] > 0  # accepted nodes away from their position's verify token: K/V moved
    assert max(spec["acceptance_histogram"]) == 4  # whole depth-3 paths accepted
    assert stats["prefix_cache"]["hit_tokens"] > 0
    _finish(engine)
    # the plain engine agrees (same oracle)
    plain = make_engine(model, **ENGINE_ARGS)
    assert plain.generate_batch(prompts, max_new_tokens=MAX_NEW) == expected
    _finish(plain)


def test_qwen3_next_draft_model_tree():
    """A draft model gives its top-k per depth: the tree is its greedy chain plus the alternatives."""
    model = cached_model(KIND, SEED)
    prompts = random_prompts((5, 30, 9), vocab_size(model), seed=3)
    expected = [hf_greedy_cached(model, (KIND, SEED), p, MAX_NEW) for p in prompts]
    spec = dict(method="draft_model", draft_model=cached_model(KIND, SEED + 1), num_draft_tokens=3, topk=4,
                num_tree_nodes=8)
    engine = make_engine(model, speculative=spec, **ENGINE_ARGS)
    for p, g, e in zip(prompts, engine.generate_batch(prompts, max_new_tokens=MAX_NEW), expected):
        assert_greedy_equal(model, p, g, e, "draft model tree")
    assert engine.stats()["speculative"]["verify_steps"] > 0
    _finish(engine)


@pytest.mark.parametrize("topk", [2, 4])
def test_nemotron_h_tree_greedy_equals_hf(topk):
    """Mamba2 layers (NemotronH: Mamba2 + attention + MLP blocks) over draft trees."""
    model = mm.BUILDERS["nemotron_h"](1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, mm.VOCAB, (n,), generator=g).tolist() for n in (1, 40, 9)]
    expected = [hf_greedy(model, p, 10) for p in prompts]
    source = ReplayDraft({tuple(p): e for p, e in zip(prompts, expected)}, q=0.5, vocab_size=mm.VOCAB, seed=topk)
    engine = hc.wrap(model, speculative=_tree_spec(source, topk), max_running_requests=2, chunked_prefill_size=32,
                     max_context_len=256, max_total_tokens=2048, mamba_cache_size=8, page_size=4)
    assert engine.generate_batch(prompts, max_new_tokens=10) == expected
    # the same prompts again: served from the prefix cache, still exact
    assert engine.generate_batch(prompts, max_new_tokens=10) == expected
    spec = engine.stats()["speculative"]
    assert spec["tree_kv_moves"] > 0 and spec["verify_steps"] > 0
    _finish(engine)
    # the model as its own draft (an engine draft model of a Mamba2 family) over a tree
    engine = hc.wrap(model, speculative=dict(method="draft_model", draft_model=model, num_draft_tokens=3, topk=topk),
                     max_running_requests=2, chunked_prefill_size=32, max_context_len=256, max_total_tokens=2048,
                     mamba_cache_size=8, page_size=4)
    assert engine.generate_batch(prompts, max_new_tokens=10) == expected
    _finish(engine)


# -- tree construction and acceptance against brute force ---------------------------------------


def test_tree_from_topk_chain_brute_force():
    """The kept nodes are the ``budget`` candidates of highest cumulative log-probability, each
    under the chain node of the depth before; metadata as the definitions say."""
    rng = random.Random(0)
    for _ in range(200):
        depth, k = rng.randint(1, 4), rng.randint(1, 4)
        cands = []
        for _ in range(depth):
            lp = sorted((math.log(rng.random()) for _ in range(k)), reverse=True)
            cands.append([(rng.randrange(50), v) for v in lp])
        budget = rng.randint(depth, depth * k)
        tree = tree_from_topk_chain(cands, budget)
        # brute force: every candidate's score is the chain prefix before it + its own
        scored = {}
        chain = 0.0
        for d, row in enumerate(cands):
            for r, (tok, v) in enumerate(row):
                scored[(d, r)] = (chain + v, tok)
            chain += row[0][1]
        best = sorted(scored, key=lambda key: (-scored[key][0], key))[:budget]
        assert len(tree) == budget
        assert sorted(tree.tokens) == sorted(scored[key][1] for key in best)
        parents = verify_parents(tree)
        for node, (d, r) in enumerate(sorted(best), start=1):
            assert tree.tokens[node - 1] == scored[(d, r)][1]
            assert depths(parents)[node] == d + 1
            parent = parents[node]
            assert parent == 0 if d == 0 else tree.tokens[parent - 1] == cands[d - 1][0][0]
        bits = ancestor_bits(parents)
        for node in range(len(parents)):
            assert [i for i in range(64) if (bits[node] >> i) & 1] == sorted(root_path(parents, node))


def test_accept_tree_greedy_brute_force():
    """The emitted tokens are those of the deepest node whose every draft equals the target's token
    after its parent, then the target's token after it."""
    rng = random.Random(1)
    for _ in range(500):
        n = rng.randint(1, 12)
        parents = [rng.randint(0, i) for i in range(n)]
        tree = DraftTree([rng.randrange(3) for _ in range(n)], parents)
        vp = verify_parents(tree)
        targets = [rng.randrange(3) for _ in range(n + 1)]
        tokens = [None] + tree.tokens
        ok = [node for node in range(n + 1)
              if all(tokens[c] == targets[vp[c]] for c in root_path(vp, node)[1:])]
        deepest = max(len(root_path(vp, node)) for node in ok)
        emitted, path = accept_tree_greedy(targets, tree)
        assert len(path) == deepest == len(emitted)
        assert path == root_path(vp, path[-1]) and path[-1] in ok
        assert emitted == [tokens[c] for c in path[1:]] + [targets[path[-1]]]


def _token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Every node as the tokens on its root path (the tree as a set of draft continuations)."""
    vp, tokens = verify_parents(tree), [None] + tree.tokens
    return sorted(tuple(tokens[c] for c in root_path(vp, node)[1:]) for node in range(1, len(vp)))


def test_chain_first_renumbering_brute_force():
    """chain_first keeps the tree (the same token paths, parents before children), puts the
    first-child chain at nodes 1 .. d, keeps the other nodes' order, and greedy acceptance emits
    the same tokens; a tree whose chain is already first is returned as is. fill_tree applies it:
    a depth-then-rank tree accepting its rank-0 chain then needs no K/V move (path = 0, 1, ...)."""
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randint(1, 12)
        tree = DraftTree([rng.randrange(4) for _ in range(n)], [rng.randint(0, i) for i in range(n)])
        out = chain_first(tree)
        assert _token_paths(out) == _token_paths(tree) and len(out) == n
        assert all(p <= i for i, p in enumerate(out.parents))
        kids = [[j for j, p in enumerate(verify_parents(tree)) if p == i] for i in range(n + 1)]
        chain, node = [], 0
        while kids[node]:
            node = kids[node][0]
            chain.append(node)
        d = len(chain)
        assert out.parents[:d] == list(range(d)) and out.tokens[:d] == [tree.tokens[c - 1] for c in chain]
        assert out.tokens[d:] == [tree.tokens[j - 1] for j in range(1, n + 1) if j not in chain]
        targets = [rng.randrange(4) for _ in range(n + 1)]
        new_targets = [targets[0]] + [targets[c] for c in chain] + [targets[j] for j in range(1, n + 1) if j not in chain]
        assert accept_tree_greedy(new_targets, out)[0] == accept_tree_greedy(targets, tree)[0]
    chain = DraftTree([5, 6, 7], [0, 1, 2])
    assert chain_first(chain) is chain
    # depth then rank (tree_from_topk_chain's numbering): 1 = d1 r0, 2 = d1 r1, 3 = d2 r0, 4 = d2 r1, 5 = d3 r0
    t = fill_tree(DraftTree([10, 11, 20, 21, 30], [0, 0, 1, 1, 3]), 5, pending=1)
    assert t.tokens == [10, 20, 30, 11, 21] and t.parents == [0, 1, 2, 0, 1]
    assert accept_tree_greedy([10, 20, 30, 40, 0, 0], t) == ([10, 20, 30, 40], [0, 1, 2, 3])


def test_fill_tree_and_validation():
    t = fill_tree(DraftTree([7, 8], [0, 0]), 4, pending=3)
    assert t.tokens == [7, 8, 8, 8] and t.parents == [0, 0, 2, 3]
    assert fill_tree(DraftTree([], []), 2, pending=3).tokens == [3, 3]
    assert fill_tree(DraftTree([1, 2, 3], [0, 1, 1]), 2, 0).parents == [0, 1]
    with pytest.raises(ValueError, match="parent"):
        DraftTree([1, 2], [0, 2])


def test_accept_tree_sampled_is_exact():
    """Tree rejection sampling with deterministic drafts emits the target's distribution: on a
    vocabulary of 5, the joint of (first token, second token or stop) over 40000 draws against the
    exact one (a root with children 2, 2 (a duplicate), 0 and 4; under the first, children 1 and 3)."""
    from test_speculative import _chi2_pvalue

    V = 5
    tree = DraftTree([2, 2, 0, 4, 1, 3], [0, 0, 0, 0, 1, 1])
    g = torch.Generator().manual_seed(5)
    probs = torch.rand(7, V, generator=g) ** 2
    probs[0, 3] = 0.0  # a token of no mass at the root
    probs = probs / probs.sum(-1, keepdim=True)
    vp = verify_parents(tree)
    child = {(vp[c], tok): c for c, tok in reversed(list(enumerate([None] + tree.tokens))) if c}
    exact = torch.zeros(V, V + 1, dtype=torch.float64)  # [first, second or V = stopped after one]
    for a in range(V):
        c = child.get((0, a))
        if c is None:
            exact[a, V] = probs[0, a]
        else:
            exact[a, :V] = probs[0, a] * probs[c]
    counts = torch.zeros_like(exact)
    gen = torch.Generator().manual_seed(11)
    for _ in range(40000):
        emitted, path = accept_tree_sampled(probs, tree, gen)
        assert len(emitted) == len(path)
        counts[emitted[0], emitted[1] if len(emitted) > 1 else V] += 1
    assert _chi2_pvalue(counts.flatten(), exact.flatten()) > 1e-3


# -- options ------------------------------------------------------------------------------------


def test_tree_options_are_validated():
    with pytest.raises(ValueError, match="topk=2.*'ngram'"):
        SpeculativeConfig(method="ngram", topk=2).validate()
    with pytest.raises(ValueError, match="num_tree_nodes.*topk > 1"):
        SpeculativeConfig(method="mtp", num_tree_nodes=4).validate()
    with pytest.raises(ValueError, match="num_tree_nodes must be"):
        SpeculativeConfig(method="mtp", num_draft_tokens=3, topk=4, num_tree_nodes=16).validate()
    with pytest.raises(ValueError, match="topk must be"):
        SpeculativeConfig(method="mtp", topk=0).validate()
    cfg = SpeculativeConfig(method="custom", draft_source=ReplayDraft({}, 0.0, 10), num_draft_tokens=3, topk=4,
                            num_tree_nodes=16)
    cfg.validate()
    assert cfg.draft_nodes == 16 and cfg.max_tree_nodes() == 63
    assert SpeculativeConfig(method="mtp", num_draft_tokens=3, topk=2).draft_nodes == 6
    model = cached_model(KIND, SEED)
    with pytest.raises(ValueError, match="ssm_state_dtype='fp8'"):
        hc.EngineConfig(speculative=dict(method="mtp", topk=2), ssm_state_dtype="fp8").validate()

    class ChainOnly:
        def propose(self, requests, k):
            return [[] for _ in requests]

    with pytest.raises(ValueError, match="propose_tree"):
        make_engine(model, speculative=dict(method="custom", draft_source=ChainOnly(), topk=2))
    model_again = make_engine(model, **ENGINE_ARGS)  # the failed wrap left the model unpatched
    model_again.close()


@pytest.mark.parametrize("topk", [2, 4])
def test_mtp_tree_greedy_equals_hf(topk, tmp_path):
    """The checkpoint's MTP head gives its top-k at every depth of its chain; pages of 4, prefix
    cache (continuations hit it); the head is fed the accepted path's hidden states in order."""
    from mtp_models import write_mtp_checkpoint

    write_mtp_checkpoint("qwen3_next_moe", 0, str(tmp_path))
    engine = hc.from_pretrained(
        str(tmp_path), dtype=torch.float32, device="cpu", tokenizer=False, page_size=4, enable_prefix_cache=True,
        speculative=dict(method="mtp", num_draft_tokens=3, topk=topk, num_tree_nodes=2 * topk + 1),
        max_running_requests=2, chunked_prefill_size=32, max_total_tokens=4096, mamba_cache_size=12,
        max_context_len=256)
    model = engine.model
    prompts = random_prompts((3, 45, 11), vocab_size(model), seed=7)
    got = engine.generate_batch(prompts, max_new_tokens=8)
    assert got == [hf_greedy(model, p, 8) for p in prompts]
    follow = [p + g for p, g in zip(prompts, got)]
    assert engine.generate_batch(follow, max_new_tokens=4) == [hf_greedy(model, p, 4) for p in follow]
    stats = engine.stats()
    assert stats["speculative"]["draft_nodes"] == 2 * topk + 1 and stats["prefix_cache"]["hit_tokens"] > 0
    assert stats["speculative"]["draft_source"]["head_decode_steps"] > 0
    _finish(engine)


@pytest.mark.gpu
def test_gpu_tree_engine_matches_hf_with_graphs():
    """On CUDA (Triton ops, compile, CUDA graphs on), Qwen3-Next (GDN) and Bamba (Mamba2) over replay
    trees of top-k 2 and 4: every tree verify step replays a full draft-tree verify graph (buckets 2
    and 4 hold every batch of <= 4 requests: no verify step falls back to the compiled forward), with
    no recompile or graph break; greedy tokens equal the same engine without CUDA graphs and
    transformers' fp32 greedy on the same GPU. (Bamba, not NemotronH, for Mamba2: transformers' fp32
    grouped-mm fallback of NemotronH's MoE calls ``.tolist()``, which no CUDA graph can hold;
    test_cuda_graphs checks that it fails clearly.)"""
    import copy

    from engine_models import PAD_TOKEN_ID

    def hf_greedy_gpu(model, prompt, n):
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0,
                             do_sample=False, pad_token_id=PAD_TOKEN_ID)
        return out[0, len(prompt):].tolist()

    common = dict(compile=True, page_size=4, max_running_requests=4, mamba_cache_size=16, enable_prefix_cache=True)
    graphs = dict(cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
    for name, model in (("qwen3_next", copy.deepcopy(cached_model("qwen3_next_dense", 0))),
                        ("bamba", mm.BUILDERS["bamba"](1))):
        model = model.to("cuda")
        assert next(model.parameters()).dtype == torch.float32
        vocab = vocab_size(model) if name == "qwen3_next" else mm.VOCAB
        prompts = random_prompts([37, 1, 90, 5], vocab, seed=7)
        expected = [hf_greedy_gpu(model, p, 10) for p in prompts]
        for topk in (2, 4):
            got = {}
            for mode, kw in (("graphs", graphs), ("no_graphs", dict(cuda_graphs=False))):
                source = ReplayDraft({tuple(p): e for p, e in zip(prompts, expected)}, q=0.5, vocab_size=vocab)
                with make_engine(model, **common, **kw, speculative=_tree_spec(source, topk)) as engine:
                    got[mode] = engine.generate_batch(prompts, max_new_tokens=10)
                    stats = engine.stats()
                spec, c = stats["speculative"], stats["compile"]
                assert spec["tree_kv_moves"] > 0 and spec["verify_steps"] > 0, (name, topk, mode, spec)
                if mode == "graphs":
                    assert c["verify_batch_sizes"] == [4, 2], c
                    assert c["verify_graph_replays"] == spec["verify_steps"] > 0, (name, topk, c, spec)
                    assert c["recompiles"] == 0 and c["graph_breaks"] == 0, c
                else:
                    assert c["verify_graph_replays"] == 0 and c["full_graphs"] == 0, c
            assert got["graphs"] == got["no_graphs"], (name, topk)
            assert got["graphs"] == expected, (name, topk)


def test_lfm2_short_conv_tree_greedy_equals_hf():
    """LFM2's gated short conv (conv-only state) over a draft tree: each node's window from its parent's."""
    import test_lfm2 as lfm2

    model = lfm2._model("lfm2")
    prompts = random_prompts((1, 40, 9), lfm2.VOCAB, seed=13)
    expected = lfm2._expected("lfm2", prompts)
    source = ReplayDraft({tuple(p): e for p, e in zip(prompts, expected)}, q=0.5, vocab_size=lfm2.VOCAB, seed=2)
    engine = make_engine(model, speculative=_tree_spec(source, 2), page_size=4, **lfm2.ENGINE_ARGS)
    assert engine.generate_batch(prompts, max_new_tokens=lfm2.MAX_NEW) == expected
    assert engine.stats()["speculative"]["tree_kv_moves"] > 0
    _finish(engine)
