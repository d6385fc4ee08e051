"""Multi-token-prediction (MTP) heads that checkpoints ship beside the model (``mtp.*`` tensors,
which transformers skips when it loads the model), rebuilt from the family's own HF classes.

Qwen3-Next, Qwen3.5 and Qwen3.5-MoE store one MTP layer:

- ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden``: the family's RMSNorm of the next
  token's embedding and of the model's final (normed) hidden state;
- ``mtp.fc``: ``Linear(2H -> H, bias=False)`` over ``[norm(embedding); norm(hidden)]``;
- ``mtp.layers.0``: one full-attention decoder layer of the family (the family's decoder-layer
  class; MoE or dense MLP as the tensors say);
- ``mtp.norm``: the final RMSNorm; embeddings, rotary tables and LM head are the model's.

At position ``i`` the head reads the model's hidden state at ``i`` and the embedding of token
``i + 1`` and predicts token ``i + 2``; its attention is causal over the positions before, so it
keeps a KV cache of its own (layer id ``num_hidden_layers``: one more full-attention layer of
the engine's KV pool). Its output hidden state feeds its next step when it runs as a chain.

:func:`load_mtp_head` finds the tensors (the checkpoint directory, or the one the model was
loaded from), builds the head on the model's device and dtype, and raises
:class:`MTPWeightsNotFoundError` for a checkpoint without them.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from ..memory import AttentionLayerSpec

MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
PREFIX = "mtp."


class MTPWeightsNotFoundError(ValueError):
    """``speculative={"method": "mtp"}`` on a checkpoint that ships no ``mtp.*`` tensors (or
    whose directory is unknown); the message names the directory."""


class MTPHead(nn.Module):
    """The MTP layer of a Gated DeltaNet family (module docstring) around the target's shared
    embeddings, rotary embedding and LM head.

    ``forward(input_ids [1, N], position_ids [1, N], hidden_states [1, N, H])`` -> the head's
    normed output hidden states ``[1, N, H]`` (the LM head gives the draft logits; the same
    states feed the next chain step).
    """

    def __init__(self, target: nn.Module, layer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        decoder = target.model.language_model if hasattr(target.model, "language_model") else target.model
        norm_class = type(decoder.norm)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = norm_class(hidden_size, eps=eps)
        self.layers = nn.ModuleList([layer])
        self.norm = norm_class(hidden_size, eps=eps)
        # shared with the target (its weights; registered here so the compiled forward sees them)
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.lm_head = target.lm_head
        self.layer_id = int(layer.self_attn.layer_idx)

    def own_modules(self) -> dict[str, nn.Module]:
        """The modules whose weights are the ``mtp.*`` tensors (checkpoint name -> module)."""
        return {"fc": self.fc, "pre_fc_norm_embedding": self.pre_fc_norm_embedding,
                "pre_fc_norm_hidden": self.pre_fc_norm_hidden, "layers.0": self.layers[0], "norm": self.norm}

    def attention_spec(self, kv_dtype: torch.dtype) -> AttentionLayerSpec:
        attn = self.layers[0].self_attn
        head_dim = int(attn.head_dim)
        return AttentionLayerSpec(self.layer_id, attn.k_proj.out_features // head_dim, head_dim, kv_dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        embeds = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden_states)], dim=-1))
        rotary = self.rotary_emb(x, _rotary_positions(self.rotary_emb, position_ids))
        out = self.layers[0](x, position_embeddings=rotary, attention_mask=None, position_ids=position_ids)
        if isinstance(out, tuple):  # (decoder layers of some transformers releases return a tuple)
            out = out[0]
        return self.norm(out)


def _rotary_positions(rotary: nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """Position ids as the family's rotary embedding takes them (Qwen3.5's multimodal rotary
    wants one row per rope section: text positions are the same in every section)."""
    if getattr(rotary, "mrope_section", None) is not None and position_ids.ndim == 2:
        return position_ids[None].expand(3, *position_ids.shape)
    return position_ids


def _text_config(model: nn.Module):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _checkpoint_dir(model: nn.Module, checkpoint) -> str:
    """The directory holding the ``mtp.*`` tensors: ``checkpoint``, or where the model came from."""
    if checkpoint is not None:
        path = os.path.expanduser(os.fspath(checkpoint))
        if not os.path.isdir(path):
            raise MTPWeightsNotFoundError(f"SpeculativeConfig.mtp_checkpoint={path!r} is not a directory")
        return path
    name = getattr(model.config, "_name_or_path", "") or ""
    if name and os.path.isdir(name):
        return name
    if name:
        try:  # a Hub id: the snapshot from_pretrained downloaded (no network access here)
            from huggingface_hub import snapshot_download

            return snapshot_download(name, allow_patterns=["*.safetensors", "*.json"], local_files_only=True)
        except Exception:  # noqa: BLE001 (any failure: not in the local cache)
            pass
    raise MTPWeightsNotFoundError(
        f"speculative method 'mtp': the checkpoint directory of this {type(model).__name__} is unknown "
        f"(config._name_or_path={name!r} is no local directory or cached Hub snapshot); load it with "
        "hc.from_pretrained(dir) or pass speculative={'method': 'mtp', 'mtp_checkpoint': dir}")


def _mtp_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor of a directory's safetensors files (on the CPU, names without
    the prefix)."""
    from ..quantization.fp8_checkpoint import _Checkpoint

    try:
        ckpt = _Checkpoint(path)
    except FileNotFoundError:
        raise MTPWeightsNotFoundError(f"speculative method 'mtp': no safetensors weights in {path!r}") from None
    names = [k for k in ckpt.where if k.startswith(PREFIX)]
    if not names:
        raise MTPWeightsNotFoundError(
            f"speculative method 'mtp': the checkpoint in {path!r} has no mtp.* tensors (it ships no "
            "multi-token-prediction head); use another speculative method (ngram, draft_model, custom)")
    return {k[len(PREFIX):]: ckpt.get(k, "cpu") for k in names}


