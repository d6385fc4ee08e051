"""Multi-token-prediction (MTP) heads that checkpoints ship beside the model (``mtp.*`` tensors,
which transformers skips when it loads the model), rebuilt from the family's own HF classes.

Qwen3-Next, Qwen3.5 and Qwen3.5-MoE store one MTP layer:

- ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden``: the family's RMSNorm of the next
  token's embedding and of the model's final (normed) hidden state;
- ``mtp.fc``: ``Linear(2H -> H, bias=False)`` over ``[norm(embedding); norm(hidden)]``;
- ``mtp.layers.0``: one full-attention decoder layer of the family (the family's decoder-layer
  class; MoE or dense MLP as the tensors say);
- ``mtp.norm``: the final RMSNorm; embeddings, rotary tables and LM head are the model's.

NemotronH (Nemotron-3 Nano / Super; ``num_nextn_predict_layers: 1``) stores one MTP step as the
blocks of ``mtp_layers_block_type`` (default ``['full_attention', 'moe']``), named as the
model's ``NemotronHBlock``s (``mtp.layers.{j}.norm`` / ``.mixer.*``, experts per expert), with
``mtp.layers.0.enorm`` / ``.hnorm`` / ``.eh_proj`` (the same fusion as above, ``[embedding;
hidden]`` order) and ``mtp.layers.{last}.final_layernorm``; the blocks run in order, each
``x + mixer(norm(x))``, then the final norm. Its attention has no RoPE.

At position ``i`` the head reads the model's hidden state at ``i`` and the embedding of token
``i + 1`` and predicts token ``i + 2``; its attention is causal over the positions before, so it
keeps a KV cache of its own (layer ids from ``num_hidden_layers`` on: more full-attention layers
of the engine's KV pool). Its output hidden state feeds its next step when it runs as a chain.

With a draft token map (``SpeculativeConfig.draft_token_map``) the head's LM head is its own
linear of the map's rows of the target's (:meth:`MTPHead.restrict_vocabulary`).

:func:`load_mtp_head` finds the tensors (the checkpoint directory, or the one the model was
loaded from), builds the head on the model's device and dtype, and raises
:class:`MTPWeightsNotFoundError` for a checkpoint without them.
"""

from __future__ import annotations

import abc
import copy
import os

import torch
from torch import nn

from ..memory import AttentionLayerSpec
from .mamba2_common import attention_spec

GATED_DELTANET_MTP_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
MTP_MODEL_TYPES = (*GATED_DELTANET_MTP_TYPES, "nemotron_h")
PREFIX = "mtp."


class MTPWeightsNotFoundError(ValueError):
    """``speculative={"method": "mtp"}`` on a checkpoint that ships no ``mtp.*`` tensors, lacks
    some the head needs, whose directory is unknown, or (NemotronH) whose config declares no MTP
    layers; the message names the directory and the tensors looked for."""


