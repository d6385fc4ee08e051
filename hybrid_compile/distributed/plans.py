"""Sharding plans: how each supported family is split over the ranks of a tensor-parallel group.

A plan, built from the checkpoint's config before any weight is read, does three things:

- :meth:`ShardPlan.local_config`: the config of one rank's model: head counts and intermediate
  sizes divided by the group size (KV heads / Mamba B-C groups replicated when there are fewer than
  ranks), so transformers builds every module with the local shapes and the engine's layout sizes
  pools that hold only the rank's heads. Head counts that do not divide raise one error here.
  Modules that transformers sizes from fields the local config must keep whole (LFM2's short conv,
  Zamba2's adapters) are rebuilt on the meta device by :attr:`ShardPlan.local_modules`.
- :meth:`ShardPlan.slice_of`: for each parameter of the local model, the parts of the checkpoint
  tensor(s) it is made of (:class:`Slice`, read with safetensors' ``get_slice``).
- :attr:`ShardPlan.reduced_modules`: the modules whose outputs are partial sums (row-parallel
  output projections, MLP and MoE blocks) and get an all-reduce; the embedding and the LM head are
  vocab-parallel (``distributed/layers.py``).

Layouts split per head (every rank takes contiguous heads; a segment of a fused projection is
split on its own, so ``[q | k | v]`` rows become ``[q_r | k_r | v_r]``):

- attention: q/k/v by heads (a KV head is replicated on the ranks whose query heads use it when
  there are fewer KV heads than ranks), o_proj by input columns. OLMo-Hybrid's ``q_norm`` /
  ``k_norm`` (one RMSNorm over all heads) are split with their heads and reduce their sum of
  squares across the ranks (``cross_rank_norms``; its KV heads must divide).
- Gated DeltaNet: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` rows are grouped per key head,
  so whole key-head groups go to a rank; Qwen3.5's and OLMo-Hybrid's separate projections are
  split per segment (OLMo-Hybrid's conv is saved as three tensors: ``Slice.concat_keys``); conv
  channels, ``A_log`` / ``dt_bias`` per value head; ``out_proj`` / ``o_proj`` by columns.
- Mamba2: heads (gate, x, dt, ``A_log``, ``D``, ``dt_bias``, norm, ``out_proj``); B/C groups split
  when ``n_groups % size == 0`` (a gated norm class that ignores the groups, normalising the whole
  width, is then reduced across ranks); fewer groups than ranks, ``size % n_groups == 0`` (one
  group: every rank): each group's B/C replicated on the ``size / n_groups`` consecutive ranks whose
  heads it serves, its gated norm reduced across those ranks alone (a process subgroup).
- Mamba1 (Mamba, FalconMamba, Jamba): the ``D_inner`` channels (``in_proj`` rows ``[x | z]``, conv,
  ``dt_proj`` rows and bias, ``A_log`` / ``D`` rows, ``out_proj`` columns); ``x_proj`` contracts over
  the channels, so it takes its input columns and its (dt, B, C) output is all-reduced; the dt/B/C
  norms after it are replicated.
- Zamba (v1): its multi-head Mamba1 mixers by heads (per-head ``x_proj_weight`` / ``dt_proj_weight``:
  only ``out_proj`` is reduced); the shared blocks' attention and MLP as above.
- LFM2 short conv: its ``hidden_size`` channels (``in_proj`` rows ``[B | C | x]``, the conv,
  ``out_proj`` columns), rebuilt on the meta device with the local count (``local_modules``).
- RecurrentGemma recurrent blocks: by RG-LRU heads (``linear_x`` / ``linear_y`` rows, conv,
  ``recurrent_param``, the per-head block-diagonal gates, ``linear_out`` columns + all-reduce).
- Zamba2 shared blocks: attention and MLP as above; the LoRA adapters' up projections split with
  the projection they add to (rebuilt with local rows), their down projections replicated.
- MiniMax lightning attention: by heads (``qkv_proj`` rows are per head ``[q | k | v]``, so a head's
  ``3 * head_dim`` rows are contiguous; ``output_gate`` rows, ``out_proj`` columns + all-reduce); its
  RMSNorm spans all heads' channels, so it is split with its heads and reduced across the ranks
  (``cross_rank_norms``); the per-head decay buffers are the rank's heads' (``slope_rate`` is computed
  from the global head count and index: sliced from the checkpoint, recomputed where it holds none).
- dense MLP / MoE experts / shared experts: the intermediate dimension.
- Kimi-Linear: its Kimi Delta Attention layers by heads (q/k/v rows, the conv's ``[q | k | v]``
  channels (saved as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``), the forget gate's ``f_b_proj`` rows,
  ``dt_bias`` (per head and key channel) and ``A_log``, ``b_proj`` rows, the output gate's ``g_b_proj``
  rows, ``o_proj`` columns + all-reduce; the low-rank ``f_a_proj`` / ``g_a_proj`` and the per-head
  ``o_norm`` replicated); its MLA layers by attention heads (``q_proj`` / ``q_b_proj`` and
  ``kv_b_proj`` rows, ``o_proj`` columns + all-reduce). The latent projections ``q_a_proj`` /
  ``kv_a_proj_with_mqa`` and their norms are replicated: the compressed KV row (latent + rope key) is
  shared by every head, so each rank computes and caches the whole row for its heads (its KV pool
  is the single-process one, one KV head ``kv_lora_rank + qk_rope_head_dim`` wide, not split).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Callable

SPLIT, REPLICATE_UNIT, ALL = "split", "unit", "all"


class ShardingError(ValueError):
    """The model cannot be split over this many ranks; the message says which count does not divide."""


@dataclass(frozen=True)
class Segment:
    """``units`` blocks of ``unit_size`` consecutive indices of a fused dimension. ``SPLIT``: each
    rank takes ``units / size`` consecutive blocks; ``REPLICATE_UNIT``: rank r takes block
    ``r * units // size`` (fewer blocks than ranks); ``ALL``: every rank takes all of them."""

    units: int
    unit_size: int
    mode: str = SPLIT

    def ranges(self, offset: int, rank: int, size: int) -> list[tuple[int, int]]:
        if self.mode == ALL:
            return [(offset, offset + self.units * self.unit_size)]
        if self.mode == REPLICATE_UNIT:
            u = rank * self.units // size
            return [(offset + u * self.unit_size, offset + (u + 1) * self.unit_size)]
        per = self.units // size
        return [(offset + rank * per * self.unit_size, offset + (rank + 1) * per * self.unit_size)]

    @property
    def length(self) -> int:
        return self.units * self.unit_size


