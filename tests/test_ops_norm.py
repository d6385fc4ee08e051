"""Tests of hybrid_compile::gated_rms_norm against transformers' gated RMSNorm modules."""

from __future__ import annotations

import inspect

import pytest
import torch

from hybrid_compile.ops.norm import gated_rms_norm
from op_testing import compile_and_compare, run_opcheck


def _qwen3_next_norm(D, eps, dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    m = Qwen3NextRMSNormGated(D, eps=eps)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.5 * torch.randn(D))
    return m.to(dtype)


def _takes_group_size(cls):
    return "group_size" in inspect.signature(cls.__init__).parameters


def _mamba2_norm(D, group_size, eps, dtype):
    """Mamba2's MambaRMSNormGated (grouped since transformers ~5.2x; older releases normalise over
    the whole last dim, so a grouped case falls back to NemotronH's copy of the module, or skips)."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    if _takes_group_size(MambaRMSNormGated):
        m = MambaRMSNormGated(D, group_size=group_size, eps=eps)
    elif group_size == D:
        m = MambaRMSNormGated(D, eps=eps)
    else:
        from transformers.models.nemotron_h import modeling_nemotron_h

        cls = getattr(modeling_nemotron_h, "NemotronHRMSNormGated", None)
        if cls is None or not _takes_group_size(cls):
            pytest.skip("this transformers release has no grouped gated RMSNorm (see test_grouped_formula)")
        m = cls(D, group_size=group_size, eps=eps)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.5 * torch.randn(D))
    return m.to(dtype)


def _inputs(T, D, dtype, noncontig=True):
    """x and z split out of one projection (non-contiguous views), like the mixers produce them."""
    proj = (2.0 * torch.randn(T, 2 * D + 3)).to(dtype)
    if noncontig:
        return proj[:, :D], proj[:, D + 3 :]
    return proj[:, :D].contiguous(), proj[:, D + 3 :].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,D", [(1, 16), (7, 32), (0, 16)])
def test_matches_qwen3_next_module(dtype, T, D):
    eps = 1e-6
    m = _qwen3_next_norm(D, eps, dtype)
    x, z = _inputs(T, D, dtype)
    expected = m(x, z)
    out = gated_rms_norm(x, m.weight.detach(), z, eps, D, True)
    assert out.dtype == dtype and out.shape == (T, D)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,group_size", [(32, 32), (32, 8), (48, 16)])
@pytest.mark.parametrize("with_gate", [True, False])
def test_matches_mamba2_module(dtype, D, group_size, with_gate):
    eps = 1e-5
    m = _mamba2_norm(D, group_size, eps, dtype)
    x, z = _inputs(5, D, dtype)
    z = z if with_gate else None
    expected = m(x, z)
    for nbg in ([False, True] if z is None else [False]):  # without a gate the order does not matter
        out = gated_rms_norm(x, m.weight.detach(), z, eps, group_size, nbg)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_weight_per_group_matches_the_module_on_head_rows(dtype):
    """Qwen3-Next's mixer normalises ``[tokens * heads, head_dim]`` rows with a ``[head_dim]`` weight;
    the op does the same on ``[tokens, heads * head_dim]`` with that weight and group_size head_dim."""
    T, H, G, eps = 5, 4, 8, 1e-6
    m = _qwen3_next_norm(G, eps, dtype)
    x, z = _inputs(T, H * G, dtype)
    expected = m(x.reshape(-1, G), z.reshape(-1, G)).reshape(T, H * G)
    out = gated_rms_norm(x, m.weight.detach(), z, eps, G, True)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_fp32_weight_with_bf16_activations():
    """HF's modules keep the promoted dtype (fp32) there; the op returns x.dtype with the same values rounded."""
    D = 16
    x, z = _inputs(4, D, torch.bfloat16)
    mq = _qwen3_next_norm(D, 1e-6, torch.float32)
    torch.testing.assert_close(gated_rms_norm(x, mq.weight.detach(), z, 1e-6, D, True), mq(x, z), atol=0, rtol=0)
    mm = _mamba2_norm(D, 8, 1e-6, torch.float32)
    expected = mm(x, z)
    assert expected.dtype == torch.float32
    out = gated_rms_norm(x, mm.weight.detach(), z, 1e-6, 8, False)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected.to(torch.bfloat16), atol=0, rtol=0)