class MTPHead(nn.Module, abc.ABC):
    """What every family's MTP head shares: the target's embeddings and LM head, the modules whose
    weights are the ``mtp.*`` tensors (:meth:`own_modules`) and the KV pool layers of its attention
    modules (:meth:`attention_specs`; ids from ``num_hidden_layers`` on).

    ``forward(input_ids [1, N], position_ids [1, N], hidden_states [1, N, H])`` -> the head's
    normed output hidden states ``[1, N, H]`` (the LM head gives the draft logits; the same
    states feed the next chain step).
    """

    def __init__(self, target: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        # shared with the target (its weights; registered here so the compiled forward sees them)
        self.embed_tokens = _decoder(target).get_input_embeddings()
        self.lm_head = target.lm_head
        # restrict_vocabulary's map: draft logit column i is token token_map[i] (None: column i is token i)
        self.register_buffer("token_map", None, persistent=False)

    @torch.no_grad()
    def restrict_vocabulary(self, token_map: torch.Tensor) -> None:
        """Draft over the ids of ``token_map`` only (``SpeculativeConfig.draft_token_map``, checked
        by ``engine/speculative/token_map.py``): the head's LM head becomes its own linear of those
        rows of the target's LM head (its bias rows too; the target's module is untouched), so
        draft logit column ``i`` is token ``token_map[i]``, kept in :attr:`token_map` on the
        head's device. An LM head with ``restricted_rows(token_map)`` (tensor parallelism's
        vocab-parallel head: each rank's rows of the map, their logits gathered) builds its own. Refused on an LM head that
        is no plain float linear or holds part of the vocabulary behind another patched forward."""
        full = self.lm_head
        weight, bias = getattr(full, "weight", None), getattr(full, "bias", None)
        if self.token_map is not None:
            raise ValueError("MTPHead.restrict_vocabulary: the head's vocabulary is restricted already")
        restricted_rows = getattr(full, "restricted_rows", None)
        if restricted_rows is not None:  # tensor parallelism's vocab-parallel LM head: each rank's rows of the map
            self.lm_head = restricted_rows(token_map)
            self.token_map = token_map.to(device=weight.device, dtype=torch.int64)
            return
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point \
                or weight.dtype.itemsize < 2:
            raise ValueError(f"SpeculativeConfig.draft_token_map: the LM head ({type(full).__name__}) has no float "
                             "[vocab, hidden] weight to take the map's rows of")
        rows = int(weight.shape[0])
        if int(token_map.max()) >= rows or "forward" in full.__dict__:
            raise ValueError(f"SpeculativeConfig.draft_token_map: the LM head holds {rows} rows"
                             f"{' behind a patched forward (vocab-parallel?)' if 'forward' in full.__dict__ else ''}, "
                             f"not every id of the map (up to {int(token_map.max())})")
        index = token_map.to(device=weight.device, dtype=torch.int64)
        head = nn.Linear(weight.shape[1], index.numel(), bias=bias is not None, device="meta")
        head.weight = nn.Parameter(weight.detach().index_select(0, index).clone(), requires_grad=False)
        if bias is not None:
            head.bias = nn.Parameter(bias.detach().index_select(0, index).clone(), requires_grad=False)
        self.lm_head = head
        self.token_map = index

    @abc.abstractmethod
    def own_modules(self) -> dict[str, nn.Module]:
        """The modules whose weights are the ``mtp.*`` tensors (checkpoint name -> module)."""

    @abc.abstractmethod
    def attention_modules(self) -> list[nn.Module]:
        """The head's attention modules (each with its KV pool id in ``layer_idx``)."""

    @property
    def layer_id(self) -> int:
        """The KV pool id of the head's first attention module."""
        return int(self.attention_modules()[0].layer_idx)

    def attention_specs(self, kv_dtype: torch.dtype) -> list[AttentionLayerSpec]:
        """The KV pool layers of the head's attention modules (the engine adds them to the target's)."""
        return [attention_spec(a, int(a.layer_idx), kv_dtype) for a in self.attention_modules()]


class GatedDeltaNetMTPHead(MTPHead):
    """The MTP layer of a Gated DeltaNet family (Qwen3-Next / Qwen3.5, module docstring)."""

    def __init__(self, target: nn.Module, layer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__(target, hidden_size)
        norm_class = type(_decoder(target).norm)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = norm_class(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = norm_class(hidden_size, eps=eps)
        self.layers = nn.ModuleList([layer])
        self.norm = norm_class(hidden_size, eps=eps)
        self.rotary_emb = _decoder(target).rotary_emb

    def own_modules(self) -> dict[str, nn.Module]:
        return {"fc": self.fc, "pre_fc_norm_embedding": self.pre_fc_norm_embedding,
                "pre_fc_norm_hidden": self.pre_fc_norm_hidden, "layers.0": self.layers[0], "norm": self.norm}

    def attention_modules(self) -> list[nn.Module]:
        return [self.layers[0].self_attn]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        embeds = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden_states)], dim=-1))
        rotary = self.rotary_emb(x, _rotary_positions(self.rotary_emb, position_ids))
        out = self.layers[0](x, position_embeddings=rotary, attention_mask=None, position_ids=position_ids)
        if isinstance(out, tuple):  # (decoder layers of some transformers releases return a tuple)
            out = out[0]
        return self.norm(out)


class NemotronHMTPHead(MTPHead):
    """The MTP step of NemotronH (module docstring): ``enorm`` / ``hnorm`` / ``eh_proj`` on the
    step's first block, the blocks of ``mtp_layers_block_type`` (transformers' ``NemotronHBlock``:
    pre-norm, mixer, residual), ``final_layernorm`` on its last block. No RoPE (NemotronH's
    attention has none)."""

    def __init__(self, target: nn.Module, blocks: list[nn.Module], hidden_size: int, eps: float) -> None:
        super().__init__(target, hidden_size)
        norm_class = type(_decoder(target).norm_f)
        self.enorm = norm_class(hidden_size, eps=eps)
        self.hnorm = norm_class(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList(blocks)
        self.final_layernorm = norm_class(hidden_size, eps=eps)

    def own_modules(self) -> dict[str, nn.Module]:
        last = len(self.layers) - 1
        return {"layers.0.enorm": self.enorm, "layers.0.hnorm": self.hnorm, "layers.0.eh_proj": self.eh_proj,
                f"layers.{last}.final_layernorm": self.final_layernorm,
                **{f"layers.{j}": block for j, block in enumerate(self.layers)}}

    def attention_modules(self) -> list[nn.Module]:
        return [b.mixer for b in self.layers if b.block_type == "full_attention"]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden_states)], dim=-1))
        for block in self.layers:
            x = block(x, attention_mask=None, position_ids=position_ids)
        return self.final_layernorm(x)