@dataclass(frozen=True)
class Slice:
    """How one local tensor is read from checkpoint tensor(s).

    ``dim``/``segments``: the full tensor's dimension ``dim`` is the concatenation of
    ``segments``; the local tensor is the concatenation of each segment's part for this rank
    (``segments=()``: the whole tensor, replicated). ``pad_rows``: rows of the local tensor
    (vocab-parallel: the last rank's missing rows are zeros). ``rank0_only``: other ranks hold
    zeros (the bias of a row-parallel projection, added once by the all-reduce).
    ``experts``: the local tensor is ``[E, ...]`` stacked from per-expert checkpoint tensors
    (``key.format(e=...)``), each read with ``dim`` / ``segments``; ``parts`` > 1 concatenates
    several per-expert keys along ``concat_dim`` first (``gate_up_proj`` from gate and up).
    ``concat_keys``: when the checkpoint has no tensor of the parameter's name, the full tensor is
    the concatenation along ``dim`` of these keys (``{p}``: the parent of the parameter's module), e.g.
    OLMo-Hybrid's ``conv1d`` saved as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``.
    """

    dim: int = 0
    segments: tuple[Segment, ...] = ()
    pad_rows: int | None = None
    rank0_only: bool = False
    vocab: tuple[int, int] | None = None  # (start, stop) rows of the full vocabulary
    experts: int = 0
    expert_keys: tuple[str, ...] = ()
    concat_dim: int = 0
    concat_keys: tuple[str, ...] = ()


def _split(units: int, size: int, what: str, family: str) -> int:
    if units % size:
        raise ShardingError(
            f"tensor_parallel_size={size}: {family} has {what}={units}, which does not divide by {size}; "
            f"use a tensor_parallel_size that divides it"
        )
    return units // size


def _kv_mode(kv: int, heads: int, size: int, family: str) -> tuple[int, str]:
    """(local KV heads, segment mode): split when they divide, else replicated per rank."""
    if kv % size == 0:
        return kv // size, SPLIT
    if size % kv == 0 and heads % size == 0:
        return 1, REPLICATE_UNIT
    raise ShardingError(
        f"tensor_parallel_size={size}: {family} has {kv} KV heads: neither a multiple nor a divisor of {size}"
    )


