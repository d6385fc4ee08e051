"""Loading: a Hugging Face model (:func:`wrap`, a model already in memory) or checkpoint (local
directory, or a Hub id: :func:`from_pretrained`) straight into a HybridEngine.

:func:`from_pretrained` is a thin layer over transformers' ``AutoConfig`` /
``AutoModelForCausalLM.from_pretrained`` (safetensors; ``device_map`` placement through
accelerate) and ``AutoTokenizer``, followed by :func:`wrap`. It checks what can
be checked before any weight is read — the directory exists, its model type is a supported
hybrid family, the tokenizer loads when one is required — and reports each failure as one
clear :class:`LoadError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch
from torch import nn

from .engine import EngineConfig, HybridEngine
from .engine.startup import Startup

# files any of which means "this directory has a tokenizer"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
    "sentencepiece.bpe.model", "tekken.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name


class LoadError(ValueError):
    """A checkpoint cannot be served; the message says why in one line."""


class CheckpointNotFoundError(LoadError, FileNotFoundError):
    """The checkpoint directory does not exist (and the name is no reachable Hub model)."""


class UnsupportedModelError(LoadError):
    """The checkpoint's model type is not a hybrid family hybrid_compile supports."""


class UnsupportedQuantizationError(LoadError):
    """The checkpoint's quantization method (or the requested one) is not supported; names it.
    (The loading-time form of :class:`hybrid_compile.quantization.UnsupportedQuantizationError`.)"""


class TokenizerNotFoundError(LoadError):
    """Text was requested but the checkpoint (or the given path) has no usable tokenizer."""


def _is_local(path: str) -> bool:
    return os.path.isdir(path)


def _looks_like_hub_id(path: str) -> bool:
    """``owner/name`` that is no local path (its ``owner`` is not a local directory)."""
    return bool(_HUB_ID.match(path)) and not os.path.exists(path) and not os.path.isdir(path.split("/")[0])


def _check_path(path: str) -> None:
    if _is_local(path):
        return
    looks_local = not _looks_like_hub_id(path)
    if looks_local:
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
        raise CheckpointNotFoundError(f"model directory {path!r} {what}")


def _load_config(path: str, revision: str | None, trust_remote_code: bool):
    from transformers import AutoConfig

    if _is_local(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory")
    if _is_local(path):
        _check_transformers_has(path)
    try:
        return AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as e:  # not a local dir and not reachable on the Hub
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointNotFoundError(
            f"{path!r} is neither a local model directory nor a reachable Hugging Face Hub model ({first})"
        ) from e


def _check_transformers_has(path: str) -> None:
    """A supported family that the installed transformers does not know (e.g. ``lfm3`` before
    transformers 5.24): one clear error instead of AutoConfig's unrecognised-architecture one."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from .models import FAMILIES

    try:
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # AutoConfig reports an unreadable config itself
    if model_type in FAMILIES and model_type not in CONFIG_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is a hybrid_compile family, but the installed transformers "
            f"{transformers.__version__} has no {model_type!r} model; install a transformers that has it"
        )


def check_model_type(config, where: str = "") -> None:
    """Raise :class:`UnsupportedModelError` unless ``config.model_type`` is a supported family."""
    from .models import FAMILIES, supported_model_types

    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        archs = ", ".join(getattr(config, "architectures", None) or []) or "unknown architecture"
        raise UnsupportedModelError(
            f"hybrid_compile does not support model type {model_type!r} ({archs}){where}; it serves hybrid "
            f"models only; supported model types: {', '.join(supported_model_types())}"
        )


def has_tokenizer_files(path: str) -> bool:
    """Whether a local directory holds tokenizer files (Hub ids: assumed True)."""
    if not _is_local(path):
        return True
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False):
    """``AutoTokenizer.from_pretrained(path)``, or :class:`TokenizerNotFoundError`."""
    from transformers import AutoTokenizer

    if _is_local(path) and not has_tokenizer_files(path):
        raise TokenizerNotFoundError(
            f"no tokenizer in {path!r} (none of {', '.join(TOKENIZER_FILES[:3])}, ...); text input needs one: "
            "save it there (tokenizer.save_pretrained) or name another directory"
        )
    if not _is_local(path) and not _looks_like_hub_id(path):
        raise TokenizerNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError / ValueError / ImportError variants
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TokenizerNotFoundError(f"cannot load a tokenizer from {path!r}: {first}") from e


def _device_map(device) -> Any:
    """``device`` -> the ``device_map`` given to transformers (accelerate places the weights)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, dict) or device == "auto":
        return device
    if isinstance(device, int):
        return f"cuda:{device}"
    return str(device)


