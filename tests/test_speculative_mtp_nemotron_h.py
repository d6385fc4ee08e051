"""Speculative decoding with NemotronH's MTP head (``speculative={"method": "mtp"}``): a tiny
NemotronH (a MoE block in its layer pattern) whose config declares one MTP step of an attention
block and a MoE block, written by the test with random ``mtp.*`` tensors in the release layout
(tests/mtp_models.py). Greedy outputs equal transformers' ``generate`` and the non-speculative
engine, with chunked prefill (a prompt longer than the chunk), the prefix cache, KV pages of 4,
compile and draft trees of top-k 2; every chain of drafts equals the plain-torch reference of the
head (HF's blocks on whole sequences). A config without MTP layers, a checkpoint without the
tensors (or with some missing) and an MTP step with a Mamba block are clear errors.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import hybrid_compile as hc
from hybrid_compile.models.mtp import MTPWeightsNotFoundError, NemotronHMTPHead

from engine_models import random_prompts, single_threaded, vocab_size
from mamba2_models import require
from mtp_models import (ENGINE_ARGS, NemotronHReferenceHead, assert_chain_drafts_equal_reference, assert_compiled_without_breaks,
                        assert_greedy_with_continuations, finish_engine, write_nemotron_h_mtp_checkpoint)

_one_thread = pytest.fixture(scope="module", autouse=True)(single_threaded)

K = 3
NEW = 8
ARGS = ENGINE_ARGS
LOAD = dict(dtype=torch.float32, device="cpu", tokenizer=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    require("NemotronHForCausalLM")
    path = tmp_path_factory.mktemp("nemotron_h_mtp")
    model, mtp, blocks = write_nemotron_h_mtp_checkpoint(0, str(path))
    return str(path), mtp, blocks


def test_nemotron_h_mtp_greedy_and_drafts_equal_reference(checkpoint):
    """The head's tensors found where the model came from; the KV of its attention block is one
    more layer of the pool; each proposal equals the reference chain; greedy equals HF's and the
    plain engine's."""
    path, mtp, blocks = checkpoint
    engine = hc.from_pretrained(path, **LOAD, speculative=dict(method="mtp", num_draft_tokens=K), **ARGS)
    model = engine.model
    head = engine.mtp_head
    n = model.config.num_hidden_layers
    assert isinstance(head, NemotronHMTPHead) and [b.block_type for b in head.layers] == ["full_attention", "moe"]
    assert head.layer_id == n and engine.pools.kv.k_cache(n) is not None
    prompts = random_prompts((3, 45, 11), vocab_size(model), seed=7)
    got = assert_chain_drafts_equal_reference(engine, prompts, NEW, K, lambda m: NemotronHReferenceHead(m, mtp, blocks))
    with hc.wrap(model, **ARGS) as plain:
        assert plain.generate_batch(prompts, max_new_tokens=NEW) == got
    finish_engine(engine)


def test_nemotron_h_mtp_prefix_cache_pages_compile(checkpoint):
    """Compiled target and head (no graph break), KV pages of 4, prefix cache: continuations of
    finished requests hit the cache and the greedy outputs stay HF's."""
    path, _, _ = checkpoint
    engine = hc.from_pretrained(path, **LOAD, compile=True, page_size=4, enable_prefix_cache=True,
                                speculative=dict(method="mtp", num_draft_tokens=2), **ARGS)
    stats = assert_greedy_with_continuations(engine, random_prompts((5, 40), vocab_size(engine.model), seed=3), NEW)
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["speculative"]["verify_steps"] > 0
    assert_compiled_without_breaks(engine)
    finish_engine(engine)


@pytest.mark.parametrize("fused_moe", [False, True])
def test_nemotron_h_mtp_tree_greedy_equals_hf(checkpoint, fused_moe):
    """Draft trees of the head's top-2 at every depth of its chain, pages of 4, prefix cache; also
    with the fused MoE experts path (the model's MoE blocks and the head's)."""
    path, _, _ = checkpoint
    engine = hc.from_pretrained(path, **LOAD, page_size=4, enable_prefix_cache=True, fused_moe=fused_moe,
                                speculative=dict(method="mtp", num_draft_tokens=3, topk=2, num_tree_nodes=5), **ARGS)
    stats = assert_greedy_with_continuations(engine, random_prompts((3, 45), vocab_size(engine.model), seed=5), NEW)
    assert stats["speculative"]["draft_nodes"] == 5 and stats["prefix_cache"]["hit_tokens"] > 0
    moe_blocks = sum(1 for m in engine.model.modules() if type(m).__name__.endswith("Experts"))
    assert stats["fused_moe_modules"] == ((moe_blocks + 1) if fused_moe else 0), stats["fused_moe_modules"]
    assert stats["speculative"]["draft_source"]["head_decode_steps"] > 0
    finish_engine(engine)