def _fuse_experts(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Per-expert checkpoint tensors (``{prefix}.{e}.gate_proj.weight`` ...) -> the fused 3-D
    parameters of transformers' experts modules (``gate_up_proj [E, 2I, H]``, gate rows first;
    ``down_proj [E, H, I]``), in place; already fused tensors stay."""
    downs = sorted((k for k in tensors if k.startswith(prefix + ".") and k.endswith(".down_proj.weight")),
                   key=lambda k: int(k[len(prefix) + 1:].split(".")[0]))
    if not downs:
        return
    num = len(downs)
    pop = lambda e, p: tensors.pop(f"{prefix}.{e}.{p}.weight")  # noqa: E731
    tensors[f"{prefix}.gate_up_proj"] = torch.stack(
        [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in range(num)])
    tensors[f"{prefix}.down_proj"] = torch.stack([pop(e, "down_proj") for e in range(num)])


def _layer_config(cfg, moe: bool):
    """A copy of the text config with one more (full-attention) layer, index
    ``num_hidden_layers``, whose MLP is MoE or dense as ``moe`` says."""
    cfg = copy.deepcopy(cfg)
    index = cfg.num_hidden_layers
    cfg.layer_types = list(cfg.layer_types[:index]) + ["full_attention"]
    if hasattr(cfg, "mlp_only_layers"):  # Qwen3-Next picks the MLP kind per layer index
        only = [i for i in cfg.mlp_only_layers if i != index]
        cfg.mlp_only_layers = only if moe else only + [index]
        if moe:
            cfg.decoder_sparse_step = 1
    return cfg, index


def load_mtp_head(model: nn.Module, checkpoint=None) -> MTPHead:
    """The MTP head of ``model`` from the ``mtp.*`` tensors of ``checkpoint`` (a directory; None:
    the one the model was loaded from), on the model's device and dtype, in eval mode."""
    cfg = _text_config(model)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MTP_MODEL_TYPES:
        declared = getattr(cfg, "num_nextn_predict_layers", 0) or 0
        extra = f" (its config declares {declared} MTP layer(s), which hybrid_compile does not build)" if declared else ""
        raise ValueError(
            f"speculative method 'mtp' is not supported for model type {model_type!r}{extra}; MTP heads are built "
            f"for {', '.join(MTP_MODEL_TYPES)}")
    path = _checkpoint_dir(model, checkpoint)
    tensors = _mtp_tensors(path)
    scaled = sorted(k for k in tensors if k.endswith("_scale_inv"))
    if scaled:
        raise ValueError(f"speculative method 'mtp': the mtp.* tensors in {path!r} are FP8-quantized "
                         f"({PREFIX}{scaled[0]}, ...); hybrid_compile loads MTP heads in float only")
    mlp = "layers.0.mlp"
    moe = any(k.startswith(f"{mlp}.experts.") or k == f"{mlp}.gate.weight" for k in tensors)
    _fuse_experts(tensors, f"{mlp}.experts")
    layer_cfg, index = _layer_config(cfg, moe)
    decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
    layer_class = type(decoder.layers[0])
    param = next(p for p in model.parameters() if p.dtype.is_floating_point and p.dtype.itemsize > 1)
    layer = layer_class(layer_cfg, index)
    head = MTPHead(model, layer, cfg.hidden_size, cfg.rms_norm_eps)
    owned = tuple(name + "." for name in head.own_modules())
    stray = sorted(k for k in tensors if not k.startswith(owned))
    if stray:
        raise ValueError(f"speculative method 'mtp': unknown tensors {', '.join(PREFIX + k for k in stray[:4])} in "
                         f"{path!r} (a {model_type} MTP head has {', '.join(PREFIX + n + '*' for n in owned)})")
    for name, module in head.own_modules().items():
        module.to(dtype=param.dtype)
        own = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        missing, unexpected = module.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"speculative method 'mtp': the {PREFIX}{name}.* tensors in {path!r} do not match a "
                f"{type(module).__name__} of this {model_type} config (missing: {sorted(missing)[:4]}, "
                f"unexpected: {sorted(unexpected)[:4]})")
    return head.to(param.device).eval()


__all__ = ["MTPHead", "MTPWeightsNotFoundError", "MTP_MODEL_TYPES", "load_mtp_head"]