def _rotary_positions(rotary: nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """Position ids as the family's rotary embedding takes them (Qwen3.5's multimodal rotary
    wants one row per rope section: text positions are the same in every section)."""
    if getattr(rotary, "mrope_section", None) is not None and position_ids.ndim == 2:
        return position_ids[None].expand(3, *position_ids.shape)
    return position_ids


def _decoder(model: nn.Module) -> nn.Module:
    """The causal LM's decoder (the text decoder of a multimodal wrapper)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


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


def _mtp_names(path: str, looked_for: str):
    """The checkpoint of a directory's safetensors files (nothing read yet) and its ``mtp.*``
    tensor names without the prefix; ``looked_for`` names the family's tensors in the error for a
    checkpoint without."""
    from ..quantization.fp8_checkpoint import _Checkpoint

    try:
        ckpt = _Checkpoint(path)
    except FileNotFoundError:
        raise MTPWeightsNotFoundError(f"speculative method 'mtp': no safetensors weights in {path!r}") from None
    names = [k[len(PREFIX):] for k in ckpt.where if k.startswith(PREFIX)]
    if not names:
        raise MTPWeightsNotFoundError(
            f"speculative method 'mtp': the checkpoint in {path!r} has no mtp.* tensors (looked for "
            f"{looked_for}: it ships no multi-token-prediction head); use another speculative method (ngram, draft_model, custom)")
    return ckpt, names


def _fuse_experts(tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Per-expert checkpoint tensors (``{prefix}.{e}.gate_proj.weight`` ...) -> the fused 3-D
    parameters of transformers' experts modules, in place; already fused tensors stay. Gated
    experts (Qwen): ``gate_up_proj [E, 2I, H]``, gate rows first; NemotronH's ungated ones:
    ``up_proj [E, I, H]``; both ``down_proj [E, H, I]``."""
    downs = sorted((k for k in tensors if k.startswith(prefix + ".") and k.endswith(".down_proj.weight")),
                   key=lambda k: int(k[len(prefix) + 1:].split(".")[0]))
    if not downs:
        return
    num = len(downs)
    pop = lambda e, p: tensors.pop(f"{prefix}.{e}.{p}.weight")  # noqa: E731
    if f"{prefix}.0.gate_proj.weight" in tensors:
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in range(num)])
    else:
        tensors[f"{prefix}.up_proj"] = torch.stack([pop(e, "up_proj") for e in range(num)])
    tensors[f"{prefix}.down_proj"] = torch.stack([pop(e, "down_proj") for e in range(num)])


def _fuse_all_experts(tensors: dict[str, torch.Tensor]) -> None:
    """:func:`_fuse_experts` for every experts module the tensors hold (``{prefix}.experts.{e}.*``)."""
    for prefix in sorted({k.split(".experts.")[0] + ".experts" for k in tensors if ".experts." in k}):
        _fuse_experts(tensors, prefix)


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


def _build_gated_deltanet_head(model: nn.Module, cfg, names: list[str]) -> MTPHead:
    mlp = "layers.0.mlp"
    moe = any(k.startswith(f"{mlp}.experts.") or k == f"{mlp}.gate.weight" for k in names)
    layer_cfg, index = _layer_config(cfg, moe)
    layer = type(_decoder(model).layers[0])(layer_cfg, index)
    return GatedDeltaNetMTPHead(model, layer, cfg.hidden_size, cfg.rms_norm_eps)


# the block kinds an MTP step may hold: no Mamba2 mixer (it would need a state pool of its own)
_NEMOTRON_H_MTP_BLOCKS = ("full_attention", "moe", "mlp")