def test_nemotron_h_mtp_head_dtypes_follow_the_target(checkpoint):
    """Loaded in bf16, the head's parameters and buffers have the dtypes of the target's blocks of
    the same kind (the MoE router's weight and score bias stay float32, as transformers keeps
    them); the engine drafts with it."""
    path, _, _ = checkpoint
    engine = hc.from_pretrained(path, dtype=torch.bfloat16, device="cpu", tokenizer=False,
                                speculative=dict(method="mtp", num_draft_tokens=2), **ARGS)
    target = {b.block_type: b for b in engine.model.model.layers}
    for block in engine.mtp_head.layers:
        want = dict(target[block.block_type].state_dict(keep_vars=True))
        got = dict(block.state_dict(keep_vars=True))
        assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}, block.block_type
    assert engine.mtp_head.layers[1].mixer.gate.weight.dtype == torch.float32
    assert engine.mtp_head.eh_proj.weight.dtype == torch.bfloat16
    assert len(engine.generate_batch([random_prompts((9,), vocab_size(engine.model), seed=2)[0]], max_new_tokens=6)[0]) == 6
    assert engine.stats()["speculative"]["verify_steps"] > 0
    finish_engine(engine)


def _set_config(path: str, **values) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(values)
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_nemotron_h_mtp_errors(tmp_path):
    """A config declaring no MTP layers, a checkpoint without (or missing some of) the tensors, an
    MTP step with a Mamba block: one clear error each, naming what was looked for."""
    require("NemotronHForCausalLM")
    undeclared = tmp_path / "undeclared"
    write_nemotron_h_mtp_checkpoint(0, str(undeclared), declare=False)
    with pytest.raises(MTPWeightsNotFoundError, match="declares no MTP layers"):
        hc.from_pretrained(str(undeclared), **LOAD, speculative=dict(method="mtp"), **ARGS)
    bare = tmp_path / "bare"
    write_nemotron_h_mtp_checkpoint(0, str(bare), with_mtp=False)
    with pytest.raises(MTPWeightsNotFoundError, match=r"has no mtp.\* tensors \(looked for mtp.layers.0.enorm"):
        hc.from_pretrained(str(bare), **LOAD, speculative=dict(method="mtp"), **ARGS)
    mamba_step = tmp_path / "mamba_step"
    write_nemotron_h_mtp_checkpoint(0, str(mamba_step))
    _set_config(str(mamba_step), mtp_layers_block_type=["mamba", "full_attention"])
    with pytest.raises(ValueError, match="mtp_layers_block_type=.*linear_attention.* is not supported"):
        hc.from_pretrained(str(mamba_step), **LOAD, speculative=dict(method="mtp"), **ARGS)
    # a checkpoint whose step lacks its final norm: the missing tensor is named
    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    write_nemotron_h_mtp_checkpoint(0, str(partial))
    file = os.path.join(str(partial), "model.safetensors")
    tensors = load_file(file)
    del tensors["mtp.layers.1.final_layernorm.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(MTPWeightsNotFoundError, match=r"missing: \['mtp.layers.1.final_layernorm.weight'\]"):
        hc.from_pretrained(str(partial), **LOAD, speculative=dict(method="mtp"), **ARGS)


@pytest.mark.gpu
def test_gpu_nemotron_h_mtp_greedy_equals_hf(checkpoint):
    """On CUDA (the Triton Mamba2 / attention ops, compile on, fp32): the MTP head's chains (k = 3)
    and top-2 trees, KV pages of 4, prefix cache; greedy tokens equal transformers' fp32 ``generate``
    on the same GPU; target and head compiled without graph breaks. (No CUDA graphs: transformers'
    fp32 fallback of NemotronH's MoE syncs with the host, see tests/test_cuda_graphs.py.)"""
    path, _, _ = checkpoint
    for spec in (dict(num_draft_tokens=3), dict(num_draft_tokens=3, topk=2, num_tree_nodes=5)):
        engine = hc.from_pretrained(path, dtype=torch.float32, device="cuda", tokenizer=False, compile=True,
                                    cuda_graphs=False, page_size=4, enable_prefix_cache=True,
                                    speculative=dict(method="mtp", **spec), **ARGS)
        prompts = random_prompts((3, 45, 70), vocab_size(engine.model), seed=11)
        stats = assert_greedy_with_continuations(engine, prompts, 16)
        assert stats["speculative"]["verify_steps"] > 0 and stats["prefix_cache"]["hit_tokens"] > 0
        assert_compiled_without_breaks(engine)
        finish_engine(engine)
