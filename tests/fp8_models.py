"""Tiny FP8 checkpoints and their dequantized oracle (shared by the FP8 model tests).

:func:`save_fp8_checkpoint` writes a float model the way the Qwen / DeepSeek FP8 releases are
written: ``save_pretrained`` (per-expert keys), then every projection / expert weight replaced by
its e4m3 value plus ``weight_scale_inv`` (128 x 128 blocks, quantized with the format's own
definition here in the test, independent of the library's loader), and ``config.json`` given the
fine-grained FP8 ``quantization_config``. :func:`dequantized_oracle` is the same transformers model
with every quantized weight replaced by ``weight * weight_scale_inv``: the ground truth an FP8
engine approximates (it additionally quantizes activations per token group of 128).
"""

from __future__ import annotations

import json
import pathlib

import torch

FP8 = torch.float8_e4m3fn


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> (e4m3, fp32 scale_inv per 128 x 128 block), as the releases define it."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, 128, kb, 128)
    amax = blocks.abs().amax((1, 3))
    scale_inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-448, 448).to(FP8).view(nb * 128, kb * 128)[:n, :k]
    return q.contiguous(), scale_inv


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    s = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return q.float() * s


KEEP = ("mlp.gate.weight", "shared_expert_gate.weight", "in_proj_ba.weight", "lm_head.weight", "router.weight")


def _quantized_key(key: str, tensor: torch.Tensor) -> bool:
    """Projection and expert weights (2-D ``.weight`` of linear layers) except the releases' exclusions."""
    if not key.endswith(".weight") or tensor.dim() != 2 or any(key.endswith(k) for k in KEEP):
        return False
    return "embed" not in key and "norm" not in key and "conv1d" not in key


def save_fp8_checkpoint(model, directory) -> pathlib.Path:
    """``model`` (float) saved as a fine-grained FP8 checkpoint in ``directory``."""
    from safetensors.torch import load_file, save_file

    directory = pathlib.Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    out, not_converted = {}, set()
    for key, t in tensors.items():
        if _quantized_key(key, t):
            q, s = quantize_blocks(t)
            out[key], out[key[: -len("weight")] + "weight_scale_inv"] = q, s
        else:
            out[key] = t.to(torch.bfloat16) if t.is_floating_point() else t
            not_converted.add(key.rsplit(".", 1)[0])
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
        "modules_to_not_convert": sorted(not_converted),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@torch.no_grad()
def dequantized_oracle(model_cls, directory):
    """transformers' model of an FP8 checkpoint with every quantized weight dequantized, in fp32."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    directory = pathlib.Path(directory)
    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config
    tensors = load_file(str(directory / "model.safetensors"))
    state = {}
    for key, t in tensors.items():
        if key.endswith("weight_scale_inv"):
            continue
        scale = tensors.get(key[: -len("weight")] + "weight_scale_inv") if key.endswith(".weight") else None
        state[key] = dequantize_blocks(t, scale) if scale is not None else t.float()
    model = model_cls(config).float().eval()
    # transformers 5 keeps MoE experts fused: stack the per-expert keys into its 3-D layout
    for name, module in model.named_modules():
        if hasattr(module, "down_proj") and isinstance(module.down_proj, torch.nn.Parameter):
            e_count = module.down_proj.shape[0]
            if hasattr(module, "gate_up_proj"):
                module.gate_up_proj.copy_(torch.stack([torch.cat([state.pop(f"{name}.{e}.gate_proj.weight"),
                                                                  state.pop(f"{name}.{e}.up_proj.weight")])
                                                       for e in range(e_count)]))
            else:
                module.up_proj.copy_(torch.stack([state.pop(f"{name}.{e}.up_proj.weight") for e in range(e_count)]))
            module.down_proj.copy_(torch.stack([state.pop(f"{name}.{e}.down_proj.weight") for e in range(e_count)]))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("gate_up_proj" in m or m.endswith("experts.up_proj") or m.endswith("experts.down_proj")
               for m in missing), missing
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    return model