def _nemotron_h_pattern(cfg) -> list[str]:
    """The block kinds of NemotronH's MTP step, or one clear error for a config without MTP
    layers (or with a layout the head does not build)."""
    steps = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if steps == 0:
        raise MTPWeightsNotFoundError(
            "speculative method 'mtp': this nemotron_h config declares no MTP layers "
            "(num_nextn_predict_layers = 0); use another speculative method (ngram, draft_model, custom)")
    if steps != 1:
        raise ValueError(f"speculative method 'mtp': nemotron_h with num_nextn_predict_layers={steps}; "
                         "hybrid_compile builds the one-step MTP head (num_nextn_predict_layers = 1)")
    pattern = list(getattr(cfg, "mtp_layers_block_type", None) or [])
    bad = [b for b in pattern if b not in _NEMOTRON_H_MTP_BLOCKS]
    if not pattern or bad or "full_attention" not in pattern:
        raise ValueError(f"speculative method 'mtp': nemotron_h mtp_layers_block_type={pattern!r} is not supported "
                         f"(blocks of {_NEMOTRON_H_MTP_BLOCKS}, at least one full_attention)")
    return pattern


def _build_nemotron_h_head(model: nn.Module, cfg, names: list[str]) -> MTPHead:
    pattern = _nemotron_h_pattern(cfg)
    n = cfg.num_hidden_layers
    # the blocks' config: the model's layer kinds then the MTP step's, so block n + j reads its
    # kind (and an attention mixer its KV pool id) at index n + j
    block_cfg = copy.deepcopy(cfg)
    block_cfg.layers_block_type = list(cfg.layers_block_type) + pattern
    block_class = type(_decoder(model).layers[0])
    blocks = [block_class(block_cfg, n + j) for j in range(len(pattern))]
    return NemotronHMTPHead(model, blocks, cfg.hidden_size, cfg.layer_norm_epsilon)


# model type -> (builder, the tensors the error for a checkpoint without them names)
_BUILDERS = {
    **{t: (_build_gated_deltanet_head, "mtp.fc.weight, mtp.pre_fc_norm_*, mtp.layers.0.*, mtp.norm.weight")
       for t in GATED_DELTANET_MTP_TYPES},
    "nemotron_h": (_build_nemotron_h_head,
                   "mtp.layers.0.enorm/hnorm/eh_proj.weight, mtp.layers.{j}.norm/mixer.*, "
                   "mtp.layers.{last}.final_layernorm.weight"),
}


def _owner(name: str, owned: list[str]) -> str | None:
    """The longest module name of ``owned`` that tensor ``name`` lies under."""
    hits = [o for o in owned if name.startswith(o + ".")]
    return max(hits, key=len) if hits else None