def _dtype(dtype) -> Any:
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return "auto" if dtype is None else dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise LoadError(f"unknown dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return value


def _draft_model_from_directory(engine_config: EngineConfig, device, torch_dtype, trust_remote_code: bool,
                                tensor_parallel_size: int) -> EngineConfig:
    """``speculative.draft_model`` given as a checkpoint directory: read with transformers onto the
    model's device and dtype (as the model itself). Under ``torchrun`` a rank other than 0 keeps the
    path: its engine drafts nothing (``distributed.runtime.follower_config`` drops the draft model)."""
    from .distributed.group import is_torchrun_follower

    spec = engine_config.speculative
    if spec is None or not isinstance(spec.draft_model, (str, os.PathLike)) or is_torchrun_follower(tensor_parallel_size):
        return engine_config
    from transformers import AutoModelForCausalLM

    path = os.path.expanduser(os.fspath(spec.draft_model))
    try:
        _check_path(path)
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, device_map=_device_map(device),
                                                     trust_remote_code=trust_remote_code).eval()
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LoadError(f"SpeculativeConfig.draft_model {path!r}: {first}") from e
    return dataclasses.replace(engine_config, speculative=dataclasses.replace(spec, draft_model=draft))


def _quantization(engine_config: EngineConfig, config, path: str) -> str | None:
    """The checkpoint's quantization (fine-grained FP8), else the requested one; an unsupported
    method is one clear :class:`UnsupportedQuantizationError`."""
    from .quantization import UnsupportedQuantizationError as Unsupported, resolve_quantization

    try:
        return resolve_quantization(engine_config.quantization, config)
    except Unsupported as e:
        raise UnsupportedQuantizationError(f"{e} (in {path!r})") from None


