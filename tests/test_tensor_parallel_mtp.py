"""Speculative decoding with the checkpoint's MTP head under tensor parallelism (CPU, gloo, 2 ranks).

Tiny checkpoints with ``mtp.*`` tensors (tests/mtp_models.py) are served by
``hc.from_pretrained(dir, tensor_parallel_size=2, speculative={"method": "mtp"})``: every rank holds
its shard of the head (attention heads, the MLP's / experts' intermediate split; fc and norms
replicated; its KV layer in the rank's KV pool holds the rank's KV heads) and runs every head
forward of rank 0's proposals (``distributed/step.py``, ``HEAD`` forwards). Cases: Qwen3-Next (MoE
head, experts stored per expert), Qwen3.5 (dense head; its tensors in a directory of their own,
``mtp_checkpoint``), a Qwen3.5-MoE draft tree (top-k 2) and
NemotronH (its MTP step: an attention block and a MoE block); a Qwen3-Next case and the tree case
with a rank-one LM head that makes about half the drafts accepted, and a Qwen3-Next case with a draft
token map (``draft_token_map``: each rank's rows of the map from its vocab-parallel LM head, the
logits gathered, ``distributed.layers.VocabParallelRows``). Each with chunked prefill (a
45-token prompt over chunks of 32), the prefix cache (round two continues round one's sequences)
and more prompts than running slots. In fp32 the sharded head's math is the single-process
head's up to summation order, so the greedy tokens equal the single-process MTP engine's and HF
``generate``'s, and every proposal and counter (verify steps, drafted, accepted, the head's step
counters) equals the single-process run's. ``@proposal_graphs``: the MTP proposal graphs' body
(``EngineConfig.extra["mtp_draft_graphs"]``, uncaptured on the CPU), each proposal one ``PROPOSAL``
command that every rank runs whole. The cases run in one group of spawned ranks
(``test_tensor_parallel._run_group``). Raised before any rank starts: a checkpoint without
``mtp.*`` tensors (here) and ``EngineConfig.extra["mtp_draft_graphs"]=True`` on CPU ranks
(tests/test_tensor_parallel.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.models.mtp import MTPWeightsNotFoundError
from engine_models import build_model, hf_greedy, random_prompts, single_threaded, vocab_size
from mtp_models import ENGINE_ARGS, record_proposals, write_mtp_checkpoint, write_nemotron_h_mtp_checkpoint
from test_tensor_parallel import _run_group, rank_cases, finish_rank

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)

NEW = 8
MORE = 4  # round two: each finished sequence continued by this many tokens (a prefix-cache hit)
OPTIONS = dict(dtype=torch.float32, device="cpu", tokenizer=False, enable_prefix_cache=True, **ENGINE_ARGS)
# (case name, checkpoint kind, speculative config, two-token LM head: :func:`_two_token_model`)
CASES = (
    ("qwen3_next_moe", "qwen3_next_moe", dict(method="mtp", num_draft_tokens=3), False),
    ("qwen3_next_moe@accepting", "qwen3_next_moe", dict(method="mtp", num_draft_tokens=3), True),
    # the head's tensors in a directory of their own (SpeculativeConfig.mtp_checkpoint): mtp.safetensors
    ("qwen3_5@mtp_checkpoint", "qwen3_5", dict(method="mtp", num_draft_tokens=2), False),
    ("qwen3_5_moe@tree", "qwen3_5_moe", dict(method="mtp", num_draft_tokens=2, topk=2, num_tree_nodes=4), True),
    ("nemotron_h", "nemotron_h", dict(method="mtp", num_draft_tokens=2), False),
    # a draft token map (the fixture draws it: _token_map): each rank's LM head rows of the map, gathered
    ("qwen3_next_moe@token_map", "qwen3_next_moe", dict(method="mtp", num_draft_tokens=3), True),
    # the proposal graphs' body (mtp_graphs.py, uncaptured on the CPU: _proposal_graphs): each proposal one
    # PROPOSAL command, every rank running the whole window + chain from rank 0's staged step
    ("qwen3_next_moe@proposal_graphs", "qwen3_next_moe", dict(method="mtp", num_draft_tokens=3), True),
)
ACCEPTING = tuple(c[0] for c in CASES if c[3])


@contextlib.contextmanager
def _proposal_graphs(name: str):
    """For a ``@proposal_graphs`` case: the MTP draft source builds its proposal graphs, which on the
    CPU (no full CUDA graphs to capture them in) run their body uncaptured."""
    if not name.endswith("@proposal_graphs"):
        yield
        return
    from hybrid_compile.engine.speculative import mtp

    saved, mtp.resolve_option = mtp.resolve_option, lambda config, device: True
    try:
        yield
    finally:
        mtp.resolve_option = saved


def _move_mtp_tensors(path: str, to: str) -> None:
    """Move the ``mtp.*`` tensors of ``path``'s model.safetensors into ``to``/mtp.safetensors (as
    ``benchmarks/reference_models.save_random_mtp_head`` writes a head)."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    save_file({k: v for k, v in tensors.items() if k.startswith("mtp.")}, os.path.join(to, "mtp.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, file, metadata={"format": "pt"})


