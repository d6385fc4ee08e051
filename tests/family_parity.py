"""Greedy-parity scenarios shared by the family test files (tests/test_lfm3.py,
tests/test_recurrent_gemma.py, tests/test_kimi_linear.py, tests/test_minimax.py): one engine feature per function, each comparing the engine's
greedy tokens with transformers' own ``generate`` on the same tiny random model.

A :class:`Family` holds the model and its HF oracle (``hf(prompt_tuple, max_new)``, cached by the
caller); prompts are drawn from the model's vocabulary with fixed seeds.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from hybrid_compile.engine.speculative import ReplayDraft

from engine_models import assert_greedy_equal, assert_pools_restored, make_engine, random_prompts, record_prefix_hits

MAX_NEW = 8
ENGINE_ARGS = dict(max_running_requests=3, chunked_prefill_size=32, max_context_len=320, mamba_cache_size=8)

__all__ = ["ENGINE_ARGS", "Family", "MAX_NEW", "make_family", "check_batch_with_chunked_prefill", "check_gpu_graphs",
           "check_prefix_cache_hits", "check_speculative", "check_speculative_tree"]


@dataclass
class Family:
    name: str
    model: Callable[[], torch.nn.Module]  # the (cached) CPU model
    hf: Callable[[tuple, int], list[int]]  # HF greedy tokens of (prompt, max_new)
    vocab: int

    def assert_hf(self, prompts, got, what, max_new=MAX_NEW):
        for i, (p, g) in enumerate(zip(prompts, got)):
            assert_greedy_equal(self.model(), p, g, self.hf(tuple(p), max_new),
                                f"{self.name} {what}: prompt {i} (length {len(p)})")


def make_family(name: str, build: Callable[[], torch.nn.Module], hf_greedy: Callable, vocab: int) -> Family:
    """A family whose model is built once and whose HF tokens are computed once per prompt
    (``hf_greedy(model, prompt_list, max_new)``)."""
    model = functools.lru_cache(maxsize=None)(build)

    @functools.lru_cache(maxsize=None)
    def hf(prompt: tuple, max_new: int) -> list[int]:
        return hf_greedy(model(), list(prompt), max_new)

    return Family(name, model, hf, vocab)


def check_batch_with_chunked_prefill(family: Family) -> None:
    """A 150-token prompt (five prefill chunks) and a 1-token one alone, then a continuous batch of
    six with chunked prefill (mixed prefill + decode steps)."""
    prompts = random_prompts((1, 150, 17, 64, 5, 90), family.vocab, seed=11)
    with make_engine(family.model(), **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        for i in (1, 0):
            out = engine.generate(torch.tensor([prompts[i]]), max_new_tokens=MAX_NEW)
            family.assert_hf([prompts[i]], [out[0, len(prompts[i]):].tolist()], "single")
        engine.clear_prefix_cache()  # the batch below starts cold
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        family.assert_hf(prompts, got, "batch")
        assert stats["decode_steps"] > 0 and stats["extend_steps"] > 0
        assert stats["mixed_steps"] > 0 and stats["mixed_decode_rows"] > 0, stats  # decode rows split off
        assert_pools_restored(engine, initial_free)


def check_prefix_cache_hits(family: Family, **engine_args) -> dict:
    """Prompts sharing a 140-token prefix continue from the checkpoint at 128 (alignment 16 or 64);
    a finished request's follow-up hits at its full length. Returns the prefix-cache stats.
    ``engine_args`` override :data:`ENGINE_ARGS`."""
    base, a, b, c = random_prompts((140, 9, 20, 3), family.vocab, seed=12)
    first, second = [base + a], [base + b, base + c]
    with make_engine(family.model(), **dict(ENGINE_ARGS, **engine_args)) as engine:
        initial_free = engine.pools.free_counts()
        hits = record_prefix_hits(engine)
        got_first = engine.generate_batch(first, max_new_tokens=MAX_NEW)
        got_second = engine.generate_batch(second, max_new_tokens=MAX_NEW)
        follow = [first[0] + got_first[0]]
        got_follow = engine.generate_batch(follow, max_new_tokens=MAX_NEW // 2)
        stats = engine.stats()["prefix_cache"]
        assert_pools_restored(engine, initial_free)
    family.assert_hf(first + second, got_first + got_second, "prefix")
    family.assert_hf(follow, got_follow, "follow-up", MAX_NEW // 2)
    assert hits[0] == 0 and hits[1:3] == [128, 128], hits
    assert hits[3] == len(follow[0]) - 1, hits
    return stats


def _speculative(method: str, model) -> dict:
    if method == "draft_self":
        return dict(method="draft_model", draft_model=model, num_draft_tokens=3)
    return dict(method="ngram", num_draft_tokens=3, ngram_max=3, ngram_min=1)


def check_speculative(family: Family, method: str) -> None:
    """``draft_self`` (the target drafts for itself: every draft accepted) or ``ngram``."""
    model = family.model()
    prompts = random_prompts((1, 40, 9), family.vocab, seed=13)
    prompts.append((prompts[2] * 5)[:37])  # a repeated pattern: n-gram lookup finds drafts in it
    with make_engine(model, speculative=_speculative(method, model), **ENGINE_ARGS) as engine:
        initial_free = engine.pools.free_counts()
        got = engine.generate_batch(prompts, max_new_tokens=MAX_NEW)
        stats = engine.stats()
        assert_pools_restored(engine, initial_free)
    family.assert_hf(prompts, got, method)
    assert stats["speculative"]["verify_steps"] > 0
    if method == "draft_self":
        assert stats["speculative"]["acceptance_rate"] == 1.0


TREE_NEW = 16  # (long enough that a wrong sibling state shows in the tokens of every tiny model)


def check_speculative_tree(family: Family, topk: int) -> None:
    """Draft trees (``topk > 1``): a :class:`ReplayDraft` tree holds HF's continuation at random
    ranks, so accepted paths run through later siblings (each node's recurrent state from its
    parent's, kept K/V moved into place); then the model as its own tree draft (its top-k per
    depth: every first-child chain accepted). Prompts again after they are cached."""
    model = family.model()
    prompts = random_prompts((1, 40, 9, 70), family.vocab, seed=17)
    conts = {tuple(p): family.hf(tuple(p), TREE_NEW) for p in prompts}
    source = ReplayDraft(conts, q=0.5, vocab_size=family.vocab, seed=topk)
    tree = dict(method="custom", draft_source=source, num_draft_tokens=3, topk=topk, num_tree_nodes=3 * topk + 2)
    own = dict(method="draft_model", draft_model=model, num_draft_tokens=3, topk=topk)
    for spec, what in ((tree, f"replay tree topk={topk}"), (own, f"own-draft tree topk={topk}")):
        with make_engine(model, speculative=spec, page_size=4, **ENGINE_ARGS) as engine:
            initial_free = engine.pools.free_counts()
            got = engine.generate_batch(prompts, max_new_tokens=TREE_NEW)
            family.assert_hf(prompts, got, what, TREE_NEW)
            family.assert_hf(prompts, engine.generate_batch(prompts, max_new_tokens=TREE_NEW), f"{what}, cached", TREE_NEW)
            stats = engine.stats()["speculative"]
            assert_pools_restored(engine, initial_free)
        assert stats["verify_steps"] > 0 and stats["draft_nodes"] == 3 * topk + (2 if spec is tree else 0), stats
        if spec is tree:
            assert stats["tree_kv_moves"] > 0 and max(stats["acceptance_histogram"]) == 4, stats
        else:  # the target's own greedy chain is in every tree: whole depth-3 paths kept
            assert max(stats["acceptance_histogram"]) == 4, stats


def check_gpu_graphs(family: Family) -> None:
    """GPU: compile + full and piecewise CUDA graphs give the eager GPU engine's tokens; those and
    speculative decoding's under graphs (chains; top-2 draft trees of the model's own drafts) equal
    HF's on the CPU up to CPU/GPU near-ties."""
    from test_cuda_graphs import _assert_greedy_close  # HF-on-CPU oracle with a CPU/GPU near-tie allowance

    model = copy.deepcopy(family.model()).to("cuda")
    prompts = random_prompts((37, 1, 90, 5, 64, 3), family.vocab, seed=16)
    graphs = dict(compile=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 4), piecewise_cuda_graph_tokens=(4, 16, 64))
    runs = {"eager": dict(compile=False), "graphs": graphs,
            "graphs+speculative": dict(graphs, speculative=_speculative("draft_self", model)),
            "graphs+tree": dict(graphs, speculative=dict(_speculative("draft_self", model), topk=2))}
    outs, stats = {}, {}
    for name, kw in runs.items():
        with make_engine(model, max_running_requests=8, **kw) as engine:
            initial_free = engine.pools.free_counts()
            outs[name] = engine.generate_batch(prompts, max_new_tokens=TREE_NEW)
            stats[name] = engine.stats()
            assert_pools_restored(engine, initial_free)
    for name in ("eager", "graphs+speculative", "graphs+tree"):  # verify runs other kernels: near-ties may flip
        for p, got in zip(prompts, outs[name]):
            _assert_greedy_close(family.model(), p, got, family.hf(tuple(p), TREE_NEW), f"{family.name} {name} GPU")
    assert outs["graphs"] == outs["eager"], outs  # the same kernels per step, replayed
    c = stats["graphs"]["compile"]
    assert c["recompiles"] == 0 and c["graph_breaks"] == 0, c
    assert c["cuda_graph_replays"] > 0 and c["piecewise_replays"] > 0, c
    assert stats["graphs+speculative"]["speculative"]["verify_steps"] > 0
    assert stats["graphs+tree"]["speculative"]["verify_steps"] > 0 and stats["graphs+tree"]["speculative"]["topk"] == 2
