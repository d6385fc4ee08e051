"""Speculative decoding with the checkpoint's MTP head (``speculative={"method": "mtp"}``): tiny
checkpoints written by the test with ``mtp.*`` tensors (tests/mtp_models.py) for Qwen3-Next (MoE
head, experts stored per expert), Qwen3.5 and Qwen3.5-MoE. Greedy outputs equal transformers'
``generate`` and the non-speculative engine, with chunked prefill, the prefix cache, KV pages of
4 and compile; every chain of drafts equals the plain-torch reference of the head (HF modules on
whole sequences); a checkpoint without MTP tensors, an unknown checkpoint directory and a family
without MTP support are clear errors. (The sampling distribution with MTP drafts: tests/
test_speculative.py.)
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.models.mtp import MTPWeightsNotFoundError

from engine_models import cached_model, hf_greedy, random_prompts, single_threaded, vocab_size
from mtp_models import (ENGINE_ARGS, ReferenceHead, assert_chain_drafts_equal_reference, assert_compiled_without_breaks,
                        assert_greedy_with_continuations, finish_engine, write_mtp_checkpoint)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)

K = 3
NEW = 8
ARGS = ENGINE_ARGS


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(kind):
        if kind not in made:
            path = tmp_path_factory.mktemp(kind)
            mtp, layer = write_mtp_checkpoint(kind, 0, str(path))
            made[kind] = (str(path), mtp, layer)
        return made[kind]

    return get


@pytest.mark.parametrize("kind", ["qwen3_next_moe", "qwen3_5", "qwen3_5_moe"])
def test_mtp_greedy_and_drafts_equal_reference(kind, checkpoints):
    """Loaded with ``hc.from_pretrained(dir)`` (the head's tensors found where the model came
    from); a prompt longer than the prefill chunk; each proposal equals the reference chain."""
    path, mtp, layer = checkpoints(kind)
    engine = hc.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=False,
                                speculative=dict(method="mtp", num_draft_tokens=K), **ARGS)
    model = engine.model
    prompts = random_prompts((3, 45, 11), vocab_size(model), seed=7)
    got = assert_chain_drafts_equal_reference(engine, prompts, NEW, K, lambda m: ReferenceHead(kind, m, mtp, layer))
    if kind == "qwen3_next_moe":
        plain = hc.wrap(model, **ARGS)
        assert plain.generate_batch(prompts, max_new_tokens=NEW) == got
        plain.close()
    finish_engine(engine)


def test_mtp_prefix_cache_pages_compile(checkpoints):
    """Compiled target and head (no graph break), KV pages of 4, prefix cache: continuations of
    finished requests hit the cache (the head's KV of the cached positions comes with it) and
    the greedy outputs stay HF's."""
    path, _, _ = checkpoints("qwen3_next_moe")
    engine = hc.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=False, compile=True, page_size=4,
                                enable_prefix_cache=True, speculative=dict(method="mtp", num_draft_tokens=2), **ARGS)
    stats = assert_greedy_with_continuations(engine, random_prompts((5, 40), vocab_size(engine.model), seed=3), NEW)
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["speculative"]["verify_steps"] > 0
    assert_compiled_without_breaks(engine)
    finish_engine(engine)


def test_mtp_errors(checkpoints, tmp_path):
    """No mtp.* tensors, no known directory, an unsupported family: one clear error each, the
    model left unpatched; mtp_checkpoint names the directory of a model built in memory."""
    bare = tmp_path / "bare"
    write_mtp_checkpoint("qwen3_5", 0, str(bare), with_mtp=False)
    with pytest.raises(MTPWeightsNotFoundError, match="has no mtp.* tensors"):
        hc.from_pretrained(str(bare), dtype=torch.float32, device="cpu", tokenizer=False,
                           speculative=dict(method="mtp"), **ARGS)
    model = cached_model("qwen3_5", 0)  # built in memory: no checkpoint directory
    with pytest.raises(MTPWeightsNotFoundError, match="mtp_checkpoint"):
        hc.wrap(model, speculative=dict(method="mtp"), **ARGS)
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(ValueError, match="not supported for model type 'olmo_hybrid'"):
        hc.wrap(cached_model("olmo_hybrid", 0), speculative=dict(method="mtp"), **ARGS)
    with pytest.raises(ValueError, match="mtp_checkpoint is only used with method='mtp'"):
        hc.EngineConfig.from_args(speculative=dict(method="ngram", mtp_checkpoint=str(bare)))
    # the same weights as the checkpoint's model, the head from an explicit directory
    path, _, _ = checkpoints("qwen3_5")
    engine = hc.wrap(model, speculative=dict(method="mtp", num_draft_tokens=1, mtp_checkpoint=path), **ARGS)
    prompt = random_prompts((6,), vocab_size(model), seed=1)[0]
    assert engine.generate_batch([prompt], max_new_tokens=4) == [hf_greedy(model, prompt, 4)]
    assert engine.stats()["speculative"]["draft_source"]["head_decode_steps"] == 0  # k = 1: no chain
    finish_engine(engine)


def test_mtp_benchmark_tiny_smoke(tmp_path):
    """``benchmarks/speculative.py --sources mtp`` runs end to end on CPU with --tiny: the head's own
    drafts and the fixed acceptance length (numbers are not asserted, only the acceptance)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(root / "benchmarks" / "speculative.py"), "--tiny", "--device", "cpu", "--batches", "1",
           "--sources", "mtp", "--mtp-draft-tokens", "2", "--accept-lengths", "3", "--new-tokens", "7",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["source"]: r for r in json.loads(out.read_text())["modes"]["eager"]["mtp"]}
    assert set(rows) == {"mtp", "mtp_accept3"}
    # 6 tokens after the prefill's first: two verify steps of 3 (every draft of the replay right)
    assert rows["mtp_accept3"]["mean_acceptance_length"] == 3.0
    assert rows["mtp"]["head_forwards_per_verify"] >= 2 and rows["mtp"]["draft_ms_per_head_forward"] > 0


def test_mtp_with_fp8_pools(checkpoints):
    """kv_cache_dtype="fp8" covers the head's attention layer too (its KV lives in the target's pool),
    and with an FP8 state the MTP engine's greedy output equals the plain FP8 engine's."""
    path, _, _ = checkpoints("qwen3_next_moe")
    fp8 = dict(kv_cache_dtype="fp8", ssm_state_dtype="fp8")
    engine = hc.from_pretrained(path, dtype=torch.float32, device="cpu", tokenizer=False,
                                speculative=dict(method="mtp", num_draft_tokens=K), **fp8, **ARGS)
    layer = engine.mtp_head.layer_id
    assert engine.pools.kv.k_cache(layer).dtype == torch.float8_e4m3fn
    assert all(k is not None for k in engine.pools.kv.kv_scales(layer))
    prompts = random_prompts((3, 45), vocab_size(engine.model), seed=7)
    got = engine.generate_batch(prompts, max_new_tokens=NEW)
    assert engine.stats()["speculative"]["verify_steps"] > 0
    with hc.wrap(engine.model, **fp8, **ARGS) as plain:
        assert plain.generate_batch(prompts, max_new_tokens=NEW) == got
    finish_engine(engine)