def _two_token_model(kind: str):
    """The kind's tiny model with a rank-one LM head ``u v^T``: the target and the MTP head (which
    shares it) each pick one of two tokens (argmax or argmin of ``u``, by the sign of ``v . h``), so
    about half the drafts are accepted (random heads of a full vocabulary accept almost none): the
    verify steps keep drafts, and the head's next window has several valid rows."""
    model = build_model(kind, 0)
    g = torch.Generator().manual_seed(5)
    vocab, hidden = model.lm_head.weight.shape
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.outer(torch.randn(vocab, generator=g), torch.randn(hidden, generator=g)))
    return model


def _token_map(model) -> list[int]:
    """Half the vocabulary's ids in a random order, both rank-one heads' picks among them (the
    largest and smallest entry of the LM head's first column: :func:`_two_token_model`), so that
    drafts over the map are accepted; the ids fall on both ranks' rows of the vocab-parallel head."""
    w = model.lm_head.weight[:, 0]
    vocab = w.numel()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[: vocab // 2].tolist()
    picks = {int(w.argmax()), int(w.argmin())}
    return [i for i in ids if i not in picks] + sorted(picks)


def _serve(engine, prompts: list[list[int]]) -> dict:
    """Round one, then each sequence continued (prefix-cache hits); the proposals of chain
    drafts, the speculative counters and the prefix-cache hits."""
    proposals = record_proposals(engine)
    first = engine.generate_batch(prompts, max_new_tokens=NEW)
    second = engine.generate_batch([p + g for p, g in zip(prompts, first)], max_new_tokens=MORE)
    stats = engine.stats()
    spec = stats["speculative"]
    return dict(outputs=[first, second], proposals=proposals, prefix_hits=stats["prefix_cache"]["admitted_hit_tokens"],
                counters={k: spec.get(k) for k in ("verify_steps", "verified_requests", "drafted", "accepted", "topk",
                                                   "draft_token_map_size")},
                head=spec["draft_source"])


def _fc(head):
    """The head's fusion of ``[embedding; hidden]`` (Qwen's ``fc``, NemotronH's ``eh_proj``)."""
    return head.fc if hasattr(head, "fc") else head.eh_proj


def _rank_main(rank: int, size: int, cases: list[dict], result_path: str) -> None:
    """One torchrun-style rank: serve every case in turn (rank 0 drives and records)."""
    results = {}
    for case in rank_cases(rank, size, cases):
        t0 = time.perf_counter()
        with _proposal_graphs(case["name"]):
            engine = hc.from_pretrained(case["dir"], tensor_parallel_size=size, speculative=case["speculative"],
                                        **OPTIONS)
        if rank != 0:
            assert engine is None
            continue
        try:
            result = _serve(engine, case["prompts"])
        except Exception as e:  # noqa: BLE001 (recorded for the test to check)
            results[case["name"]] = dict(error=f"{type(e).__name__}: {e}")
            engine.close()
            continue
        head = engine.mtp_head
        attn = head.attention_modules()[0]
        result.update(
            q_proj=list(attn.q_proj.weight.shape), fc=list(_fc(head).weight.shape),
            head_kv_heads=head.attention_specs(torch.float32)[0].num_kv_heads,
            commands=engine.stats()["tensor_parallel"]["commands_broadcast"],
            shards=[(r["shard_bytes"], r["full_model_bytes"]) for r in engine.stats()["tensor_parallel"]["ranks"]])
        engine.close()
        result.update(pools_used=engine.pools.used_counts(), seconds=time.perf_counter() - t0)
        results[case["name"]] = result
    finish_rank(rank, results, result_path)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Each case served at TP 2 (one group of ranks) and by the single-process engine, and HF's
    greedy tokens of both rounds."""
    cases, single = [], {}
    for name, kind, spec, two_tokens in CASES:
        path = str(tmp_path_factory.mktemp(kind))
        if kind == "nemotron_h":  # (its MTP step: an attention block, then a MoE block)
            write_nemotron_h_mtp_checkpoint(0, path)
        else:
            model = _two_token_model(kind) if two_tokens else None
            write_mtp_checkpoint(kind, 0, path, model=model)
            if name.endswith("@token_map"):
                spec = dict(spec, draft_token_map=_token_map(model))
        if name.endswith("@mtp_checkpoint"):
            spec = dict(spec, mtp_checkpoint=str(tmp_path_factory.mktemp("mtp_head")))
            _move_mtp_tensors(path, spec["mtp_checkpoint"])
        with _proposal_graphs(name):
            engine = hc.from_pretrained(path, speculative=spec, **OPTIONS)
        model = engine.model
        prompts = random_prompts((3, 45, 11), vocab_size(model), seed=7)
        one = _serve(engine, prompts)
        one["full_q_proj"] = list(engine.mtp_head.attention_modules()[0].q_proj.weight.shape)
        one["head_kv_heads"] = engine.mtp_head.attention_specs(torch.float32)[0].num_kv_heads
        one["token_map"] = spec.get("draft_token_map")
        engine.close()
        first = [hf_greedy(model, p, NEW) for p in prompts]
        one["hf"] = [first, [hf_greedy(model, p + g, MORE) for p, g in zip(prompts, first)]]
        single[name] = json.loads(json.dumps(one))  # (as rank 0's results come back: lists)
        cases.append(dict(name=name, dir=path, prompts=prompts, speculative=spec))
    tp, _ = _run_group(2, cases, tmp_path_factory.mktemp("tp_mtp"), main=_rank_main)
    return tp, single


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_mtp_two_ranks_equal_single_process_and_hf(served, name):
    tp, single = served
    r, one = tp[name], single[name]
    assert "error" not in r, r.get("error")
    assert one["outputs"] == one["hf"]  # (the single-process MTP engine: HF's greedy tokens)
    assert r["outputs"] == one["hf"]
    assert r["prefix_hits"] > 0 and one["prefix_hits"] > 0
    # the same math in fp32: the same proposals and counters as on one process
    assert r["counters"] == one["counters"] and r["counters"]["verify_steps"] > 0, json.dumps([r["counters"], one["counters"], r["head"], one["head"], r["proposals"], one["proposals"]])
    assert r["head"] == one["head"] and r["head"]["head_decode_steps"] > 0 and r["head"]["window_steps"] > 0
    assert r["proposals"] == one["proposals"]
    if "@tree" not in name:
        assert len(r["proposals"]) >= 4
    assert (r["counters"]["topk"] or 1) == (2 if "@tree" in name else 1)
    if name in ACCEPTING:
        assert r["counters"]["accepted"] >= r["counters"]["verify_steps"] // 2, r["counters"]
    if name.endswith("@token_map"):  # every draft an id of the map (its size in the counters, compared above)
        ids = set(one["token_map"])
        assert r["counters"]["draft_token_map_size"] == len(ids)
        assert all(t in ids for _, row in r["proposals"] for t in row), r["proposals"]
    # the rank's head holds half the query heads (q_proj rows) and its KV layer in the pool half the KV
    # heads (one when there are fewer KV heads than ranks: replicated); its fc (eh_proj) is replicated
    assert r["q_proj"] == [one["full_q_proj"][0] // 2, one["full_q_proj"][1]]
    assert r["head_kv_heads"] == max(1, one["head_kv_heads"] // 2)
    h = r["fc"][0]
    assert r["fc"] == [h, 2 * h]
    # every head forward (extends, windows, chain steps; a proposal graph's window and chain: one command) and
    # every verify step went to rank 1 as a command
    head = r["head"]
    proposals = head["mtp_graph_replays"] + head["mtp_graph_eager_runs"]
    if name.endswith("@proposal_graphs"):  # (every proposal: the body, run by both ranks)
        assert head["mtp_graph_eager_runs"] > 0 and head["mtp_graph_fallbacks"] == 0, head
    else:
        assert proposals == 0, head
    k = {c[0]: c[2] for c in CASES}[name]["num_draft_tokens"]
    head_commands = head["head_extend_steps"] + head["head_decode_steps"] - (k - 1) * proposals
    assert r["commands"] >= head_commands + r["counters"]["verify_steps"]
    # each rank's shard (the head's part included) is about half the checkpoint (mtp.* tensors included)
    assert all(0.4 * full < shard < 0.75 * full for shard, full in r["shards"]), r["shards"]
    assert not any(r["pools_used"].values()), r["pools_used"]




def test_checkpoint_without_mtp_tensors_fails_before_launch(tmp_path):
    """A checkpoint with no ``mtp.*`` tensors: the single-process engine's error, raised before any
    rank process starts."""
    write_mtp_checkpoint("qwen3_5", 0, str(tmp_path), with_mtp=False)
    with pytest.raises(MTPWeightsNotFoundError, match="has no mtp.* tensors"):
        hc.from_pretrained(str(tmp_path), tensor_parallel_size=2, speculative=dict(method="mtp", num_draft_tokens=2),
                           **OPTIONS)

