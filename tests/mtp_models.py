"""Tiny checkpoints with a multi-token-prediction head (``mtp.*`` tensors), and the plain-torch
reference of the head's chain of drafts.

:func:`write_mtp_checkpoint` saves a tiny random model of an engine kind with transformers'
``save_pretrained`` and adds ``mtp.*`` tensors to its safetensors file, in the layout the
Qwen3-Next / Qwen3.5 releases use: ``mtp.layers.0.*`` is a full-attention decoder layer saved by
transformers itself (the extra last layer of the same model with one more layer, so MoE experts
are stored per expert as in the releases), ``mtp.fc`` / the three norms random. transformers
drops the ``mtp.*`` tensors when it loads the checkpoint. :func:`write_nemotron_h_mtp_checkpoint`
does the same for NemotronH (its config declaring one MTP step of an attention and a MoE block).

:class:`ReferenceHead` / :class:`NemotronHReferenceHead` are the head's definition run with HF's own modules on whole
sequences (no cache, HF's causal attention): the head at position i reads the target's final
hidden state at i (HF's forward) and the embedding of token i + 1; draft 1 is the argmax of the
LM head at the last computed position, each next draft the head one position further fed the
previous draft and the head's own output hidden state.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch

from engine_models import build_model, make_config, model_class

STD = 0.2
# the engine arguments of the MTP tests: two requests, prefill chunks of 32 tokens (prompts of 45
# span two chunks), room for prefix-cached Mamba states
ENGINE_ARGS = dict(max_running_requests=2, chunked_prefill_size=32, max_total_tokens=4096, mamba_cache_size=12,
                   max_context_len=256)


def _extended_config(kind: str, config=None):
    """The kind's config (or ``config``) with one more layer (full attention; MoE as the kind's
    layers)."""
    cfg = make_config(kind) if config is None else config
    n = cfg.num_hidden_layers
    cfg = copy.deepcopy(cfg)
    cfg.num_hidden_layers = n + 1
    cfg.layer_types = list(cfg.layer_types) + ["full_attention"]
    if kind == "qwen3_next_dense":
        cfg.mlp_only_layers = list(range(n + 1))
    return cfg


def write_mtp_checkpoint(kind: str, seed: int, path: str, with_mtp: bool = True, model=None):
    """Save the model ``build_model(kind, seed)`` (or ``model``, of ``kind``) into ``path`` with
    ``mtp.*`` tensors (seeded by ``seed``) in its safetensors file; returns the mtp tensors (names
    without ``mtp.``) and the HF decoder layer saved as ``mtp.layers.0`` (the reference's)."""
    from safetensors.torch import load_file, save_file

    model = build_model(kind, seed) if model is None else model
    model.save_pretrained(path)
    if not with_mtp:
        return {}, None
    cfg = _extended_config(kind, model.config)
    n = cfg.num_hidden_layers - 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + seed)
        extended = model_class(kind)(cfg).float()
        with tempfile.TemporaryDirectory() as tmp:
            extended.save_pretrained(tmp)
            saved = load_file(os.path.join(tmp, "model.safetensors"))
        marker = f"layers.{n}."
        mtp = {"layers.0." + k.split(marker, 1)[1]: v for k, v in saved.items() if marker in k}
        h = cfg.hidden_size
        mtp["fc.weight"] = torch.randn(h, 2 * h) * STD
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            mtp[f"{name}.weight"] = torch.randn(h) * STD
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update({"mtp." + k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    return mtp, extended.model.layers[n].eval()


class _ChainReference:
    """The chain of drafts of a reference head whose ``outputs(tokens, hidden)`` gives its output
    hidden states at every position (``self.model``: the target)."""

    @torch.inference_mode()
    def drafts(self, tokens: list[int], k: int, vocab: int) -> list[int]:
        """The k chained drafts after ``tokens`` (the last one is the pending, not yet computed token)."""
        c = len(tokens) - 1
        ids = torch.tensor([tokens[:c]])
        hidden = self.model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        seq, out = list(tokens), []
        for _ in range(k):
            h = self.outputs(seq, hidden)
            last = h[-1]
            d = int(self.model.lm_head(last)[:vocab].argmax())
            out.append(d)
            seq.append(d)
            hidden = torch.cat([hidden, last[None]])  # the next position reads the head's own output
        return out


class ReferenceHead(_ChainReference):
    """The MTP head of ``mtp`` and ``layer`` (what :func:`write_mtp_checkpoint` returns) over
    ``model`` with HF's modules, eager, whole sequences."""

    def __init__(self, kind: str, model, mtp: dict, layer) -> None:
        cfg = _extended_config(kind, model.config)
        self.model = model
        self.kind = kind
        self.layer = layer
        norm = type(model.model.norm)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            m = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
            m.load_state_dict({"weight": mtp[f"{name}.weight"]})
            self.norms[name] = m.eval()
        self.fc = mtp["fc.weight"]

    @torch.inference_mode()
    def outputs(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The head's output hidden states at positions ``0 .. len(hidden) - 1``; position i reads
        ``hidden[i]`` and token ``tokens[i + 1]``."""
        n = hidden.shape[0]
        emb = self.model.model.embed_tokens(torch.tensor([tokens[1: n + 1]]))
        x = torch.cat([self.norms["pre_fc_norm_embedding"](emb), self.norms["pre_fc_norm_hidden"](hidden[None])], -1)
        x = x @ self.fc.T
        pos = torch.arange(n)[None]
        rope_pos = pos[None].expand(3, 1, n) if self.kind.startswith("qwen3_5") else pos
        rotary = self.model.model.rotary_emb(x, rope_pos)
        out = self.layer(x, position_embeddings=rotary, attention_mask=None, position_ids=pos)
        out = out[0] if isinstance(out, tuple) else out
        return self.norms["norm"](out)[0]


# NemotronH: the tiny model of tests/mamba2_models.py (a MoE block in its pattern) declaring one
# MTP step of transformers' default kinds (an attention block, then a MoE block)
NEMOTRON_H_MTP_BLOCKS = ["full_attention", "moe"]


def write_nemotron_h_mtp_checkpoint(seed: int, path: str, with_mtp: bool = True, declare: bool = True):
    """Save the tiny NemotronH of ``build_nemotron_h(seed)`` into ``path``, its config declaring
    one MTP step (``declare``), with the step's ``mtp.*`` tensors in the NemotronH release layout
    (``mtp.layers.{j}.norm/mixer.*`` saved by transformers as blocks ``n + j`` of a model with the
    step's blocks appended, experts per expert; random ``enorm`` / ``hnorm`` / ``eh_proj`` /
    ``final_layernorm``). Returns the model, the mtp tensors (names without ``mtp.``) and the HF
    blocks saved as ``mtp.layers.*`` (the reference's)."""
    from safetensors.torch import load_file, save_file

    from mamba2_models import build_nemotron_h

    model = build_nemotron_h(seed)
    if declare:
        model.config.num_nextn_predict_layers = 1
        model.config.mtp_layers_block_type = list(NEMOTRON_H_MTP_BLOCKS)
    model.save_pretrained(path)
    if not with_mtp:
        return model, {}, []
    cfg = copy.deepcopy(model.config)
    n = cfg.num_hidden_layers
    cfg.layers_block_type = list(cfg.layers_block_type) + NEMOTRON_H_MTP_BLOCKS
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1000 + seed)
        extended = type(model)(cfg).float().eval()
        with tempfile.TemporaryDirectory() as tmp:
            extended.save_pretrained(tmp)
            saved = load_file(os.path.join(tmp, "model.safetensors"))
        mtp = {}
        for j in range(len(NEMOTRON_H_MTP_BLOCKS)):
            marker = f"layers.{n + j}."
            mtp.update({f"layers.{j}." + k.split(marker, 1)[1]: v for k, v in saved.items() if marker in k})
        h = cfg.hidden_size
        last = len(NEMOTRON_H_MTP_BLOCKS) - 1
        mtp["layers.0.eh_proj.weight"] = torch.randn(h, 2 * h) * STD
        for name in ("layers.0.enorm", "layers.0.hnorm", f"layers.{last}.final_layernorm"):
            mtp[f"{name}.weight"] = 1 + torch.randn(h) * STD
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update({"mtp." + k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    return model, mtp, [extended.model.layers[n + j] for j in range(len(NEMOTRON_H_MTP_BLOCKS))]


class NemotronHReferenceHead(_ChainReference):
    """NemotronH's MTP step of ``mtp`` and ``blocks`` (what :func:`write_nemotron_h_mtp_checkpoint`
    returns) over ``model`` with HF's modules, eager, whole sequences."""

    def __init__(self, model, mtp: dict, blocks: list) -> None:
        self.model = model
        self.blocks = blocks
        self.mtp = mtp
        self.eps = model.config.layer_norm_epsilon

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        norm = type(self.model.model.norm_f)(x.shape[-1], eps=self.eps)
        norm.load_state_dict({"weight": self.mtp[f"{name}.weight"]})
        return norm(x)

    @torch.inference_mode()
    def outputs(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The step's output hidden states at positions ``0 .. len(hidden) - 1``; position i reads
        ``hidden[i]`` and token ``tokens[i + 1]``."""
        n = hidden.shape[0]
        emb = self.model.model.embeddings(torch.tensor([tokens[1: n + 1]]))
        x = torch.cat([self._norm("layers.0.enorm", emb), self._norm("layers.0.hnorm", hidden[None])], -1)
        x = x @ self.mtp["layers.0.eh_proj.weight"].T
        pos = torch.arange(n)[None]
        for block in self.blocks:
            x = block(x, attention_mask=None, position_ids=pos)
        return self._norm(f"layers.{len(self.blocks) - 1}.final_layernorm", x)[0]


# -- helpers of the MTP engine tests --------------------------------------------------------------
def mtp_checkpoint_fixture(kind: str):
    """A module-scoped pytest fixture: a tiny ``kind`` checkpoint (seed 0) with ``mtp.*`` tensors,
    written once per test module (``checkpoint = mtp_checkpoint_fixture("qwen3_next_moe")``)."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        path = tmp_path_factory.mktemp(f"{kind}_mtp")
        write_mtp_checkpoint(kind, 0, str(path))
        return str(path)

    return fixture


def checkpoint_vocab_size(path: str) -> int:
    """The vocabulary size a saved checkpoint's config declares (its text config)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).get_text_config().vocab_size


def record_proposals(engine) -> list:
    """Every chain proposal of the engine's draft source from now on: (tokens so far, drafts), the
    device drafts of ``propose_on_device`` as lists."""
    seen = []
    source = engine.speculative.source

    def recording(propose):
        def record(requests, k):
            out = propose(requests, k)
            rows = out.tolist() if isinstance(out, torch.Tensor) else out
            seen.extend((r.prompt + r.output, row) for r, row in zip(requests, rows))
            return out
        return record

    source.propose = recording(source.propose)
    if hasattr(source, "propose_on_device"):
        source.propose_on_device = recording(source.propose_on_device)
    return seen


def assert_greedy_with_continuations(engine, prompts: list[list[int]], new: int) -> dict:
    """The engine's greedy outputs of ``prompts`` and then of each prompt + output (4 more tokens:
    with the prefix cache on they hit it) equal HF's; returns the engine's stats."""
    from engine_models import hf_greedy

    model = engine.model
    got = engine.generate_batch(prompts, max_new_tokens=new)
    assert got == [hf_greedy(model, p, new) for p in prompts]
    follow = [p + g for p, g in zip(prompts, got)]
    assert engine.generate_batch(follow, max_new_tokens=4) == [hf_greedy(model, p, 4) for p in follow]
    return engine.stats()


def assert_compiled_without_breaks(engine) -> None:
    """The target and the MTP head ran compiled, with no graph break, the head without a recompile
    (its window, chain and extend steps all served by its one dynamic graph)."""
    assert engine.stats()["compile"]["graph_breaks"] == 0
    head = engine.speculative.source.runner.compile_stats()
    assert head["enabled"] and head["graph_breaks"] == 0 and head["compiled_steps"] > 0
    assert head["recompiles"] == 0, head["recompile_reasons"]


def finish_engine(engine) -> None:
    """Check the prefix cache's invariants and that every pool slot came back, then close."""
    if engine.prefix_cache is not None:
        engine.prefix_cache.check_invariants()
        engine.clear_prefix_cache()
    engine.pools.check_all_free()
    engine.close()


def assert_chain_drafts_equal_reference(engine, prompts: list[list[int]], new: int, k: int, make_reference) -> list:
    """Greedy ``prompts`` with a chain of ``k`` MTP drafts per verify: outputs equal HF's, every
    proposal equals ``make_reference(model).drafts`` and every verified request got k drafts;
    returns the outputs."""
    from engine_models import hf_greedy, vocab_size

    model = engine.model
    vocab = vocab_size(model)
    proposals = record_proposals(engine)
    got = engine.generate_batch(prompts, max_new_tokens=new)
    assert got == [hf_greedy(model, p, new) for p in prompts]
    reference = make_reference(model)
    assert len(proposals) >= len(prompts) * 2
    for tokens, drafts in proposals:
        assert drafts == reference.drafts(tokens, k, vocab), len(tokens)
    spec = engine.stats()["speculative"]
    assert spec["method"] == "mtp" and spec["drafted"] == k * spec["verified_requests"]
    assert spec["draft_source"]["head_decode_steps"] > 0
    # every proposal's first head step a uniform window (engine/speculative/mtp.py)
    assert spec["draft_source"]["window_steps"] > 0 and spec["draft_source"]["window_fallbacks"] == 0
    return got