def _load_fp8(path: str, config, kwargs: dict, revision: str | None):
    """FP8 weights kept FP8 on one device (:func:`hybrid_compile.quantization.load_quantized_model`)."""
    from .quantization import checkpoint_quantization, load_quantized_model

    device = kwargs.pop("device_map")
    if isinstance(device, dict) or device == "auto":
        raise LoadError(f"FP8 loading places every weight on one device; got device={device!r}")
    extra = sorted(set(kwargs) - {"dtype", "revision", "trust_remote_code"})
    if extra:
        raise LoadError(f"model_kwargs {', '.join(extra)} are not supported when loading FP8 weights")
    if not _is_local(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"])
    return load_quantized_model(path, config, device=device, dtype=kwargs["dtype"],
                                quantize=checkpoint_quantization(config) is None,
                                trust_remote_code=kwargs["trust_remote_code"])


def wrap(
    model: nn.Module, config: EngineConfig | dict | None = None, tokenizer=None, tensor_parallel_size: int = 1,
    progress: bool = False, tensor_parallel_timeout: float | None = None, **overrides,
) -> HybridEngine | None:
    """Wrap a Hugging Face hybrid model in a :class:`HybridEngine`.

    Detects the family from ``model.config.model_type``, patches this instance's layers (other
    instances are untouched; ``engine.close()`` undoes it), sizes the pools and returns the
    engine. ``config`` is an :class:`EngineConfig` (or dict); ``overrides`` are its fields as
    keyword arguments. An unsupported model type raises ValueError listing the supported ones.
    ``tokenizer`` (optional, also settable later as ``engine.tokenizer``) lets ``generate`` and
    ``generate_batch`` take strings and chat messages and return text. ``progress``: show a tqdm
    bar (stderr) over the start-up phases (pools, patch, compile, capture, warm-up); off, nothing is
    printed. Either way ``engine.stats()["startup"]`` has each phase's seconds (:mod:`.engine.startup`).

    ``tensor_parallel_size`` N > 1 serves the model over N processes, one per device of the
    model's kind (GPU r for rank r; gloo ranks on the CPU), as ``from_pretrained(dir,
    tensor_parallel_size=N)`` does: the model is saved once with ``save_pretrained`` (safetensors)
    into a temporary directory, each rank loads only its shard from it, and the directory is
    removed as soon as every rank holds its shard (``stats()["tensor_parallel"]["saved_checkpoint_s"]``:
    the save's seconds). The model in this process stays as it was (its memory too: rank 0's
    shard is a copy). Under ``torchrun`` every rank calls this with its model: rank 0's is saved
    and served (the others' are not read; the ranks must share a file system), rank 0 gets the
    engine and the others follow its steps inside the call and return ``None`` once it is closed,
    as with ``from_pretrained``. Not for a model holding FP8 layers (wrap the float model with
    ``quantization="fp8"``, or load the FP8 checkpoint with ``from_pretrained``).
    ``tensor_parallel_timeout``: seconds a rank waits in a collective before it gives up (300).
    """
    engine_config = EngineConfig.from_args(config, **overrides)
    if tensor_parallel_size != 1:
        return _wrap_tensor_parallel(model, engine_config, tokenizer, tensor_parallel_size, progress,
                                     tensor_parallel_timeout)
    if tensor_parallel_timeout is not None:
        raise ValueError("wrap(tensor_parallel_timeout=...) is for tensor_parallel_size > 1")
    with Startup(progress) as startup:
        return HybridEngine(model, engine_config, tokenizer=tokenizer, startup=startup)


def _wrap_tensor_parallel(model: nn.Module, engine_config: EngineConfig, tokenizer, size: int, progress: bool,
                          timeout: float | None) -> HybridEngine | None:
    """:func:`wrap` over ``size`` ranks: save, launch (each rank loads its shard), remove the save."""
    import copy
    import shutil
    import tempfile
    import time

    from .distributed import launch
    from .distributed.group import DEFAULT_TIMEOUT_SECONDS, torchrun_env
    from .distributed.plans import plan_for
    from .distributed.runtime import shared_checkpoint
    from .quantization import has_fp8_layers

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    where = f"wrap(tensor_parallel_size={size})"
    check_model_type(model.config)
    if has_fp8_layers(model):
        raise ValueError(f"{where}: the model holds FP8 layers; wrap the float model with quantization='fp8' (each "
                         "rank quantizes its shard), or load the FP8 checkpoint with hc.from_pretrained")
    kinds = {p.device.type for p in model.parameters()}
    if kinds - {"cpu", "cuda"} or len(kinds) != 1:
        raise ValueError(f"{where}: the model's weights are on {sorted(kinds)}; they must all be on the CPU or all "
                         "on CUDA devices (the ranks run on devices of that kind)")
    plan_for(model.config, size)  # head counts that do not divide: one error, before the save
    remote = bool(getattr(model.config, "auto_map", None))
    saved: dict = {}

    def save(directory: str) -> None:
        saved["directory"] = directory  # (removed below even when the save fails half-way)
        t0 = time.perf_counter()
        model.save_pretrained(directory, safe_serialization=True)
        saved["seconds"] = time.perf_counter() - t0

    options = dict(dtype=next(model.parameters()).dtype, device=kinds.pop(), tokenizer=tokenizer,
                   trust_remote_code=remote, timeout=timeout or DEFAULT_TIMEOUT_SECONDS)
    try:
        if torchrun_env() is None:  # the ranks are started after the save
            save(tempfile.mkdtemp(prefix="hybrid_compile_tp_"))
            checkpoint = saved["directory"]
        else:  # every rank calls this: rank 0 saves its model once the group is up, the others read that save
            checkpoint = lambda tp: shared_checkpoint(tp, save)  # noqa: E731
        with Startup(progress, desc=f"loading {type(model).__name__} (rank 0 of {size})") as startup:
            engine = launch(checkpoint, size, copy.deepcopy(model.config), engine_config, startup=startup, **options)
    finally:  # (rank 0: every rank has read its shard once launch returns, or the launch failed)
        if "directory" in saved:
            shutil.rmtree(saved["directory"], ignore_errors=True)
    if engine is not None:
        engine.saved_checkpoint_seconds = saved.get("seconds")
    return engine


def from_pretrained(
    path_or_dir: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    device: str | int | torch.device | dict | None = None,
    tokenizer: Any = True,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict | None = None,
    progress: bool = False,
    tensor_parallel_size: int = 1,
    tensor_parallel_timeout: float | None = None,
    **engine_options,
) -> HybridEngine | None:
    """Load a Hugging Face hybrid checkpoint and wrap it: returns a :class:`HybridEngine`.

    - ``path_or_dir``: a local checkpoint directory (``config.json`` + safetensors weights), or a
      Hub model id.
    - ``dtype``: ``None``/``"auto"`` (the checkpoint's dtype, as transformers), a ``torch.dtype``
      or its name (``"bfloat16"``).
    - ``device``: ``None`` (the first CUDA device if there is one, else CPU), a device
      (``"cuda:1"``, ``"cpu"``, ``0``), ``"auto"`` or a device-map dict; it becomes transformers'
      ``device_map``, so accelerate places the weights. The engine serves from one device: a map
      that spreads the model over several devices or offloads weights is rejected by ``wrap``.
    - ``tokenizer``: ``True`` loads the checkpoint's tokenizer when it has one (``None``
      otherwise; text input then raises); ``"required"`` raises :class:`TokenizerNotFoundError`
      when it has none; a path loads it from there; a tokenizer object is used as is;
      ``False``/``None`` means token ids only. It becomes ``engine.tokenizer``.
    - ``model_kwargs``: more keyword arguments for ``AutoModelForCausalLM.from_pretrained``.
    - ``progress``: show a tqdm progress bar (stderr) over the start-up phases (load, pools, patch,
      compile, capture, warm-up: :mod:`hybrid_compile.engine.startup`); ``engine.stats()["startup"]``
      has each phase's seconds, ``load_s`` the weights' (with or without the bar).
    - ``engine_options``: :class:`EngineConfig` fields (``max_running_requests=...``), checked
      before any weight is read.
    - ``tensor_parallel_size``: serve the model over this many processes, one per device (``device``
      ``"cuda"``: GPU r for rank r; ``"cpu"``: gloo, for tests), each loading only its shard of the
      safetensors files (:mod:`hybrid_compile.distributed`). From a plain process the other ranks
      are started here and stopped by ``engine.close()``; under ``torchrun --nproc-per-node N``
      every rank calls this, rank 0 gets the engine and the others follow its steps inside the call
      and return ``None`` once it is closed. A model whose head counts do not divide raises
      :class:`~hybrid_compile.distributed.ShardingError` before any weight is read.
      ``tensor_parallel_timeout``: seconds a rank waits in a collective before it gives up (300).

    FP8: a checkpoint in the fine-grained FP8 format (``quantization_config.quant_method == "fp8"``,
    e4m3 weights with 128 x 128 block scales) loads with its weights kept FP8 on the device, and
    ``quantization="fp8"`` (an :class:`EngineConfig` field) quantizes a float checkpoint's projections and
    experts as they are read (:mod:`hybrid_compile.quantization`); both load one tensor at a time, so
    no float copy of the quantized weights ever exists. Any other quantization method raises
    :class:`UnsupportedQuantizationError` naming it.

    Errors: :class:`CheckpointNotFoundError` (no such directory / no config.json),
    :class:`UnsupportedModelError` (not a hybrid model; lists the supported model types),
    :class:`TokenizerNotFoundError`; all are :class:`LoadError` (a ``ValueError``).
    """
    from transformers import AutoModelForCausalLM

    path = os.fspath(path_or_dir)
    path = os.path.expanduser(path)
    engine_config = EngineConfig.from_args(None, **engine_options)  # typos fail before loading
    torch_dtype = _dtype(dtype)
    # everything that can fail on the user's input is checked before the progress bar starts
    _check_path(path)
    config = _load_config(path, revision, trust_remote_code)
    check_model_type(config, where=f" in {path!r}")
    tok = None
    if tokenizer is True:
        if has_tokenizer_files(path):
            tok = load_tokenizer(path, revision, trust_remote_code)
    elif tokenizer == "required":
        tok = load_tokenizer(path, revision, trust_remote_code)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tok = load_tokenizer(os.path.expanduser(os.fspath(tokenizer)), None, trust_remote_code)
    elif tokenizer not in (False, None):
        tok = tokenizer

    engine_config = _draft_model_from_directory(engine_config, device, torch_dtype, trust_remote_code,
                                                tensor_parallel_size)
    name = os.path.basename(path.rstrip("/")) or path
    if tensor_parallel_size == 1 and os.path.isfile(os.path.join(path, "random_weights.json")):
        raise LoadError(f"{path!r} holds random_weights.json instead of weights: only tensor_parallel_size > 1 "
                        "draws a rank's random shard (hybrid_compile/distributed/loading.py)")
    if tensor_parallel_size != 1:
        from .distributed import launch
        from .distributed.group import DEFAULT_TIMEOUT_SECONDS
        _quantization(engine_config, config, path)  # an unsupported method: one error before the ranks start

        if model_kwargs:
            raise ValueError(f"model_kwargs with tensor_parallel_size={tensor_parallel_size}: each rank builds its "
                             f"shard itself and takes no from_pretrained arguments ({', '.join(model_kwargs)})")
        if revision is not None or not _is_local(path):
            raise ValueError("tensor parallelism loads a local checkpoint directory (download it first)")
        with Startup(progress, desc=f"loading {name} (rank 0 of {tensor_parallel_size})") as startup:
            return launch(path, tensor_parallel_size, config, engine_config,
                          dtype=None if torch_dtype == "auto" else torch_dtype, device=device, tokenizer=tok,
                          trust_remote_code=trust_remote_code, timeout=tensor_parallel_timeout or DEFAULT_TIMEOUT_SECONDS,
                          startup=startup)
    kwargs = dict(dtype=torch_dtype, device_map=_device_map(device), revision=revision,
                  trust_remote_code=trust_remote_code)
    kwargs.update(model_kwargs or {})
    quantization = _quantization(engine_config, config, path)
    with Startup(progress, desc=f"loading {name}") as startup:
        startup.plan("load")
        with startup.phase("load"):
            if quantization == "fp8":
                model = _load_fp8(path, config, kwargs, revision)
            else:
                model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs).eval()
        return HybridEngine(model, engine_config, tokenizer=tok, startup=startup)


__all__ = [
    "CheckpointNotFoundError",
    "LoadError",
    "TokenizerNotFoundError",
    "UnsupportedModelError",
    "UnsupportedQuantizationError",
    "check_model_type",
    "from_pretrained",
    "has_tokenizer_files",
    "load_tokenizer",
]
