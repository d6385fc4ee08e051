"""Sharded loading: one rank's part of a checkpoint, read straight from its safetensors files.

The rank's model is built by transformers from the plan's local config on the meta device
(accelerate's ``init_empty_weights``; buffers such as RoPE frequencies are computed for real;
the plan's ``local_modules`` rebuilt there with their local sizes),
then every parameter is materialised from slices of the checkpoint tensors
(``safe_open(...).get_slice``: only the slice is read from the memory-mapped file), so no rank
ever holds the whole model. Persistent buffers the checkpoint holds are read the same way (replicated
unless the plan splits them: MiniMax's per-head decays). Parameters transformers ties to another (a tied LM head, Zamba2's
shared blocks) are read once and tied again. Each local tensor's shape is checked against the module transformers
built for the local config: a plan and a config that disagree fail loudly, not silently.

An FP8 checkpoint (fine-grained block FP8, ``quantization_config`` in its config): the layers it
stores in e4m3 (those with ``weight_scale_inv``) become the quantization package's ``Fp8Linear`` /
``Fp8Experts`` holding the rank's e4m3 slices and the block scales over them; a slice must start and
end on the 128 x 128 blocks (else one error naming the tensor), so each block scale covers the same
weights as in the checkpoint.

The checkpoint's MTP head (speculative method "mtp", :func:`load_mtp_shard`) is built the same
way: with the rank's local sizes on the meta device (``models/mtp.py``), each ``mtp.*`` parameter
read by the family's plan (its decoder layer's names match the model layers' patterns).

Benchmarks of shapes too large to write to disk (the Qwen3-Next-80B shape: 160 GB) use a
directory holding ``config.json`` and ``random_weights.json`` (``{"seed": 0, "std": 0.02}``)
instead of weights: :class:`RandomWeights` then stands in for the safetensors files, and each
rank draws only its slices, directly on its device (random values per slice: the ranks' shards are
not slices of one random tensor, which a speed measurement does not need).
"""

from __future__ import annotations

import json
import os
import re
import resource
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from ..ops.fp8 import FP8_BLOCK
from .plans import ShardPlan, Slice

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
RANDOM_WEIGHTS = "random_weights.json"


@dataclass
class LoadReport:
    """What one rank loaded: bytes of its shard, of the whole checkpoint, and its peak host memory
    growth while loading (resident set high-water mark, bytes); ``served_bytes``: its weights as
    served (after ``quantization="fp8"`` quantizes the shard on the rank: the e4m3 weights and their
    scales; otherwise ``shard_bytes``)."""

    shard_bytes: int
    full_model_bytes: int
    peak_host_bytes: int
    peak_device_bytes: int
    served_bytes: int


