"""Quantized weights: FP8 linear layers and MoE experts, checkpoint loading, quantizing on load.

- :mod:`.fp8_modules`: :class:`Fp8Linear` and :class:`Fp8Experts`, the modules that hold e4m3
  weights with ``128 x 128`` block scales and run them through the block-FP8 ops
  (:mod:`hybrid_compile.ops.fp8`); :func:`quantize_model` swaps a float model's projections for
  them in place.
- :mod:`.fp8_checkpoint`: reading a checkpoint's ``quantization_config`` (the fine-grained FP8
  format, or one clear error naming an unsupported method) and loading its weights so that they
  stay FP8 on the device (never a float copy of a quantized weight).
"""

from .fp8_checkpoint import (
    UnsupportedQuantizationError, checkpoint_quantization, load_quantized_model, resolve_quantization,
)
from .fp8_modules import Fp8Experts, Fp8Linear, fp8_weight_bytes, has_fp8_layers, quantize_model

__all__ = [
    "Fp8Experts", "Fp8Linear", "UnsupportedQuantizationError", "checkpoint_quantization", "fp8_weight_bytes", "has_fp8_layers",
    "load_quantized_model", "quantize_model", "resolve_quantization",
]