@dataclass
class ShardPlan:
    """Base of the per-family plans (module docstring). ``config``: the checkpoint's (text) config."""

    family: str
    size: int
    rank: int
    config: object
    rules: list[tuple[re.Pattern, Slice]] = field(default_factory=list)
    reduced_modules: list[re.Pattern] = field(default_factory=list)
    # modules matching these are reduced only when they are an MLP or MoE block (NemotronH's mixers)
    reduced_blocks: list[re.Pattern] = field(default_factory=list)
    # RMSNorms over channels split across ranks (layers.cross_rank_rms_norm): (pattern, full width, gated: a
    # Mamba2 gated norm whose group spans several ranks, ranks: how many consecutive ranks one norm spans,
    # the plan's size but for Mamba2 groups shared by fewer ranks; such a norm built without grouping,
    # transformers 5.17's, spans every rank: runtime.install_collectives decides on the built module)
    cross_rank_norms: list[tuple[re.Pattern, int, bool, int]] = field(default_factory=list)
    # Mamba2 gated norms whose B/C groups are split across the ranks: (pattern, full width). Grouped
    # norms stay local; a norm class with no grouping (no ``group_size`` / ``n_groups``: transformers
    # 5.17's Mamba2, Bamba and GraniteMoeHybrid norms normalise the whole width) is reduced across
    # the ranks like the one-group case (runtime.install_collectives decides on the built module)
    split_group_norms: list[tuple[re.Pattern, int]] = field(default_factory=list)
    local_fields: dict = field(default_factory=dict)  # text-config fields -> local values
    # modules that transformers builds from sizes the local config cannot shrink (LFM2's short conv:
    # from hidden_size), rebuilt on the meta device with the local sizes: (pattern, rebuild(module))
    local_modules: list[tuple[re.Pattern, Callable]] = field(default_factory=list)

    def add(self, pattern: str, s: Slice) -> None:
        self.rules.append((re.compile(pattern + r"$"), s))

    def reduce(self, pattern: str) -> None:
        self.reduced_modules.append(re.compile(pattern + r"$"))

    def slice_of(self, name: str) -> Slice:
        for pattern, s in self.rules:
            if pattern.search(name):
                return s
        return Slice()  # replicated (norms, routers, ...)

    def is_reduced(self, module_name: str, module) -> bool:
        if any(p.search(module_name) for p in self.reduced_modules):
            return True
        is_block = hasattr(module, "experts") or (hasattr(module, "down_proj") and hasattr(module, "up_proj"))
        return is_block and any(p.search(module_name) for p in self.reduced_blocks)

    def local_config(self, full_config):
        """A deep copy of ``full_config`` whose text config has the local sizes."""
        cfg = copy.deepcopy(full_config)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        for k, v in self.local_fields.items():
            if isinstance(v, float):  # (Mamba2's expand: a fraction of the hidden size, int-typed in its config)
                object.__setattr__(text, k, v)
            else:
                setattr(text, k, v)
        return cfg

    # -- building blocks shared by the families ------------------------------------------------
    def vocab_parallel(self, *patterns: str) -> None:
        v = int(self.config.vocab_size)
        local = -(-v // self.size)
        start = min(v, self.rank * local)
        for p in patterns:
            self.add(p, Slice(pad_rows=local, vocab=(start, min(v, start + local))))

    def attention(self, prefix: str, heads: int, kv: int, head_dim: int, q_rows_per_head: int | None = None,
                  out: str = "o_proj") -> int:
        n = self.size
        _split(heads, n, "num_attention_heads", self.family)
        local_kv, mode = _kv_mode(kv, heads, n, self.family)
        qh = q_rows_per_head or head_dim
        self.add(prefix + r"\.q_proj\.(weight|bias)", Slice(0, (Segment(heads, qh),)))
        for proj in ("k_proj", "v_proj"):
            self.add(prefix + rf"\.{proj}\.(weight|bias)", Slice(0, (Segment(kv, head_dim, mode),)))
        self.add(prefix + rf"\.{out}\.weight", Slice(1, (Segment(heads, head_dim),)))
        self.add(prefix + rf"\.{out}\.bias", Slice(rank0_only=True))
        self.reduce(prefix + rf"\.{out}")
        return local_kv

    def mlp(self, prefix: str, intermediate: int, what: str, gate: str = "gate_proj", up: str = "up_proj",
            down: str = "down_proj") -> None:
        _split(intermediate, self.size, what, self.family)
        for proj in (gate, up):
            if proj:
                self.add(prefix + rf"\.{proj}\.(weight|bias)", Slice(0, (Segment(intermediate, 1),)))
        self.add(prefix + rf"\.{down}\.weight", Slice(1, (Segment(intermediate, 1),)))
        self.add(prefix + rf"\.{down}\.bias", Slice(rank0_only=True))

    def fused_experts(self, prefix: str, experts: int, intermediate: int, gated: bool = True,
                      names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                      field: str = "moe_intermediate_size") -> None:
        """transformers' fused experts ``gate_up_proj [E, 2I, H]`` (or ``up_proj [E, I, H]``) and
        ``down_proj [E, H, I]``, from fused or per-expert checkpoint tensors (``names``: the
        per-expert gate, up and down projections, e.g. LFM2-MoE's ``w1``, ``w3``, ``w2``);
        ``field``: the config field of ``intermediate`` (named when it does not divide)."""
        _split(intermediate, self.size, field, self.family)
        seg = Segment(intermediate, 1)
        gate, up, down = (f"{{p}}.{{e}}.{n}.weight" for n in names)
        if gated:
            self.add(prefix + r"\.gate_up_proj", Slice(1, (seg, seg), experts=experts, concat_dim=0,
                                                       expert_keys=(gate, up)))
        else:
            self.add(prefix + r"\.up_proj", Slice(1, (seg,), experts=experts, expert_keys=(up,)))
        self.add(prefix + r"\.down_proj", Slice(2, (seg,), experts=experts, expert_keys=(down,)))


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def gdn_plan(config, size: int, rank: int) -> ShardPlan:
    """Qwen3-Next / Qwen3.5 (dense and MoE) / OLMo-Hybrid."""
    cfg = _text(config)
    family = cfg.model_type
    plan = ShardPlan(family, size, rank, cfg)
    heads, kv, hd = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), _head_dim(cfg)
    # Qwen3-Next / Qwen3.5 attention: q_proj holds [query | gate] per head
    gated = family.startswith(("qwen3_next", "qwen3_5"))
    if family == "olmo_hybrid":
        # q_norm / k_norm normalise all heads at once: each rank holds its heads' weights and the
        # norm's sum of squares is all-reduced; a KV head replicated on several ranks would count twice
        _split(kv, size, "num_key_value_heads", family)
        plan.add(r"\.self_attn\.q_norm\.weight", Slice(0, (Segment(heads, hd),)))
        plan.add(r"\.self_attn\.k_norm\.weight", Slice(0, (Segment(kv, hd),)))
        plan.cross_rank_norms += [(re.compile(r"\.self_attn\.q_norm$"), heads * hd, False, size),
                                  (re.compile(r"\.self_attn\.k_norm$"), kv * hd, False, size)]
    local_kv = plan.attention(r"\.self_attn", heads, kv, hd, q_rows_per_head=2 * hd if gated else hd)
    hk, hv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    kd, vd = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim)
    _split(hk, size, "linear_num_key_heads", family)
    _split(hv, size, "linear_num_value_heads", family)
    per = hv // hk
    p = r"\.linear_attn"
    qkv = (Segment(hk, kd), Segment(hk, kd), Segment(hv, vd))
    plan.add(p + r"\.in_proj_qkvz\.weight", Slice(0, (Segment(hk, 2 * kd + 2 * per * vd),)))
    plan.add(p + r"\.in_proj_ba\.weight", Slice(0, (Segment(hk, 2 * per),)))
    plan.add(p + r"\.in_proj_qkv\.weight", Slice(0, qkv))
    plan.add(p + r"\.in_proj_z\.weight", Slice(0, (Segment(hv, vd),)))
    plan.add(p + r"\.in_proj_[ab]\.weight", Slice(0, (Segment(hv, 1),)))
    plan.add(p + r"\.[qk]_proj\.weight", Slice(0, (Segment(hk, kd),)))  # OLMo-Hybrid's separate projections
    plan.add(p + r"\.[vg]_proj\.weight", Slice(0, (Segment(hv, vd),)))
    plan.add(p + r"\.[ab]_proj\.weight", Slice(0, (Segment(hv, 1),)))
    plan.add(p + r"\.conv1d\.weight", Slice(0, qkv, concat_keys=tuple(f"{{p}}.{x}_conv1d.weight" for x in "qkv")))
    plan.add(p + r"\.(A_log|dt_bias)", Slice(0, (Segment(hv, 1),)))
    plan.add(p + r"\.(out|o)_proj\.weight", Slice(1, (Segment(hv, vd),)))
    plan.reduce(p + r"\.(out|o)_proj")
    if getattr(cfg, "intermediate_size", None):
        plan.mlp(r"\.mlp", int(cfg.intermediate_size), "intermediate_size")
    fields = dict(num_attention_heads=heads // size, num_key_value_heads=local_kv, head_dim=hd,
                  linear_num_key_heads=hk // size, linear_num_value_heads=hv // size)
    if getattr(cfg, "intermediate_size", None):
        fields["intermediate_size"] = int(cfg.intermediate_size) // size
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    if experts and getattr(cfg, "moe_intermediate_size", None):
        plan.fused_experts(r"\.mlp\.experts", experts, int(cfg.moe_intermediate_size))
        fields["moe_intermediate_size"] = int(cfg.moe_intermediate_size) // size
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        if shared:
            plan.mlp(r"\.mlp\.shared_expert", shared, "shared_expert_intermediate_size")
            fields["shared_expert_intermediate_size"] = shared // size
    plan.reduce(r"\.layers\.\d+\.mlp")  # dense MLP or the whole MoE block (routed + shared experts)
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = fields
    return plan


def _mamba_heads(plan: ShardPlan, prefix: str, heads: int, head_dim: int, groups: int, state: int) -> int:
    """The Mamba2 mixer's parameters (``in_proj`` rows ``[gate | x | B | C | dt]``, conv channels
    ``[x | B | C]``), heads split; B/C groups split when they divide, or with one group, B/C
    replicated on every rank and the gated norm over that group reduced across the ranks
    (``layers.cross_rank_rms_norm``), and likewise with fewer groups than ranks: a group's B/C on the
    ranks that serve its heads, its norm reduced across them. Returns the local group count."""
    n = plan.size
    _split(heads, n, "the Mamba2 head count", plan.family)
    if groups % n == 0:
        bc, local_groups = Segment(groups, state), groups // n
        plan.split_group_norms.append((re.compile(prefix + r"\.norm$"), heads * head_dim))
    elif n % groups == 0:  # (one group: every rank) rank r serves group r // (n / groups): heads split evenly
        bc, local_groups = Segment(groups, state, REPLICATE_UNIT), 1
        plan.cross_rank_norms.append((re.compile(prefix + r"\.norm$"), heads * head_dim // groups, True, n // groups))
    else:
        raise ShardingError(
            f"tensor_parallel_size={n}: {plan.family} has n_groups={groups} Mamba2 B/C groups: neither a multiple "
            f"nor a divisor of {n} (a rank's heads would span parts of two groups)"
        )
    x = Segment(heads, head_dim)
    plan.add(prefix + r"\.in_proj\.weight", Slice(0, (x, x, bc, bc, Segment(heads, 1))))
    plan.add(prefix + r"\.in_proj\.bias", Slice(0, (x, x, bc, bc, Segment(heads, 1))))
    plan.add(prefix + r"\.conv1d\.(weight|bias)", Slice(0, (x, bc, bc)))
    plan.add(prefix + r"\.(A_log|D|dt_bias)", Slice(0, (Segment(heads, 1),)))
    plan.add(prefix + r"\.norm\.weight", Slice(0, (x,)))
    plan.add(prefix + r"\.out_proj\.weight", Slice(1, (x,)))
    plan.add(prefix + r"\.out_proj\.bias", Slice(rank0_only=True))
    plan.reduce(prefix + r"\.out_proj")
    return local_groups


def mamba2_plan(config, size: int, rank: int) -> ShardPlan:
    cfg = _text(config)
    plan = ShardPlan("mamba2", size, rank, cfg)
    heads, hd, groups = int(cfg.num_heads), int(cfg.head_dim), int(cfg.n_groups)
    local_groups = _mamba_heads(plan, r"\.mixer", heads, hd, groups, int(cfg.state_size))
    inter = int(cfg.expand * cfg.hidden_size)
    if inter != heads * hd:
        raise ShardingError(f"mamba2: expand * hidden_size = {inter} but num_heads * head_dim = {heads * hd}")
    plan.local_fields = dict(num_heads=heads // size, n_groups=local_groups, expand=cfg.expand / size)
    plan.vocab_parallel(r"embeddings\.weight", r"lm_head\.weight")
    return plan


def nemotron_h_plan(config, size: int, rank: int) -> ShardPlan:
    cfg = _text(config)
    plan = ShardPlan("nemotron_h", size, rank, cfg)
    heads, hd, groups = int(cfg.mamba_num_heads), int(cfg.mamba_head_dim), int(cfg.n_groups)
    local_groups = _mamba_heads(plan, r"\.mixer", heads, hd, groups, int(cfg.ssm_state_size))
    local_kv = plan.attention(r"\.mixer", int(cfg.num_attention_heads), int(cfg.num_key_value_heads), _head_dim(cfg))
    fields = dict(mamba_num_heads=heads // size, n_groups=local_groups,
                  num_attention_heads=int(cfg.num_attention_heads) // size, num_key_value_heads=local_kv,
                  head_dim=_head_dim(cfg))
    plan.mlp(r"\.layers\.\d+\.mixer", int(cfg.intermediate_size), "intermediate_size", gate="")
    fields["intermediate_size"] = int(cfg.intermediate_size) // size
    experts = int(getattr(cfg, "n_routed_experts", 0) or 0)
    if experts:
        plan.fused_experts(r"\.mixer\.experts", experts, int(cfg.moe_intermediate_size), gated=False)
        fields["moe_intermediate_size"] = int(cfg.moe_intermediate_size) // size
        shared = int(getattr(cfg, "moe_shared_expert_intermediate_size", 0) or 0)
        if shared:
            plan.mlp(r"\.mixer\.shared_experts", shared, "moe_shared_expert_intermediate_size", gate="")
            fields["moe_shared_expert_intermediate_size"] = shared // size
    plan.reduced_blocks.append(re.compile(r"\.layers\.\d+\.mixer$"))  # MLP and MoE mixers
    plan.local_fields = fields
    plan.vocab_parallel(r"embeddings\.weight", r"lm_head\.weight")
    return plan


def _mamba2_family(config, size: int, rank: int, *, mixer: str, heads: str, head_dim: str, groups: str,
                   state: str, mlp: str | None) -> tuple[ShardPlan, dict]:
    """Bamba / Granite-4 / Falcon-H1: Mamba2 mixers, attention with its own head_dim and an MLP."""
    cfg = _text(config)
    plan = ShardPlan(cfg.model_type, size, rank, cfg)
    h, hd, g = int(getattr(cfg, heads)), int(getattr(cfg, head_dim)), int(getattr(cfg, groups))
    local_groups = _mamba_heads(plan, rf"\.{mixer}", h, hd, g, int(getattr(cfg, state)))
    local_kv = plan.attention(r"\.self_attn", int(cfg.num_attention_heads), int(cfg.num_key_value_heads),
                              _head_dim(cfg))
    fields = {heads: h // size, groups: local_groups, "num_attention_heads": int(cfg.num_attention_heads) // size,
              "num_key_value_heads": local_kv, "head_dim": _head_dim(cfg)}
    if mlp is not None:
        plan.mlp(rf"\.{mlp}", int(cfg.intermediate_size), "intermediate_size")
        plan.reduce(rf"\.layers\.\d+\.{mlp}")
        fields["intermediate_size"] = int(cfg.intermediate_size) // size
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    return plan, fields


def _local_expand(expand, size: int):
    """A rank's ``mamba_expand`` (the mixer's width is ``mamba_expand * hidden_size``): an int when
    it stays whole, else the fraction (set past the config's int type, see ``local_config``)."""
    local = expand / size
    return int(local) if float(local).is_integer() else local


def bamba_plan(config, size: int, rank: int) -> ShardPlan:
    plan, fields = _mamba2_family(config, size, rank, mixer="mamba", heads="mamba_n_heads", head_dim="mamba_d_head",
                                  groups="mamba_n_groups", state="mamba_d_state", mlp="feed_forward")
    fields["mamba_expand"] = _local_expand(plan.config.mamba_expand, size)
    plan.local_fields = fields
    return plan


def falcon_h1_plan(config, size: int, rank: int) -> ShardPlan:
    plan, fields = _mamba2_family(config, size, rank, mixer="mamba", heads="mamba_n_heads", head_dim="mamba_d_head",
                                  groups="mamba_n_groups", state="mamba_d_state", mlp="feed_forward")
    cfg = plan.config
    if plan.cross_rank_norms and getattr(cfg, "mamba_rms_norm", False) and getattr(cfg, "mamba_norm_before_gate", False):
        raise ShardingError(f"tensor_parallel_size={size}: falcon_h1 with Mamba2 groups shared by several ranks and a "
                            "norm before the gate is not supported yet")
    fields["mamba_d_ssm"] = int(cfg.mamba_d_ssm) // size
    plan.local_fields = fields
    return plan


def granitemoehybrid_plan(config, size: int, rank: int) -> ShardPlan:
    plan, fields = _mamba2_family(config, size, rank, mixer="mamba", heads="mamba_n_heads", head_dim="mamba_d_head",
                                  groups="mamba_n_groups", state="mamba_d_state", mlp=None)
    cfg = plan.config
    fields["mamba_expand"] = _local_expand(cfg.mamba_expand, size)
    experts = int(getattr(cfg, "num_local_experts", 0) or 0)
    if experts:
        plan.fused_experts(r"\.block_sparse_moe\.experts", experts, int(cfg.intermediate_size),
                           field="intermediate_size")
        plan.reduce(r"\.layers\.\d+\.block_sparse_moe")
        fields["intermediate_size"] = int(cfg.intermediate_size) // size
    shared = int(getattr(cfg, "shared_intermediate_size", 0) or 0)
    if shared:  # input_linear holds [gate | up] rows
        _split(shared, size, "shared_intermediate_size", plan.family)
        seg = Segment(shared, 1)
        plan.add(r"\.shared_mlp\.input_linear\.weight", Slice(0, (seg, seg)))
        plan.add(r"\.shared_mlp\.output_linear\.weight", Slice(1, (seg,)))
        plan.reduce(r"\.layers\.\d+\.shared_mlp")
        fields["shared_intermediate_size"] = shared // size
    plan.local_fields = fields
    return plan


def zamba2_plan(config, size: int, rank: int) -> ShardPlan:
    """Zamba2: Mamba2 mixers by heads; the shared transformer blocks' attention (input
    ``2 * hidden_size``) by heads and their MLP (``gate_up_proj`` rows ``[gate | up]``) by the
    intermediate dimension. The per-use LoRA adapters' down projections (``...adapter_list.i.0``)
    are replicated and their up projections split like the projection they add to. A block's
    uses share its weights: the tied copies are the loader's (transformers' tied-weight keys)."""
    cfg = _text(config)
    plan = ShardPlan("zamba2", size, rank, cfg)
    h, hd, g = int(cfg.n_mamba_heads), int(cfg.mamba_headdim), int(cfg.mamba_ngroups)
    local_groups = _mamba_heads(plan, r"\.mamba", h, hd, g, int(cfg.mamba_d_state))
    heads, kv, ahd = int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(cfg.attention_head_dim)
    attn = r"\.shared_transformer\.self_attn"
    local_kv = plan.attention(attn, heads, kv, ahd)
    plan.add(attn + r"\.linear_q_adapter_list\.\d+\.1\.weight", Slice(0, (Segment(heads, ahd),)))
    _, kv_mode = _kv_mode(kv, heads, size, plan.family)
    plan.add(attn + r"\.linear_[kv]_adapter_list\.\d+\.1\.weight", Slice(0, (Segment(kv, ahd, kv_mode),)))
    # transformers sizes the adapters' outputs by attention_hidden_size (the whole q/k/v width)
    plan.local_modules += [(re.compile(attn + r"\.linear_q_adapter_list\.\d+$"), _local_adapter(heads // size * ahd)),
                           (re.compile(attn + r"\.linear_[kv]_adapter_list\.\d+$"), _local_adapter(local_kv * ahd))]
    inter = int(cfg.intermediate_size)
    ff = r"\.shared_transformer\.feed_forward"
    _split(inter, size, "intermediate_size", plan.family)
    seg = Segment(inter, 1)
    plan.add(ff + r"\.gate_up_proj(_adapter_list\.\d+\.1)?\.weight", Slice(0, (seg, seg)))
    plan.add(ff + r"\.gate_up_proj\.bias", Slice(0, (seg, seg)))
    plan.add(ff + r"\.down_proj\.weight", Slice(1, (seg,)))
    plan.add(ff + r"\.down_proj\.bias", Slice(rank0_only=True))
    plan.reduce(r"\.layers\.\d+\.shared_transformer\.feed_forward")
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = dict(n_mamba_heads=h // size, mamba_ngroups=local_groups,
                             mamba_expand=_local_expand(cfg.mamba_expand, size), num_attention_heads=heads // size,
                             num_key_value_heads=local_kv, intermediate_size=inter // size)
    return plan


def _mamba1_channels(plan: ShardPlan, prefix: str, d_inner: int) -> int:
    """A Mamba1 mixer's parameters split by its ``d_inner`` channels; returns the local count."""
    local = _split(d_inner, plan.size, "the Mamba1 intermediate size (expand * hidden_size)", plan.family)
    c = Segment(d_inner, 1)
    plan.add(prefix + r"\.in_proj\.(weight|bias)", Slice(0, (c, c)))  # rows [x | z]
    plan.add(prefix + r"\.conv1d\.(weight|bias)", Slice(0, (c,)))
    plan.add(prefix + r"\.x_proj\.weight", Slice(1, (c,)))
    plan.reduce(prefix + r"\.x_proj")  # contracts over the channels: partial (dt, B, C) per rank
    plan.add(prefix + r"\.dt_proj\.(weight|bias)", Slice(0, (c,)))
    plan.add(prefix + r"\.(A_log|D)", Slice(0, (c,)))
    plan.add(prefix + r"\.out_proj\.weight", Slice(1, (c,)))
    plan.add(prefix + r"\.out_proj\.bias", Slice(rank0_only=True))
    plan.reduce(prefix + r"\.out_proj")
    return local


def mamba1_plan(config, size: int, rank: int) -> ShardPlan:
    """Mamba / FalconMamba: every layer a Mamba1 mixer (``backbone.layers.i.mixer``)."""
    cfg = _text(config)
    plan = ShardPlan(cfg.model_type, size, rank, cfg)
    local = _mamba1_channels(plan, r"\.mixer", int(cfg.intermediate_size))
    plan.local_fields = dict(intermediate_size=local)
    plan.vocab_parallel(r"embeddings\.weight", r"lm_head\.weight")
    return plan


def jamba_plan(config, size: int, rank: int) -> ShardPlan:
    """Jamba: Mamba1 mixers (``.mamba``), attention by heads, the dense MLP and the experts by their
    intermediate dimension (the whole ``feed_forward`` block is reduced)."""
    cfg = _text(config)
    plan = ShardPlan("jamba", size, rank, cfg)
    _mamba1_channels(plan, r"\.mamba", int(cfg.mamba_expand) * int(cfg.hidden_size))
    hd = _head_dim(cfg)
    local_kv = plan.attention(r"\.self_attn", int(cfg.num_attention_heads), int(cfg.num_key_value_heads), hd)
    inter = int(cfg.intermediate_size)
    plan.mlp(r"\.feed_forward", inter, "intermediate_size")
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    if experts > 1:
        plan.fused_experts(r"\.feed_forward\.experts", experts, inter, field="intermediate_size")
    plan.reduce(r"\.layers\.\d+\.feed_forward")  # dense MLP or the whole MoE block
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = dict(mamba_expand=_local_expand(cfg.mamba_expand, size),
                             num_attention_heads=int(cfg.num_attention_heads) // size, num_key_value_heads=local_kv,
                             head_dim=hd, intermediate_size=inter // size)
    return plan


def zamba_plan(config, size: int, rank: int) -> ShardPlan:
    """Zamba (v1): the multi-head Mamba1 mixers by heads (each head's x_proj / dt_proj / B / C are its
    own, so nothing but ``out_proj`` is reduced; ``in_proj`` rows interleave x and the gate per channel,
    a head's rows are contiguous); the shared transformer blocks' attention (input ``2 * hidden_size``)
    by heads and their MLP by the intermediate dimension."""
    cfg = _text(config)
    plan = ShardPlan("zamba", size, rank, cfg)
    heads = int(cfg.n_mamba_heads)
    _split(heads, size, "n_mamba_heads", plan.family)
    head_dim = int(cfg.mamba_expand) * int(cfg.hidden_size) // heads
    p = r"\.mamba"
    plan.add(p + r"\.in_proj\.(weight|bias)", Slice(0, (Segment(heads, 2 * head_dim),)))
    plan.add(p + r"\.conv1d\.(weight|bias)", Slice(0, (Segment(heads, head_dim),)))
    plan.add(p + r"\.(x_proj_weight|dt_proj_weight|dt_proj_bias|A_log|D)", Slice(0, (Segment(heads, 1),)))
    plan.add(p + r"\.out_proj\.weight", Slice(1, (Segment(heads, head_dim),)))
    plan.add(p + r"\.out_proj\.bias", Slice(rank0_only=True))
    plan.reduce(p + r"\.out_proj")
    ahd = int(cfg.attention_head_dim)
    local_kv = plan.attention(r"\.shared_transf\.self_attn", int(cfg.num_attention_heads), int(cfg.num_key_value_heads),
                              ahd)
    inter = int(cfg.intermediate_size)
    plan.mlp(r"\.shared_transf\.feed_forward", inter, "intermediate_size")
    plan.reduce(r"\.shared_transf\.feed_forward")
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = dict(n_mamba_heads=heads // size, mamba_expand=_local_expand(cfg.mamba_expand, size),
                             num_attention_heads=int(cfg.num_attention_heads) // size, num_key_value_heads=local_kv,
                             attention_head_dim=ahd, intermediate_size=inter // size)
    return plan


def _local_adapter(rows: int) -> Callable:
    """Rebuild a Zamba2 LoRA adapter (``Sequential(down, up)``; ``Identity`` where a use has none)
    with an up projection of ``rows`` local output rows."""
    def rebuild(adapter) -> None:
        from torch import nn

        if isinstance(adapter, nn.Sequential):
            up = adapter[1]
            adapter[1] = nn.Linear(up.in_features, rows, bias=up.bias is not None, device=up.weight.device)
    return rebuild


def _local_short_conv(channels: int) -> Callable:
    """Rebuild an LFM2 ``*ShortConv`` (built by transformers with ``hidden_size`` channels) with
    ``channels`` local ones: ``in_proj`` rows ``[B | C | x]``, the depthwise conv and ``out_proj``'s
    input columns (its output stays the whole hidden size)."""
    def rebuild(mixer) -> None:
        from torch import nn

        conv, inp, out = mixer.conv, mixer.in_proj, mixer.out_proj
        mixer.conv = nn.Conv1d(channels, channels, kernel_size=conv.kernel_size, groups=channels,
                               bias=conv.bias is not None, padding=conv.padding, device=conv.weight.device)
        mixer.in_proj = nn.Linear(inp.in_features, 3 * channels, bias=inp.bias is not None, device=inp.weight.device)
        mixer.out_proj = nn.Linear(channels, out.out_features, bias=out.bias is not None, device=out.weight.device)
    return rebuild


def _lfm2_ff_dim(cfg) -> int:
    """The dense feed-forward width transformers' LFM2 MLP builds (``block_auto_adjust_ff_dim``:
    2/3 of ``intermediate_size``, times ``block_ffn_dim_multiplier``, rounded up to a multiple of
    ``block_multiple_of``)."""
    inter = int(cfg.intermediate_size)
    if getattr(cfg, "block_auto_adjust_ff_dim", False):
        inter = int(2 * inter / 3)
        if cfg.block_ffn_dim_multiplier is not None:
            inter = int(cfg.block_ffn_dim_multiplier * inter)
            inter = cfg.block_multiple_of * ((inter + cfg.block_multiple_of - 1) // cfg.block_multiple_of)
    return inter


def lfm2_plan(config, size: int, rank: int) -> ShardPlan:
    """LFM2 / LFM2-MoE / LFM3: attention by heads (the per-head q/k layernorms replicated; LFM3's
    sliding-window layers split the same way, its per-head output gate ``g_proj`` by rows with its
    heads), the short conv's ``hidden_size`` channels split (rebuilt with the local count:
    ``local_modules``), the dense MLP (``w1`` / ``w3`` / ``w2``) and the experts by their
    intermediate dimension."""
    cfg = _text(config)
    plan = ShardPlan(cfg.model_type, size, rank, cfg)
    hd, heads = _head_dim(cfg), int(cfg.num_attention_heads)
    lfm3 = cfg.model_type == "lfm3"  # Qwen3-style attention: ``o_proj`` and the output gate
    local_kv = plan.attention(r"\.self_attn", heads, int(cfg.num_key_value_heads), hd,
                              out="o_proj" if lfm3 else "out_proj")
    if lfm3:
        plan.add(r"\.self_attn\.g_proj\.weight", Slice(0, (Segment(heads, 1),)))
    hidden = int(cfg.hidden_size)
    channels = _split(hidden, size, "hidden_size (the short conv's channels)", plan.family)
    c = Segment(hidden, 1)
    plan.add(r"\.conv\.in_proj\.(weight|bias)", Slice(0, (c, c, c)))
    plan.add(r"\.conv\.conv\.(weight|bias)", Slice(0, (c,)))
    plan.add(r"\.conv\.out_proj\.weight", Slice(1, (c,)))
    plan.add(r"\.conv\.out_proj\.bias", Slice(rank0_only=True))
    plan.reduce(r"\.layers\.\d+\.conv\.out_proj")
    plan.local_modules.append((re.compile(r"\.layers\.\d+\.conv$"), _local_short_conv(channels)))
    ff = _lfm2_ff_dim(cfg)
    plan.mlp(r"\.feed_forward", ff, "the feed-forward width", gate="w1", up="w3", down="w2")
    fields = dict(num_attention_heads=heads // size, num_key_value_heads=local_kv, head_dim=hd,
                  intermediate_size=ff // size)
    if hasattr(cfg, "block_auto_adjust_ff_dim"):
        fields["block_auto_adjust_ff_dim"] = False  # the local width is set as it is
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    if experts:
        plan.fused_experts(r"\.feed_forward\.experts", experts, int(cfg.moe_intermediate_size), names=("w1", "w3", "w2"))
        fields["moe_intermediate_size"] = int(cfg.moe_intermediate_size) // size
    plan.reduce(r"\.layers\.\d+\.feed_forward")  # dense MLP or the whole MoE block
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = fields
    return plan


def recurrent_gemma_plan(config, size: int, rank: int) -> ShardPlan:
    """RecurrentGemma: local attention by heads; the recurrent blocks by their RG-LRU heads (the
    gates are block-diagonal per head: ``linear_x`` / ``linear_y`` rows, the conv, the LRU's
    ``recurrent_param`` and per-head gate weights, ``linear_out`` columns + all-reduce); the MLP
    (``intermediate_size // 2`` wide) by its intermediate dimension."""
    cfg = _text(config)
    plan = ShardPlan(cfg.model_type, size, rank, cfg)
    heads, hd, width = int(cfg.num_attention_heads), _head_dim(cfg), int(cfg.lru_width)
    local_kv = plan.attention(r"\.temporal_block", heads, int(cfg.num_key_value_heads), hd)
    _split(heads, size, "num_attention_heads (the RG-LRU heads)", plan.family)
    if width % heads:
        raise ShardingError(f"{plan.family}: lru_width={width} is not a multiple of num_attention_heads={heads}")
    channels, per_head = Segment(heads, width // heads), Segment(heads, 1)
    p = r"\.temporal_block"
    plan.add(p + r"\.linear_[xy]\.(weight|bias)", Slice(0, (channels,)))
    plan.add(p + r"\.conv_1d\.(weight|bias)", Slice(0, (channels,)))
    plan.add(p + r"\.rg_lru\.recurrent_param", Slice(0, (channels,)))
    plan.add(p + r"\.rg_lru\.(input|recurrent)_gate_(weight|bias)", Slice(0, (per_head,)))
    plan.add(p + r"\.linear_out\.weight", Slice(1, (channels,)))
    plan.add(p + r"\.linear_out\.bias", Slice(rank0_only=True))
    plan.reduce(r"\.layers\.\d+\.temporal_block\.linear_out")
    mlp = int(cfg.intermediate_size) // 2  # what transformers' RecurrentGemmaMlp builds
    plan.mlp(r"\.mlp_block", mlp, "the MLP width (intermediate_size // 2)")
    plan.reduce(r"\.layers\.\d+\.mlp_block")
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = dict(num_attention_heads=heads // size, num_key_value_heads=local_kv, head_dim=hd,
                             lru_width=width // size, intermediate_size=2 * (mlp // size))
    return plan



def _rank_lightning_decays(heads: int, rank: int, size: int) -> Callable:
    """Rebuild a MiniMax lightning layer's decay buffers (``slope_rate`` and the block decays derived
    from it) for this rank's heads. transformers computes them from the layer's own head count
    (slope ``2^(-8 h / H)`` for head ``h`` of ``H``): the local layer built with ``H / size`` heads would
    get the slopes of another, smaller model, so they are computed with the whole model's ``H`` (HF's
    ``get_slope_rate`` / ``decay_factors``) and cut to the rank's heads. A softmax attention layer
    (no ``get_slope_rate``) is left as it is."""
    def rebuild(attn) -> None:
        if not hasattr(attn, "get_slope_rate"):
            return
        local = attn.num_attention_heads
        attn.num_attention_heads = heads
        try:
            slope = attn.get_slope_rate()
        finally:
            attn.num_attention_heads = local
        slope = slope[rank * local:(rank + 1) * local]
        for name, value in zip(("slope_rate", "query_decay", "key_decay", "diagonal_decay"),
                               (slope, *attn.decay_factors(slope))):
            old = getattr(attn, name)  # (its dtype too: a bf16 model's slopes are bf16 on one device)
            setattr(attn, name, value.to(device=old.device, dtype=old.dtype))
    return rebuild


def minimax_plan(config, size: int, rank: int) -> ShardPlan:
    """MiniMax: lightning attention layers by heads (module docstring), softmax attention by heads,
    the MoE experts (``intermediate_size``; checkpoints keep Mixtral's per-expert ``w1`` / ``w3`` /
    ``w2``) by their intermediate dimension (the whole MoE block is reduced)."""
    cfg = _text(config)
    plan = ShardPlan("minimax", size, rank, cfg)
    heads, hd = int(cfg.num_attention_heads), _head_dim(cfg)
    local_kv = plan.attention(r"\.self_attn", heads, int(cfg.num_key_value_heads), hd)  # (checks heads % size)
    per_head = Segment(heads, hd)
    p = r"\.self_attn"
    plan.add(p + r"\.qkv_proj\.weight", Slice(0, (Segment(heads, 3 * hd),)))
    plan.add(p + r"\.output_gate\.weight", Slice(0, (per_head,)))
    plan.add(p + r"\.norm\.weight", Slice(0, (per_head,)))
    plan.cross_rank_norms.append((re.compile(p + r"\.norm$"), heads * hd, False, size))
    plan.add(p + r"\.out_proj\.weight", Slice(1, (per_head,)))
    plan.reduce(r"\.layers\.\d+\.self_attn\.out_proj")
    # the decay buffers the checkpoint holds: [H, 1, 1], [H, B, 1], [H, B, 1], [1, H, B, B]
    plan.add(p + r"\.(slope_rate|query_decay|key_decay)", Slice(0, (Segment(heads, 1),)))
    plan.add(p + r"\.diagonal_decay", Slice(1, (Segment(heads, 1),)))
    plan.local_modules.append((re.compile(r"\.layers\.\d+\.self_attn$"), _rank_lightning_decays(heads, rank, size)))
    inter = int(cfg.intermediate_size)
    plan.fused_experts(r"\.mlp\.experts", int(cfg.num_local_experts), inter, names=("w1", "w3", "w2"),
                       field="intermediate_size")
    plan.reduce(r"\.layers\.\d+\.mlp")
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = dict(num_attention_heads=heads // size, num_key_value_heads=local_kv, head_dim=hd,
                             intermediate_size=inter // size)
    return plan


def kimi_linear_plan(config, size: int, rank: int) -> ShardPlan:
    """Kimi-Linear (module docstring): KDA and MLA layers share parameter names (``self_attn.q_proj``,
    ``self_attn.o_proj``), so each rule names its layers' indices (``config.layer_types``)."""
    cfg = _text(config)
    plan = ShardPlan("kimi_linear", size, rank, cfg)
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    lh, ld = int(cfg.linear_num_heads), int(cfg.linear_head_dim)
    kinds = list(cfg.layer_types)
    kda = [i for i, t in enumerate(kinds) if t == "linear_attention"]
    mla = [i for i, t in enumerate(kinds) if t == "full_attention"]
    fields = {}
    if kda:
        _split(lh, size, "linear_num_heads", plan.family)
        p = rf"\.layers\.({'|'.join(map(str, kda))})\.self_attn"
        ch = Segment(lh, ld)  # a head's key (or value) channels
        plan.add(p + r"\.[qkv]_proj\.weight", Slice(0, (ch,)))
        plan.add(p + r"\.conv1d\.weight", Slice(0, (ch, ch, ch),
                                                concat_keys=tuple(f"{{p}}.{x}_conv1d.weight" for x in "qkv")))
        plan.add(p + r"\.forget_gate\.(f_b_proj\.weight|dt_bias)", Slice(0, (ch,)))
        plan.add(p + r"\.forget_gate\.A_log", Slice(2, (Segment(lh, 1),)))  # [1, 1, H, 1]
        plan.add(p + r"\.b_proj\.weight", Slice(0, (Segment(lh, 1),)))
        plan.add(p + r"\.g_b_proj\.weight", Slice(0, (ch,)))
        plan.add(p + r"\.o_proj\.weight", Slice(1, (ch,)))
        plan.reduce(p + r"\.o_proj")
        fields["linear_num_heads"] = lh // size
        attn_cfg = getattr(cfg, "linear_attn_config", None)
        if isinstance(attn_cfg, dict) and "num_heads" in attn_cfg:  # (the checkpoint's form, read at init)
            fields["linear_attn_config"] = {**attn_cfg, "num_heads": lh // size}
    if mla:
        _split(heads, size, "num_attention_heads", plan.family)
        # HF expands the latent to one K/V head per query head: its KV heads go with the query heads
        _split(kv, size, "num_key_value_heads", plan.family)
        p = rf"\.layers\.({'|'.join(map(str, mla))})\.self_attn"
        qk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
        vd = int(cfg.v_head_dim)
        plan.add(p + r"\.q_(b_)?proj\.weight", Slice(0, (Segment(heads, qk),)))
        plan.add(p + r"\.kv_b_proj\.weight", Slice(0, (Segment(heads, int(cfg.qk_nope_head_dim) + vd),)))
        plan.add(p + r"\.o_proj\.weight", Slice(1, (Segment(heads, vd),)))
        plan.add(p + r"\.o_proj\.bias", Slice(rank0_only=True))
        plan.reduce(p + r"\.o_proj")
        fields.update(num_attention_heads=heads // size, num_key_value_heads=kv // size)
    mlp_kinds = list(getattr(cfg, "mlp_layer_types", None) or ["dense"] * len(kinds))
    if "dense" in mlp_kinds:
        inter = int(cfg.intermediate_size)
        plan.mlp(rf"\.layers\.({'|'.join(str(i) for i, t in enumerate(mlp_kinds) if t == 'dense')})\.mlp", inter,
                 "intermediate_size")
        fields["intermediate_size"] = inter // size
    if "sparse" in mlp_kinds:
        moe = int(cfg.moe_intermediate_size)
        plan.fused_experts(r"\.mlp\.experts", int(cfg.num_local_experts), moe, names=("w1", "w3", "w2"))
        plan.mlp(r"\.mlp\.shared_experts", moe * int(cfg.n_shared_experts), "moe_intermediate_size * n_shared_experts")
        fields["moe_intermediate_size"] = moe // size
    plan.reduce(r"\.layers\.\d+\.mlp")  # dense MLP or the whole MoE block (routed + shared experts)
    plan.vocab_parallel(r"embed_tokens\.weight", r"lm_head\.weight")
    plan.local_fields = fields
    return plan


PLANS = {
    "qwen3_next": gdn_plan, "qwen3_5_text": gdn_plan, "qwen3_5_moe_text": gdn_plan, "qwen3_5": gdn_plan,
    "qwen3_5_moe": gdn_plan, "olmo_hybrid": gdn_plan, "mamba2": mamba2_plan, "nemotron_h": nemotron_h_plan,
    "bamba": bamba_plan, "falcon_h1": falcon_h1_plan, "granitemoehybrid": granitemoehybrid_plan,
    "lfm2": lfm2_plan, "lfm2_moe": lfm2_plan, "lfm3": lfm2_plan, "zamba2": zamba2_plan,
    "mamba": mamba1_plan, "falcon_mamba": mamba1_plan, "jamba": jamba_plan, "zamba": zamba_plan,
    "recurrent_gemma": recurrent_gemma_plan, "minimax": minimax_plan, "kimi_linear": kimi_linear_plan,
}


def plan_for(config, size: int, rank: int = 0) -> ShardPlan:
    """The family's plan for ``size`` ranks (one :class:`ShardingError` when it cannot be split)."""
    model_type = getattr(config, "model_type", None)
    build = PLANS.get(model_type)
    if build is None:
        raise ShardingError(
            f"tensor_parallel_size={size}: model type {model_type!r} has no tensor-parallel sharding plan yet; "
            f"tensor parallelism supports: {', '.join(sorted(PLANS))}"
        )
    return build(config, size, rank)
