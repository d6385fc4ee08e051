"""Engine configuration: :class:`EngineConfig`, with validation and keyword overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.policy import check_policy_name


#: ``EngineConfig.extra``: settings for experiments and tests (the engine reads each where it applies);
#: any other key is an error, never ignored.
EXTRA_OPTIONS: dict[str, str] = {
    "rewrite_passes": "False turns off the post-grad projection-packing pass (compilation/rewrite.py)",
    "skinny_matmuls": "True / False forces the routing of projections to skinny_mm (default: on CUDA)",
    "inductor_config": "a dict of Inductor config patches for every compiled piece",
    "memory_budget_bytes": "the bytes the KV + Mamba pools may take, instead of memory_fraction of free memory",
    "overlap": "False turns off the overlapped scheduler (one step's host work beside the last's GPU work)",
    "speculative_commit_graphs": "False commits accepted speculative states with one op launch per state tensor",
    "mtp_draft_graphs": "True / False: full CUDA graphs of whole MTP draft proposals (default: where they run)",
    "fold_shared_experts": "False keeps a MoE block's shared expert out of the routed experts' call "
                           "(models/shared_expert_fold.py; default: folded on the fused experts path)",
    "split_mixed_steps": "False runs a mixed step's decode rows through the layer ops' extend paths with its "
                         "prefill chunks instead of their decode paths (ForwardMetadata.mixed_parts)",
    "piecewise_max_padding": "the most padding tokens a step takes to replay a token bucket's piecewise graphs "
                             "(default 1024); a step that would need more runs the compiled forward at its "
                             "own size (stats()['compile']['unpadded_steps'])",
}


# the extra keys that are switches, and the values each takes (None: a default resolved where it is read)
_EXTRA_SWITCHES = {
    "rewrite_passes": (True, False),
    "skinny_matmuls": (True, False, None),
    "overlap": (True, False),
    "speculative_commit_graphs": (True, False),
    "mtp_draft_graphs": (True, False, None),
    "fold_shared_experts": (True, False),
    "split_mixed_steps": (True, False),
}


@dataclass
class EngineConfig:
    """Settings of one :class:`~hybrid_compile.engine.HybridEngine`.

    Capacities left as None are derived from a memory budget: ``memory_fraction`` of the free
    device memory (or of available RAM on CPU), split between the Mamba pool and the KV pool
    so that mamba bytes / KV bytes = ``mamba_full_memory_ratio`` (``memory/sizing.py``).
    """

    device: str | torch.device | None = None  # default: the model's device
    dtype: torch.dtype | str | None = None  # activations; default: the model's dtype
    # recurrent (SSM) state pool: float32 (default), bfloat16 / float16, or "fp8": e4m3 with one fp32
    # scale per state vector (hybrid_compile.ops.fp8_cache), re-quantized at every write
    ssm_state_dtype: torch.dtype | str = torch.float32
    # KV cache of the full-attention layers: "auto" = the model dtype, or "fp8": e4m3 with one fp32
    # scale per token and head (hybrid_compile.ops.fp8_cache)
    kv_cache_dtype: str = "auto"
    # "fp8": serve the projections and MoE experts in block FP8 (hybrid_compile.quantization); a float
    # model is quantized in place at wrap (irreversible: close() does not restore its float weights); a
    # model already holding FP8 layers (an FP8 checkpoint) is served as loaded. None: as the model is.
    quantization: str | None = None
    # MoE experts (transformers' 3-D layout: gate_up_proj / up_proj + down_proj) through our fused
    # experts path inside engine steps (hybrid_compile.models.fused_experts: one grouped GEMM per
    # projection, Triton on CUDA) instead of transformers' experts forward, and softmax top-k routers
    # through one moe_topk_softmax op (hybrid_compile.models.fused_router). True: on (any device; a
    # model without such experts, or with experts of another layout, is an error); False:
    # transformers' path; None (the default): on for a model on a CUDA device whose experts are all
    # of that layout (models.fused_experts.resolve_fused_moe: measured 1.05-1.45x transformers' path
    # end to end on one GPU, 1.07-1.27x under tensor parallelism), else off (on the CPU the fused
    # path is the plain-torch reference). The routers follow the option and, with None, are also on
    # before FP8 experts on a CUDA device (models.fused_experts.resolve_fused_routers).
    fused_moe: bool | None = None
    # tensor parallelism (from_pretrained(..., tensor_parallel_size=N > 1) only): how the model's
    # all-reduces run. "nccl": on the device group (NCCL; gloo on CPU); "one_shot": those of at most 64 KiB
    # of bf16 / fp32 (decode steps) as one kernel over symmetric memory, larger ones on NCCL
    # (hybrid_compile.distributed.one_shot; CUDA, 2 / 4 / 8 GPUs with P2P between them); "auto" (the
    # default): "one_shot" where it can run, else "nccl".
    tensor_parallel_all_reduce: str = "auto"
    max_running_requests: int = 16
    max_total_tokens: int | None = None  # KV token capacity
    mamba_cache_size: int | None = None  # Mamba slots
    memory_fraction: float = 0.5
    mamba_full_memory_ratio: float = 0.5
    max_context_len: int | None = None  # default: min(model max positions, max_total_tokens)
    page_size: int = 1
    chunked_prefill_size: int = 2048  # max prefill tokens per step
    max_prefill_tokens: int | None = None  # alias budget per step; default chunked_prefill_size
    enable_prefix_cache: bool = True  # HybridRadixCache: reuse KV + Mamba states (chunk-aligned checkpoints)
    prefix_cache_policy: str = "lru"  # "lru" (SGLang) or "marconi" (checkpoint branch points; FLOP-aware eviction)
    prefix_cache_track_interval: int = 256  # lru: checkpoint decoding requests every this many tokens (0: never)
    # host tier of the prefix cache: evicted nodes' KV + states go to (pinned) host memory and load back on a hit
    prefix_cache_host_tier: bool = False
    # its size; None: prefix_cache_host_fraction of the available host memory (MemAvailable;
    # None there: memory.host_pool.DEFAULT_HOST_FRACTION, 0.25)
    prefix_cache_host_bytes: int | None = None
    prefix_cache_host_fraction: float | None = None
    # move memory between the KV and Mamba pools at run time when one is exhausted and the other idle
    elastic_pools: bool = False
    speculative: Any = None  # a SpeculativeConfig or a dict of its fields (engine/speculative)
    # torch.compile with our backend (hybrid_compile.compilation): Dynamo graph split at the layer ops, pieces
    # compiled by Inductor. None: on for CUDA, off on CPU (see resolved_compile).
    compile: bool | None = None
    # CUDA graphs over the compiled forward (hybrid_compile.compilation.cuda_graphs): True = full graphs of
    # decode steps + piecewise graphs of the compiled pieces, "full" / "piecewise" = only those, False =
    # off, None = True when compile is on and the device is CUDA (see resolved_cuda_graphs).
    cuda_graphs: bool | str | None = None
    cuda_graph_batch_sizes: tuple[int, ...] | None = None  # decode buckets; default 1, 2, 4, 8, 16, 24, 32, 48, ...
    piecewise_cuda_graph_tokens: tuple[int, ...] | None = None  # token buckets; default 2, 4, ..., 512, 1024, ...
    # serve two short requests at wrap time and forget them, so that every kernel variant serving uses is
    # JIT-compiled before the first real request (HybridEngine._warm_up_kernels). None: on for CUDA.
    warmup_kernels: bool | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)  # the expert settings of EXTRA_OPTIONS

    @classmethod
    def from_args(cls, config: "EngineConfig | dict | None" = None, **overrides) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if isinstance(config, dict):
            unknown += sorted(set(config) - names)
        if unknown:
            extra_keys = [u for u in unknown if u in EXTRA_OPTIONS]
            hint = (f" ({', '.join(extra_keys)}: a key of the `extra` field, e.g. extra={{{extra_keys[0]!r}: ...}})"
                    if extra_keys else "")
            raise TypeError(
                f"unknown EngineConfig field(s): {', '.join(unknown)}{hint}; valid fields: {', '.join(sorted(names))}"
            )
        if config is None:
            base = cls()
        elif isinstance(config, dict):
            base = cls(**config)
        elif isinstance(config, cls):
            base = dataclasses.replace(config)
        else:
            raise TypeError(f"config must be an EngineConfig or a dict, got {type(config).__name__}")
        result = dataclasses.replace(base, **overrides)
        result.validate()
        return result

    def validate(self) -> None:
        if not isinstance(self.extra, dict):
            raise TypeError(f"EngineConfig.extra must be a dict, got {type(self.extra).__name__}")
        unknown = sorted(set(self.extra) - set(EXTRA_OPTIONS))
        if unknown:
            raise ValueError(f"unknown EngineConfig.extra key(s): {', '.join(map(repr, unknown))}; the keys are "
                             + "; ".join(f"{k!r} ({v})" for k, v in EXTRA_OPTIONS.items()))
        # values: a switch is a bool (a string such as "false" would read as True), never coerced
        for key, allowed in _EXTRA_SWITCHES.items():
            if key in self.extra and not any(self.extra[key] is a for a in allowed):  # (1 == True: by identity)
                values = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}"
                raise ValueError(f"EngineConfig.extra[{key!r}] must be {values}, got {self.extra[key]!r}")
        if not isinstance(self.extra.get("inductor_config", {}), dict):
            raise ValueError(f"EngineConfig.extra['inductor_config'] must be a dict of Inductor config patches, got "
                             f"{self.extra['inductor_config']!r}")
        for key, least, what in (("piecewise_max_padding", 0, "an integer >= 0"),
                                 ("memory_budget_bytes", 1, "a positive integer")):
            v = self.extra.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
                raise ValueError(f"EngineConfig.extra[{key!r}] must be {what}, got {v!r}")

        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {v!r}")

        for name in ("max_running_requests", "max_total_tokens", "mamba_cache_size", "page_size",
                     "chunked_prefill_size", "max_prefill_tokens", "max_context_len"):
            positive(name)
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not self.mamba_full_memory_ratio > 0:
            raise ValueError(f"EngineConfig.mamba_full_memory_ratio must be > 0, got {self.mamba_full_memory_ratio}")
        if not isinstance(self.prefix_cache_track_interval, int) or self.prefix_cache_track_interval < 0:
            raise ValueError(
                f"EngineConfig.prefix_cache_track_interval must be an integer >= 0, got {self.prefix_cache_track_interval!r}"
            )
        check_policy_name(self.prefix_cache_policy, what="EngineConfig.prefix_cache_policy")
        positive("prefix_cache_host_bytes")
        if self.prefix_cache_host_fraction is not None and not 0.0 < self.prefix_cache_host_fraction < 1.0:
            raise ValueError(
                f"EngineConfig.prefix_cache_host_fraction must be in (0, 1), got {self.prefix_cache_host_fraction}"
            )
        if self.prefix_cache_host_tier and not self.enable_prefix_cache:
            raise ValueError("EngineConfig.prefix_cache_host_tier=True needs enable_prefix_cache=True")
        for name in ("prefix_cache_host_bytes", "prefix_cache_host_fraction"):
            if getattr(self, name) is not None and not self.prefix_cache_host_tier:
                raise ValueError(f"EngineConfig.{name} is set but prefix_cache_host_tier is False")
        if self.prefix_cache_host_bytes is not None and self.prefix_cache_host_fraction is not None:
            raise ValueError("EngineConfig.prefix_cache_host_bytes and prefix_cache_host_fraction both size the "
                             "host tier: set one")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"EngineConfig.kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        try:
            ssm = _as_dtype(self.ssm_state_dtype)
        except ValueError:
            ssm = None
        if ssm not in _SSM_STATE_DTYPES:
            raise ValueError(
                "EngineConfig.ssm_state_dtype must be 'float32', 'bfloat16', 'float16' or 'fp8', got "
                f"{self.ssm_state_dtype!r}"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"EngineConfig.quantization must be None or 'fp8', got {self.quantization!r}")
        if self.speculative is not None:
            # a dict becomes a validated SpeculativeConfig
            from .speculative import SpeculativeConfig  # lazy: engine.speculative imports engine.config

            self.speculative = SpeculativeConfig.coerce(self.speculative)
            if self.speculative.is_tree and ssm is torch.float8_e4m3fn:
                raise ValueError("EngineConfig: draft trees (speculative topk > 1) are not supported with "
                                 "ssm_state_dtype='fp8' (a node's state is read back from the intermediate buffer)")
        from ..distributed.one_shot import MODES as all_reduce_modes  # lazy: distributed imports the engine

        if self.tensor_parallel_all_reduce not in all_reduce_modes:
            raise ValueError(f"EngineConfig.tensor_parallel_all_reduce must be one of {', '.join(all_reduce_modes)}, "
                             f"got {self.tensor_parallel_all_reduce!r}")
        if not (self.fused_moe is None or isinstance(self.fused_moe, bool)):
            raise ValueError(f"EngineConfig.fused_moe must be True, False or None, got {self.fused_moe!r}")
        if self.warmup_kernels not in (None, True, False):
            raise ValueError(f"EngineConfig.warmup_kernels must be True, False or None, got {self.warmup_kernels!r}")
        if self.compile not in (None, True, False):
            raise ValueError(f"EngineConfig.compile must be True, False or None, got {self.compile!r}")
        if self.cuda_graphs not in _CUDA_GRAPH_MODES:
            raise ValueError(
                f"EngineConfig.cuda_graphs must be True, False, None, 'full' or 'piecewise', got {self.cuda_graphs!r}"
            )
        for name in ("cuda_graph_batch_sizes", "piecewise_cuda_graph_tokens"):
            sizes = getattr(self, name)
            if sizes is not None:
                sizes = tuple(sizes)
                if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
                    raise ValueError(f"EngineConfig.{name} must be a non-empty tuple of positive integers, got {sizes!r}")
                setattr(self, name, sizes)

    @property
    def rewrite_passes(self) -> bool:
        """Whether compiled pieces run the post-grad projection-packing pass (``extra["rewrite_passes"]``,
        on by default; :mod:`hybrid_compile.compilation.rewrite`)."""
        return bool(self.extra.get("rewrite_passes", True))

    def resolved_compile(self, device: torch.device) -> bool:
        """Whether the engine compiles the model forward: ``compile=None`` (the default) means on
        for CUDA devices, off on CPU."""
        if self.compile is None:
            return torch.device(device).type == "cuda"
        return self.compile

    def resolved_cuda_graphs(self, device: torch.device) -> tuple[bool, bool]:
        """(full decode graphs, piecewise graphs) on ``device``. ``cuda_graphs=None`` means both when
        the forward is compiled on CUDA, neither otherwise; an explicit mode needs both (ValueError)."""
        device = torch.device(device)
        compiled = self.resolved_compile(device)
        if self.cuda_graphs is None:
            on = compiled and device.type == "cuda"
            return on, on
        if self.cuda_graphs is False:
            return False, False
        if device.type != "cuda":
            raise ValueError(f"EngineConfig.cuda_graphs={self.cuda_graphs!r} needs a CUDA device, the engine runs on {device}")
        if not compiled:
            raise ValueError(
                f"EngineConfig.cuda_graphs={self.cuda_graphs!r} needs the compiled forward (compile=True or None), "
                f"got compile={self.compile!r}"
            )
        return self.cuda_graphs in (True, "full"), self.cuda_graphs in (True, "piecewise")

    def resolved_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return _as_dtype(self.dtype) if self.dtype is not None else model_dtype

    def resolved_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV pool dtype: the model's (``"auto"``) or e4m3 (``"fp8"``)."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else model_dtype


_CUDA_GRAPH_MODES = (None, True, False, "full", "piecewise")


_SSM_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def _as_dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    if str(d) == "fp8":  # the pools' FP8 format (e4m3 with scales)
        return torch.float8_e4m3fn
    value = getattr(torch, str(d).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {d!r}")
    return value