class Checkpoint:
    """The safetensors files of a checkpoint directory, opened lazily (memory-mapped)."""

    def __init__(self, path: str, model_type: str | None = None) -> None:
        from safetensors import safe_open

        self._open = safe_open
        self.path = path
        index = os.path.join(path, _INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = dict(json.load(f)["weight_map"])
        else:
            # model.safetensors, or other safetensors files without an index (an MTP head's own
            # directory, SpeculativeConfig.mtp_checkpoint)
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if os.path.isdir(path) else []
            if not files:
                raise FileNotFoundError(
                    f"tensor parallelism loads safetensors checkpoints: {path!r} has neither {_SINGLE}, {_INDEX} "
                    "nor other .safetensors files"
                )
            self.weight_map = {}
            for name in files:
                with self._file(name) as f:
                    self.weight_map.update({k: name for k in f.keys()})
        self._handles: dict[str, object] = {}
        # the model's parameter names -> checkpoint keys, through transformers' own renamings of this
        # model type (NemotronH's "backbone." -> "model.", Granite's fused experts, ...)
        self.keys = {_renamed(k, model_type): k for k in self.weight_map}

    def _file(self, name: str):
        return self._open(os.path.join(self.path, name), framework="pt", device="cpu")

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def slice(self, key: str):
        """The checkpoint tensor of model parameter ``key`` (a safetensors slice: nothing read yet)."""
        return self._slice(self.keys[key])

    def _slice(self, key: str):
        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = self._file(name).__enter__()
        return self._handles[name].get_slice(key)

    def total_bytes(self) -> int:
        total = 0
        for key in self.weight_map:
            s = self._slice(key)
            n = 1
            for d in s.get_shape():
                n *= d
            total += n * _dtype_size(s.get_dtype())
        return total

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()


def random_value(name: str, shape, std: float, generator: torch.Generator, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """A random-weight model's parameter ``name`` (or a slice of it) of ``shape``: norms 1,
    ``A_log`` / ``dt_bias`` 0, everything else normal with ``std``."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith("A_log") or name.endswith("dt_bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # drawn in ``dtype`` and scaled in place: a slice of the 80B shape's experts is 0.5 GB in bf16
    return torch.randn(shape, generator=generator, device=device, dtype=dtype).mul_(std)


class _RandomSlice:
    """A parameter of :class:`RandomWeights` as a safetensors slice: indexing draws only the slice."""

    def __init__(self, owner: "RandomWeights", name: str, shape: tuple[int, ...]) -> None:
        self.owner, self.name, self.shape = owner, name, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[self.owner.dtype]

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        if any(not isinstance(i, slice) for i in index):
            raise TypeError(f"random weights: {self.name} is read by slices only, got {index!r}")
        index = index + (slice(None),) * (len(self.shape) - len(index))
        ranges = [i.indices(n) for i, n in zip(index, self.shape)]
        if any(step != 1 for _, _, step in ranges):
            raise ValueError(f"random weights: {self.name} is read by contiguous slices, got {index!r}")
        shape = tuple(max(0, b - a) for a, b, _ in ranges)
        o = self.owner
        g = torch.Generator(device=o.device).manual_seed(o.seed ^ zlib.crc32(f"{self.name}{ranges}".encode()))
        return random_value(self.name, shape, o.std, g, o.dtype, o.device)


class RandomWeights:
    """Random weights in place of a checkpoint's safetensors files (module docstring): the keys and
    shapes of every parameter of the whole model ``config`` (built on the meta device, tied
    parameters once), values drawn per slice on ``device``. Same interface as :class:`Checkpoint`."""

    def __init__(self, path: str, config, device: torch.device, dtype: torch.dtype | None,
                 trust_remote_code: bool = False) -> None:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        if os.path.isfile(os.path.join(path, _INDEX)) or os.path.isfile(os.path.join(path, _SINGLE)):
            raise ValueError(f"{path!r} holds both weights and {RANDOM_WEIGHTS}: remove one of them")
        with open(os.path.join(path, RANDOM_WEIGHTS)) as f:
            spec = json.load(f)
        unknown = set(spec) - {"seed", "std"}
        if unknown:
            raise ValueError(f"{RANDOM_WEIGHTS} in {path!r}: unknown fields {sorted(unknown)} (seed, std)")
        self.seed, self.std = int(spec.get("seed", 0)), float(spec.get("std", 0.02))
        self.device, self.dtype = device, dtype if dtype is not None else torch.float32
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def __contains__(self, key: str) -> bool:
        return key in self.shapes

    def slice(self, key: str) -> _RandomSlice:
        return _RandomSlice(self, key, self.shapes[key])

    def total_bytes(self) -> int:
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(int(torch.Size(s).numel()) * size for s in self.shapes.values())

    def close(self) -> None:
        pass


def open_checkpoint(path: str, config, device: torch.device, dtype: torch.dtype | None,
                    trust_remote_code: bool = False) -> "Checkpoint | RandomWeights":
    """The checkpoint's safetensors files, or :class:`RandomWeights` where ``random_weights.json`` says so."""
    if os.path.isfile(os.path.join(path, RANDOM_WEIGHTS)):
        return RandomWeights(path, config, device, dtype, trust_remote_code)
    return Checkpoint(path, getattr(config, "model_type", None))


def _renamed(key: str, model_type: str | None) -> str:
    """A checkpoint key under transformers' renamings for ``model_type`` (its conversion mapping's
    ``WeightRenaming`` entries; the expert-merging converters are the plans' ``experts`` slices)."""
    try:
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping
    except ImportError:  # an older transformers without conversion mappings: names are the model's
        return key
    for conv in get_checkpoint_conversion_mapping(model_type) or () if model_type else ():
        if isinstance(conv, WeightRenaming):
            for src, dst in zip(conv.source_patterns, conv.target_patterns):
                key = re.sub(src, dst, key)
    return key


def _dtype_size(name: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
            "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}.get(name, 4)


def _ranges(s: Slice, key: str, length: int, rank: int, size: int, dim: int) -> list[tuple[int, int]]:
    """This rank's index ranges along ``dim`` (of ``length`` entries) of checkpoint tensor ``key``."""
    total = sum(seg.length for seg in s.segments)
    if length != total:
        raise ValueError(f"tensor parallelism: checkpoint tensor {key!r} has {length} entries along dim {dim}, "
                         f"the sharding plan expects {total}")
    ranges, offset = [], 0
    for seg in s.segments:
        ranges += seg.ranges(offset, rank, size)
        offset += seg.length
    return ranges


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _read(ckpt: Checkpoint, key: str, s: Slice, rank: int, size: int, dim: int | None = None) -> torch.Tensor:
    """One checkpoint tensor's part for this rank (``s.segments`` along ``dim``)."""
    sl = ckpt.slice(key)
    shape = sl.get_shape()
    dim = s.dim if dim is None else dim
    if s.vocab is not None:
        start, stop = s.vocab
        rows = sl[start:stop]
        if rows.shape[0] < s.pad_rows:
            rows = torch.cat([rows, rows.new_zeros(s.pad_rows - rows.shape[0], *rows.shape[1:])])
        return rows
    if not s.segments:
        return sl[:]
    return _cat([sl[_index(len(shape), dim, a, b)] for a, b in _ranges(s, key, shape[dim], rank, size, dim)], dim)


def _index(ndim: int, dim: int, a: int, b: int) -> tuple:
    return tuple(slice(a, b) if d == dim else slice(None) for d in range(ndim))


def _read_concatenated(ckpt: Checkpoint, keys: list[str], s: Slice, rank: int, size: int) -> torch.Tensor:
    """This rank's part of the concatenation of checkpoint tensors ``keys`` along ``s.dim`` (each
    tensor read only where this rank's ranges overlap it)."""
    pieces = [ckpt.slice(k) for k in keys]
    lengths = [p.get_shape()[s.dim] for p in pieces]
    if not s.segments:
        return _cat([p[:] for p in pieces], s.dim)
    parts = []
    for a, b in _ranges(s, " + ".join(keys), sum(lengths), rank, size, s.dim):
        start = 0
        for piece, n in zip(pieces, lengths):
            lo, hi = max(a, start), min(b, start + n)
            if lo < hi:
                parts.append(piece[_index(len(piece.get_shape()), s.dim, lo - start, hi - start)])
            start += n
    return _cat(parts, s.dim)


def _expert_parts(ckpt: Checkpoint, name: str, s: Slice) -> list[list[tuple[str, Slice]]]:
    """transformers' fused experts parameter ``name`` as per-expert checkpoint tensors
    (``"{prefix}.{e}.gate_proj.weight"``, ...): for each expert, each key with its 2-D slice, in the
    order they concatenate along ``s.concat_dim``."""
    prefix = name.rsplit(".", 1)[0]
    per_key = len(s.segments) // len(s.expert_keys)
    experts = []
    for e in range(s.experts):
        parts = []
        for i, template in enumerate(s.expert_keys):
            key = template.format(p=prefix, e=e)
            if key not in ckpt:
                raise KeyError(key)
            parts.append((key, Slice(s.dim - 1, s.segments[i * per_key:(i + 1) * per_key])))
        experts.append(parts)
    return experts


def _read_param(ckpt: Checkpoint, name: str, s: Slice, rank: int, size: int) -> torch.Tensor:
    if name not in ckpt and s.concat_keys:  # one parameter stored as several tensors (OLMo-Hybrid's conv)
        keys = [template.format(p=name.rsplit(".", 2)[0]) for template in s.concat_keys]
        for key in keys:
            if key not in ckpt:
                raise KeyError(key)
        return _read_concatenated(ckpt, keys, s, rank, size)
    if name in ckpt or not s.experts:
        if name not in ckpt:
            raise KeyError(name)
        return _read(ckpt, name, s, rank, size)
    return torch.stack([_cat([_read(ckpt, key, one, rank, size) for key, one in parts], s.concat_dim)
                        for parts in _expert_parts(ckpt, name, s)])


# --------------------------------------------------------------------------------------------
# FP8 checkpoints (fine-grained block FP8): each rank's e4m3 slices and their block scales
# --------------------------------------------------------------------------------------------

def _scale_key(weight_key: str) -> str:
    """The block-scale tensor of an FP8 weight: ``L.weight`` -> ``L.weight_scale_inv``; a fused experts
    tensor ``E.gate_up_proj`` -> ``E.gate_up_proj_scale_inv``."""
    if weight_key.endswith(".weight"):
        return weight_key[: -len("weight")] + "weight_scale_inv"
    return weight_key + "_scale_inv"


def _block_ranges(s: Slice, key: str, shape, rank: int, size: int, dim: int) -> list[tuple[int, int]]:
    """This rank's ranges of FP8 tensor ``key`` along ``dim`` as ranges of its 128-wide blocks. Each
    range must start on a block and end on one (or at the tensor's end, last): a block scale then
    covers the same weights in the rank's shard as in the checkpoint."""
    if s.vocab is not None or s.concat_keys:
        raise ValueError(f"tensor parallelism: FP8 checkpoint tensor {key!r} is split by vocabulary rows or "
                         "stored in parts, which the block-FP8 shard loader does not read")
    if not s.segments:
        return [(0, -(-shape[dim] // FP8_BLOCK))]
    ranges = _ranges(s, key, shape[dim], rank, size, dim)
    for i, (a, b) in enumerate(ranges):
        end_ok = b % FP8_BLOCK == 0 or (b == shape[dim] and i == len(ranges) - 1)
        if a % FP8_BLOCK or not end_ok:
            raise ValueError(
                f"tensor parallelism: rank {rank} of {size} would hold entries {a}..{b} along dim {dim} of FP8 "
                f"checkpoint tensor {key!r} ({tuple(shape)}), which do not start and end on its {FP8_BLOCK} x "
                f"{FP8_BLOCK} scale blocks: this model's block-FP8 weights cannot be split over {size} ranks "
                "(serve it with a tensor_parallel_size whose shards fall on the blocks, or with 1)")
    return [(a // FP8_BLOCK, -(-b // FP8_BLOCK)) for a, b in ranges]


def _read_fp8(ckpt: "Checkpoint", key: str, s: Slice, rank: int, size: int,
              dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weight ``key``'s part for this rank and the matching part of its block scales."""
    dim = s.dim if dim is None else dim
    shape = ckpt.slice(key).get_shape()
    blocks = _block_ranges(s, key, shape, rank, size, dim)
    scales = ckpt.slice(_scale_key(key))
    ndim = len(scales.get_shape())
    scale = _cat([scales[_index(ndim, dim, a, b)] for a, b in blocks], dim)
    return _read(ckpt, key, s, rank, size, dim), scale.float()


def _read_fp8_experts(ckpt: "Checkpoint", name: str, s: Slice, rank: int, size: int):
    """An experts parameter (``gate_up_proj`` / ``up_proj`` / ``down_proj``) of an FP8 checkpoint: this
    rank's ``[E, ...]`` e4m3 weights and ``[E, ...]`` block scales, from per-expert tensors (gate and
    up stacked) or from a fused 3-D tensor."""
    if name in ckpt:
        return _read_fp8(ckpt, name, s, rank, size)
    weights, scales = [], []
    for keys in _expert_parts(ckpt, name, s):
        parts = [_read_fp8(ckpt, key, one, rank, size) for key, one in keys]
        weights.append(_cat([w for w, _ in parts], s.concat_dim))
        scales.append(_cat([sc for _, sc in parts], s.concat_dim))
    return torch.stack(weights), torch.stack(scales)


def _install_fp8_modules(model: nn.Module, ckpt: "Checkpoint", plan: ShardPlan, dtype: torch.dtype | None,
                         device: torch.device) -> tuple[set[str], int]:
    """Swap the local model's layers the checkpoint stores in FP8 (those with block scales) for
    :class:`~hybrid_compile.quantization.Fp8Linear` / :class:`~hybrid_compile.quantization.Fp8Experts`
    holding this rank's e4m3 slices and scales (never a float copy); returns the parameter names they
    hold and their bytes."""
    from ..quantization import Fp8Experts, Fp8Linear
    from ..quantization.fp8_checkpoint import quantized_targets

    linears, experts = quantized_targets(model, ckpt)
    if not (linears or experts):
        raise ValueError("tensor parallelism: the checkpoint declares FP8 quantization but has no weight_scale_inv "
                         "tensors for this model's linear layers")
    done, nbytes = set(), 0
    for name, is_linear in [(n, True) for n in linears] + [(n, False) for n in experts]:
        module = model.get_submodule(name)
        if is_linear:
            q, scale = _read_fp8(ckpt, f"{name}.weight", plan.slice_of(f"{name}.weight"), plan.rank, plan.size)
            expect = (module.out_features, module.in_features)
            if tuple(q.shape) != expect:
                raise ValueError(f"tensor parallelism: rank {plan.rank}'s FP8 shard of {name!r}.weight has shape "
                                 f"{tuple(q.shape)}, the local {plan.family} model expects {expect}")
            bias = None
            if module.bias is not None:
                bs = plan.slice_of(f"{name}.bias")
                bias = _read(ckpt, f"{name}.bias", bs, plan.rank, plan.size)
                if bs.rank0_only and plan.rank != 0:
                    bias = torch.zeros_like(bias)
                bias = bias.to(device, dtype or bias.dtype)
            new = Fp8Linear(q.to(device), scale.to(device), bias)
            names = [f"{name}.weight", f"{name}.weight_scale_inv"] + ([f"{name}.bias"] if bias is not None else [])
        else:
            has_gate = hasattr(module, "gate_up_proj")
            up = "gate_up_proj" if has_gate else "up_proj"
            uq, us = _read_fp8_experts(ckpt, f"{name}.{up}", plan.slice_of(f"{name}.{up}"), plan.rank, plan.size)
            down = f"{name}.down_proj"
            dq, ds = _read_fp8_experts(ckpt, down, plan.slice_of(down), plan.rank, plan.size)
            expect = (tuple(getattr(module, up).shape), tuple(module.down_proj.shape))
            if (tuple(uq.shape), tuple(dq.shape)) != expect:
                raise ValueError(f"tensor parallelism: rank {plan.rank}'s FP8 shard of {name!r} has shapes "
                                 f"{tuple(uq.shape)} / {tuple(dq.shape)}, the local {plan.family} model expects "
                                 f"{expect}")
            new = Fp8Experts(uq.to(device), us.to(device), dq.to(device), ds.to(device), module.act_fn, has_gate)
            names = [f"{name}.{up}", f"{name}.{up}_scale_inv", f"{name}.down_proj", f"{name}.down_proj_scale_inv"]
        model.set_submodule(name, new)
        done.update(names)
        nbytes += sum(p.numel() * p.element_size() for p in new.parameters())
    return done, nbytes


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if buffer:
        module._buffers[attr] = value
    else:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)


def _peak_rss_reset() -> int:
    """Reset the resident-set high-water mark where Linux allows it; returns the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _is_fp8_checkpoint(config) -> bool:
    from ..quantization import checkpoint_quantization

    return checkpoint_quantization(config) == "fp8"


def load_shard(path: str, config, plan: ShardPlan, dtype: torch.dtype | None, device: torch.device,
               trust_remote_code: bool = False) -> tuple[nn.Module, LoadReport]:
    """This rank's model (local config, sharded weights on ``device``, eval mode) and its report."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    local_config = plan.local_config(config)
    if hasattr(local_config, "quantization_config"):  # FP8 layers are ours (below), not transformers'
        delattr(local_config, "quantization_config")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(local_config, trust_remote_code=trust_remote_code)
        for name, module in list(model.named_modules()):
            for pattern, rebuild in plan.local_modules:
                if pattern.search(name):
                    rebuild(module)
    # the high-water mark of the weights alone (transformers' modules are imported by now)
    base_rss = _peak_rss_reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ckpt = open_checkpoint(path, config, device, dtype, trust_remote_code)
    keep_fp32 = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    # parameters transformers ties to another (the LM head to the embedding, Zamba2's later uses of
    # a shared block to its first): {tied name: source name}, not in the checkpoint when tied
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    shard_bytes = 0
    try:
        fp8_names: set[str] = set()
        if _is_fp8_checkpoint(config) and isinstance(ckpt, Checkpoint):
            fp8_names, shard_bytes = _install_fp8_modules(model, ckpt, plan, dtype, device)
        for name, param in list(model.named_parameters(remove_duplicate=False)):
            if name in fp8_names:
                continue  # read with its block scales above
            s = plan.slice_of(name)
            try:
                value = _read_param(ckpt, name, s, plan.rank, plan.size)
            except KeyError as e:
                if name in tied:
                    continue  # tied to its source below
                raise ValueError(f"tensor parallelism: the checkpoint in {path!r} has no tensor {e.args[0]!r} "
                                 f"(for parameter {name!r})") from None
            if s.rank0_only and plan.rank != 0:
                value = torch.zeros_like(value)
            expect = tuple(param.shape) if s.vocab is None else (s.pad_rows, *param.shape[1:])  # vocab rows
            if tuple(value.shape) != expect:
                raise ValueError(f"tensor parallelism: rank {plan.rank}'s shard of {name!r} has shape "
                                 f"{tuple(value.shape)}, the local {plan.family} model expects {expect}")
            want = dtype if dtype is not None else value.dtype
            if keep_fp32 and any(k in name for k in keep_fp32):
                want = torch.float32
            value = value.to(device=device, dtype=want)
            shard_bytes += value.numel() * value.element_size()
            _set_tensor(model, name, value)
        for name, buf in list(model.named_buffers()):
            if name in ckpt:  # persistent buffers the checkpoint holds (replicated, or per head: MiniMax's decays)
                value = _read(ckpt, name, plan.slice_of(name), plan.rank, plan.size)
                if value.shape != buf.shape:
                    raise ValueError(f"tensor parallelism: rank {plan.rank}'s shard of buffer {name!r} has shape "
                                     f"{tuple(value.shape)}, the local {plan.family} model expects {tuple(buf.shape)}")
                buf = value.to(dtype=buf.dtype)
            _set_tensor(model, name, buf.to(device), buffer=True)
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, source in tied.items():
            if name in params and params[name].device.type == "meta":
                module_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(module_name), attr, params[source])
        full = ckpt.total_bytes()
    finally:
        ckpt.close()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"tensor parallelism: no checkpoint tensor for {missing[:5]}")
    model.eval()
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError):
        pass
    peak = max(0, _status_bytes("VmHWM") - base_rss)
    dev_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else shard_bytes
    return model, LoadReport(shard_bytes, full, peak, int(dev_peak), shard_bytes)


def load_mtp_shard(model: nn.Module, path: str, config, plan: ShardPlan, checkpoint=None) -> nn.Module:
    """This rank's part of the checkpoint's MTP head (``speculative={"method": "mtp"}``) over the
    rank's ``model``: built with the local sizes and each ``mtp.*`` parameter read by the family's
    plan, slice by slice as the model's layers are (its attention and MLP / experts split, the fc /
    norms replicated), from ``checkpoint`` (``SpeculativeConfig.mtp_checkpoint``) or ``path``."""
    from ..models.mtp import load_mtp_head

    where = os.path.expanduser(os.fspath(checkpoint)) if checkpoint is not None else path
    ckpt = Checkpoint(where, getattr(config, "model_type", None))
    try:
        return load_mtp_head(model, where,
                             shard=lambda key: _read_param(ckpt, key, plan.slice_of(key), plan.rank, plan.size))
    finally:
        ckpt.close()