def _check_family(config, cfg) -> str:
    """The tensors the error for a checkpoint without them names, or the error of a family without
    MTP heads or a NemotronH config without MTP layers (``cfg``: ``config``'s text config)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _BUILDERS:
        declared = getattr(cfg, "num_nextn_predict_layers", 0) or 0
        extra = f" (its config declares {declared} MTP layer(s), which hybrid_compile does not build)" if declared else ""
        raise ValueError(
            f"speculative method 'mtp' is not supported for model type {model_type!r}{extra}; MTP heads are built "
            f"for {', '.join(MTP_MODEL_TYPES)}")
    _, looked_for = _BUILDERS[model_type]
    if model_type == "nemotron_h":
        _nemotron_h_pattern(cfg)  # (a config without MTP layers fails before the checkpoint is read)
    return looked_for


def _checked_names(config, cfg, path: str):
    """The checkpoint and ``mtp.*`` names (:func:`_mtp_names`) of ``path`` for a model of ``config``
    (``cfg``: its text config), or the error of a family without MTP heads (:func:`_check_family`),
    a checkpoint without the tensors or with FP8-quantized ones."""
    ckpt, names = _mtp_names(path, _check_family(config, cfg))
    # (block-FP8 "weight_scale_inv" of DeepSeek-style releases; per-tensor "weight_scale" /
    # "input_scale" of NVIDIA ModelOpt ones)
    scaled = sorted(k for k in names if k.endswith(("_scale_inv", "weight_scale", "input_scale")))
    if scaled:
        raise ValueError(f"speculative method 'mtp': the mtp.* tensors in {path!r} are FP8-quantized "
                         f"({PREFIX}{scaled[0]}, ...); hybrid_compile loads MTP heads in float only")
    return ckpt, names


def check_mtp_checkpoint(config, path: str) -> None:
    """Before any model is built (tensor parallelism checks it before a rank starts): a model of
    ``config`` (the checkpoint's) has an MTP head that :func:`load_mtp_head` builds from the
    ``mtp.*`` tensors in ``path``; else the error :func:`load_mtp_head` would raise."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    _checked_names(config, cfg, path)


def load_mtp_head(model: nn.Module, checkpoint=None, shard=None) -> MTPHead:
    """The MTP head of ``model`` from the ``mtp.*`` tensors of ``checkpoint`` (a directory; None:
    the one the model was loaded from), on the model's device and dtype, in eval mode.

    ``shard``: tensor parallelism (``model`` is one rank's, built from its local config): the head
    is built with the local sizes on the meta device and each parameter is read by
    ``shard(checkpoint key) -> tensor``, this rank's part of it (``distributed/loading.py``,
    by the family's sharding plan); a part whose shape is not the local parameter's raises."""
    cfg = _text_config(model)
    model_type = getattr(model.config, "model_type", None)
    _check_family(model.config, cfg)  # (before the directory is looked for)
    path = _checkpoint_dir(model, checkpoint)
    ckpt, names = _checked_names(model.config, cfg, path)
    build, _ = _BUILDERS[model_type]
    if shard is None:
        head = build(model, cfg, names)
    else:  # (local sizes; every parameter is replaced by its shard below)
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            head = build(model, cfg, names)
    param = next(p for p in model.parameters() if p.dtype.is_floating_point and p.dtype.itemsize > 1)
    modules = head.own_modules()
    owned = list(modules)
    stray = sorted(k for k in names if _owner(k, owned) is None)
    if stray:
        raise ValueError(f"speculative method 'mtp': unknown tensors {', '.join(PREFIX + k for k in stray[:4])} in "
                         f"{path!r} (a {model_type} MTP head has {', '.join(PREFIX + n + '.*' for n in owned)})")
    # parameters transformers keeps in float32 whatever the dtype (NemotronH's router weight and bias)
    fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if shard is not None:
        for name, module in modules.items():
            _load_shard(module, name, shard, param, fp32, path, model_type)
        return head.to(param.device).eval()
    tensors = {k: ckpt.get(PREFIX + k, "cpu") for k in names}
    _fuse_all_experts(tensors)
    for name, module in modules.items():
        module.to(dtype=param.dtype)
        for pname, t in [*module.named_parameters(), *module.named_buffers()]:
            if any(f in pname for f in fp32):
                t.data = t.data.float()
        own = {k[len(name) + 1:]: v for k, v in tensors.items() if _owner(k, owned) == name}
        # (a block's state dict excludes the step's norms / projection, owned by their own names)
        missing, unexpected = module.load_state_dict(own, strict=False)
        if missing or unexpected:
            raise (MTPWeightsNotFoundError if missing else ValueError)(
                f"speculative method 'mtp': the {PREFIX}{name}.* tensors in {path!r} do not match a "
                f"{type(module).__name__} of this {model_type} config (missing: "
                f"{sorted(PREFIX + name + '.' + m for m in missing)[:4]}, unexpected: {sorted(unexpected)[:4]})")
    return head.to(param.device).eval()


def _load_shard(module: nn.Module, name: str, shard, param: torch.Tensor, fp32: tuple, path: str,
                model_type: str) -> None:
    """Every parameter of the head's module ``name`` (built on the meta device) from ``shard``
    (:func:`load_mtp_head`), on ``param``'s device and dtype (float32 where transformers keeps it)."""
    for pname, p in list(module.named_parameters()):
        key = f"{PREFIX}{name}.{pname}"
        try:
            value = shard(key)
        except KeyError as e:
            raise MTPWeightsNotFoundError(
                f"speculative method 'mtp': the checkpoint in {path!r} has no tensor {e.args[0]!r} for the "
                f"{type(module).__name__} of this {model_type} MTP head (parameter {key!r})") from None
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"speculative method 'mtp': this rank's part of {key!r} has shape {tuple(value.shape)}, "
                             f"the head's {type(module).__name__} of the rank's config expects {tuple(p.shape)}")
        dtype = torch.float32 if any(f in pname for f in fp32) else param.dtype
        owner_name, _, attr = pname.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._parameters[attr] = nn.Parameter(value.to(device=param.device, dtype=dtype), requires_grad=False)


__all__ = ["GatedDeltaNetMTPHead", "MTPHead", "MTPWeightsNotFoundError", "MTP_MODEL_TYPES", "NemotronHMTPHead",
           "check_mtp_checkpoint", "load_mtp_head"]