def test_gate_order_matters():
    """The two orders really differ (so a test of one would catch the other)."""
    x, z = _inputs(3, 16, torch.float32)
    w = torch.randn(16)
    a = gated_rms_norm(x, w, z, 1e-6, 16, True)
    b = gated_rms_norm(x, w, z, 1e-6, 16, False)
    assert not torch.allclose(a, b, atol=1e-3)
    # against a direct fp32 formula
    xf, zf = x.float(), z.float()
    na = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w * torch.nn.functional.silu(zf)
    g = xf * torch.nn.functional.silu(zf)
    nb = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(a, na)
    torch.testing.assert_close(b, nb)


@pytest.mark.parametrize("nbg", [True, False])
def test_grouped_formula(nbg):
    """Grouped norm against a direct fp32 formula (independent of the transformers release)."""
    x, z = _inputs(4, 24, torch.float32)
    w = torch.randn(24)
    out = gated_rms_norm(x, w, z, 1e-5, 6, nbg)
    g = x if nbg else x * torch.nn.functional.silu(z)
    parts = []
    for i in range(4):
        blk = g[:, 6 * i : 6 * i + 6]
        parts.append(blk / torch.sqrt(blk.pow(2).mean(-1, keepdim=True) + 1e-5))
    expected = torch.cat(parts, -1) * w
    if nbg:
        expected = expected * torch.nn.functional.silu(z)
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, gated_rms_norm(x, w, z, 1e-5, 24, nbg), atol=1e-3)


@pytest.mark.parametrize(
    "T,D,gs,with_z,nbg,dtype",
    [(5, 16, 16, True, True, torch.float32), (3, 32, 8, True, False, torch.bfloat16), (0, 16, 4, False, False, torch.float32)],
)
def test_opcheck(T, D, gs, with_z, nbg, dtype):
    x, z = _inputs(T, D, dtype)
    w = torch.randn(D).to(dtype)
    run_opcheck(torch.ops.hybrid_compile.gated_rms_norm.default, (x, w, z if with_z else None, 1e-6, gs, nbg))


@pytest.mark.parametrize(
    "args,exc,match",
    [
        (dict(x=torch.randn(2, 3, 16)), ValueError, "gated_rms_norm: `x` must have 2 dims"),
        (dict(weight=torch.randn(8)), ValueError, "gated_rms_norm: `weight`"),
        (dict(weight=torch.randn(8), group_size=4), ValueError, "D=16 or group_size=4"),
        (dict(z=torch.randn(4, 8)), ValueError, "gated_rms_norm: `z`"),
        (dict(group_size=5), ValueError, "not divisible by 5"),
        (dict(group_size=0), ValueError, "group_size must be > 0"),
        (dict(x=torch.randint(0, 3, (4, 16))), ValueError, "gated_rms_norm: `x` must have dtype"),
        (dict(weight=torch.randn(16).double()), ValueError, "gated_rms_norm: `weight` must have dtype"),
        (dict(eps=-1.0), ValueError, "eps"),
    ],
)
def test_invalid(args, exc, match):
    kw = dict(x=torch.randn(4, 16), weight=torch.randn(16), z=torch.randn(4, 16), eps=1e-6, group_size=16,
              norm_before_gate=True)
    kw.update(args)
    with pytest.raises(exc, match=match):
        gated_rms_norm(**kw)


def test_compile():
    x, z = _inputs(6, 32, torch.bfloat16)
    w = torch.randn(32).to(torch.bfloat16)

    def fn(x, z, w):
        a = torch.ops.hybrid_compile.gated_rms_norm(x, w, z, 1e-6, 32, True)
        b = torch.ops.hybrid_compile.gated_rms_norm(x * 2, w, z, 1e-5, 8, False)
        c = torch.ops.hybrid_compile.gated_rms_norm(x, w, None, 1e-6, 16, False)
        return a + b, c

    eager, compiled, _, _ = compile_and_compare(fn, x, z, w)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=0, rtol=0)
