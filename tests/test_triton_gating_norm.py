"""Triton gdn_gating and gated_rms_norm kernels (hybrid_compile/ops/triton/gdn_gating.py, norm.py) against the
plain-torch ops, the per-token gating reference and a direct fp32 norm formula.

On CPU the launchers run under Triton's interpreter; the ``gpu`` tests run the registered CUDA ops
at model shapes, under opcheck and in a CUDA graph.
"""

import pytest
import torch
import torch.nn.functional as F

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import gdn as torch_gdn
from hybrid_compile.ops import norm as torch_norm
from hybrid_compile.ops.reference import gdn as ref
from hybrid_compile.ops.triton import gdn_gating as tgg, norm as tnorm
from op_testing import assert_close, run_opcheck

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def _gating_params(hv):
    A_log = torch.log(torch.empty(hv).uniform_(0.05, 1.0))
    return A_log, torch.randn(hv) * 0.5


# --------------------------------------------------------------------------------------------
# gdn_gating
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sp_beta,sp_thr", [(1.0, 20.0), (2.0, 3.0)])
@pytest.mark.parametrize("T,hv", [(11, 4), (37, 6), (0, 4)])
def test_gating_matches_op_and_reference(T, hv, sp_beta, sp_thr, dtype):
    A_log, dt_bias = _gating_params(hv)
    ab = (torch.randn(T, 2 * hv + 3) * 4).to(dtype)  # a and b: strided views of one projection
    if T:
        ab[0, 0] = 30.0  # far above the threshold
        ab[1, 1] = -40.0  # exp underflows
    a, b = ab[:, :hv], ab[:, hv + 3 :]
    g, beta = tgg.gdn_gating_triton(A_log, a, b, dt_bias, sp_beta, sp_thr)
    assert g.dtype == torch.float32 and beta.dtype == torch.float32
    assert g.shape == (T, hv) and g.is_contiguous() and beta.is_contiguous()
    rg, rb = ref.gating_ref(A_log, a, b, dt_bias, sp_beta, sp_thr)
    og, ob = torch_gdn.gdn_gating(A_log, a, b, dt_bias, sp_beta, sp_thr)
    for got, want in ((g, rg), (g, og), (beta, rb), (beta, ob)):
        assert_close(got, want, torch.float32)
    # relative accuracy where softplus is tiny (a log1p, not log(1 + e))
    if T:
        assert torch.allclose(g[1, 1], og[1, 1], rtol=1e-4, atol=0)
        assert (g < 0).all()


def test_gating_low_precision_params():
    A_log, dt_bias = _gating_params(5)
    a, b = torch.randn(9, 5).to(torch.float16), torch.randn(9, 5).to(torch.float16)
    g, beta = tgg.gdn_gating_triton(A_log.bfloat16(), a, b, dt_bias.bfloat16())
    og, ob = torch_gdn.gdn_gating(A_log.bfloat16(), a, b, dt_bias.bfloat16())
    assert_close(g, og)
    assert_close(beta, ob)


# --------------------------------------------------------------------------------------------
# gated_rms_norm
# --------------------------------------------------------------------------------------------


def _norm_inputs(T, D, dtype):
    proj = (2.0 * torch.randn(T, 2 * D + 3)).to(dtype)
    return proj[:, :D], proj[:, D + 3 :]  # non-contiguous x and z


def _formula(x, w, z, eps, gs, nbg):
    """Direct fp32 grouped gated RMSNorm (no intermediate roundings)."""
    xf = x.float()
    zf = None if z is None else z.float()
    h = xf if (nbg or zf is None) else xf * F.silu(zf)
    T, D = h.shape
    g = h.reshape(T, D // gs, gs)
    out = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).reshape(T, D) * w.float()
    if nbg and zf is not None:
        out = out * F.silu(zf)
    return out


@pytest.mark.parametrize("max_group_block", [4096, 8], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("nbg", [True, False])
@pytest.mark.parametrize("D,gs", [(32, 32), (48, 16), (40, 8)])
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_norm_matches_op(dtype, wdtype, D, gs, nbg, with_z, max_group_block):
    T, eps = 7, 1e-6
    x, z = _norm_inputs(T, D, dtype)
    z = z if with_z else None
    w = (1.0 + 0.5 * torch.randn(D)).to(wdtype)
    out = tnorm._gated_rms_norm(x, w, z, eps, gs, nbg, max_group_block=max_group_block)
    want = torch_norm.gated_rms_norm(x, w, z, eps, gs, nbg)
    assert out.dtype == dtype and out.shape == (T, D) and out.is_contiguous()
    if dtype == torch.float32:
        assert_close(out, want)
    else:
        # same casting order as the op: equal up to a rare one-ulp flip from the fp32 sum order
        assert_close(out, want, dtype)
        assert (out != want).float().mean() < 0.02
    assert_close(out, _formula(x, w, z, eps, gs, nbg), dtype)


@pytest.mark.parametrize("nbg", [True, False])
def test_norm_one_weight_per_group(nbg):
    """A ``[group_size]`` weight scales every group alike: the op with that weight repeated."""
    x, z = _norm_inputs(6, 64, torch.bfloat16)
    w = (1.0 + 0.5 * torch.randn(16)).to(torch.bfloat16)
    out = tnorm.gated_rms_norm_triton(x, w, z, 1e-6, 16, nbg)
    want = torch_norm.gated_rms_norm(x, w.repeat(4), z, 1e-6, 16, nbg)
    assert_close(out, want, torch.bfloat16)
    assert (out != want).float().mean() < 0.02


def test_norm_orders_differ_and_groups_matter():
    x, z = _norm_inputs(3, 16, torch.float32)
    w = torch.randn(16)
    a = tnorm.gated_rms_norm_triton(x, w, z, 1e-6, 16, True)
    b = tnorm.gated_rms_norm_triton(x, w, z, 1e-6, 16, False)
    c = tnorm.gated_rms_norm_triton(x, w, z, 1e-6, 4, False)
    assert not torch.allclose(a, b, atol=1e-3) and not torch.allclose(b, c, atol=1e-3)
    assert_close(c, _formula(x, w, z, 1e-6, 4, False))


def test_norm_empty_and_hf_module():
    out = tnorm.gated_rms_norm_triton(torch.randn(0, 16), torch.ones(16), None, 1e-6, 16, True)
    assert out.shape == (0, 16)
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    m = Qwen3NextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(1.0 + 0.5 * torch.randn(32))
    m = m.to(torch.bfloat16)
    x, z = _norm_inputs(5, 32, torch.bfloat16)
    out = tnorm.gated_rms_norm_triton(x, m.weight.detach(), z, 1e-6, 32, True)
    assert_close(out, m(x, z), torch.bfloat16)


def test_cuda_impls_validate_arguments():
    with pytest.raises(ValueError, match=r"gated_rms_norm: .*multiple of group_size"):
        tnorm._gated_rms_norm_cuda(torch.randn(3, 10), torch.ones(10), None, 1e-6, 4, True)
    with pytest.raises(ValueError, match=r"gdn_gating: `b` has shape"):
        A_log, dt = _gating_params(3)
        tgg._gdn_gating_cuda(A_log, torch.randn(4, 3), torch.randn(4, 2), dt)
    out = tnorm._gated_rms_norm_cuda(torch.randn(3, 8), torch.ones(8), None, 1e-6, 4, True)
    assert out.shape == (3, 8)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at model shapes (skipped without CUDA)
# --------------------------------------------------------------------------------------------


def _registered(name):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_compile::{name}", "CUDA")


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_gating_model_shapes():
    assert _registered("gdn_gating")
    dev, T, hv = "cuda", 4096, 32
    A_log, dt_bias = (t.to(dev) for t in _gating_params(hv))
    ab = (torch.randn(T, 2 * hv, device=dev) * 3).to(torch.bfloat16)
    a, b = ab[:, :hv], ab[:, hv:]
    g, beta = ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0)
    og, ob = ops.gdn_gating(A_log.cpu(), a.cpu(), b.cpu(), dt_bias.cpu(), 1.0, 20.0)
    assert_close(g.cpu(), og)
    assert_close(beta.cpu(), ob)
    run_opcheck(ops.gdn_gating, (A_log, a[:64], b[:64], dt_bias, 1.0, 20.0))


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize(
    "rows,D,gs,nbg,wdtype",
    [
        (4096 * 32, 128, 128, True, torch.bfloat16),   # Qwen3-Next: [T * Hv, V] rows, weight in bf16
        (4096 * 32, 128, 128, True, torch.float32),    # fp32 weight
        (2048, 8192, 1024, False, torch.bfloat16),     # Mamba2: intermediate 8192, 8 groups
        (512, 16384, 16384, False, torch.float32),     # one group larger than a register block
    ],
)
def test_gpu_norm_model_shapes(rows, D, gs, nbg, wdtype):
    assert _registered("gated_rms_norm")
    dev = "cuda"
    proj = (2.0 * torch.randn(rows, 2 * D, device=dev)).to(torch.bfloat16)
    x, z = proj[:, :D], proj[:, D:]
    w = (1.0 + 0.5 * torch.randn(D, device=dev)).to(wdtype)
    out = ops.gated_rms_norm(x, w, z, 1e-6, gs, nbg)
    want = ops.gated_rms_norm(x.cpu(), w.cpu(), z.cpu(), 1e-6, gs, nbg)
    assert out.dtype == torch.bfloat16
    assert_close(out.cpu(), want, torch.bfloat16)
    assert (out.cpu() != want).float().mean() < 0.02
    run_opcheck(ops.gated_rms_norm.default, (x[:16], w, z[:16], 1e-6, gs, nbg))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_cuda_graph_replay():
    """Gating + norm captured once, replayed with new inputs."""
    dev, T, hv, V = "cuda", 8, 32, 128
    A_log, dt_bias = (t.to(dev) for t in _gating_params(hv))
    a = torch.randn(T, hv, device=dev, dtype=torch.bfloat16)
    b = torch.randn(T, hv, device=dev, dtype=torch.bfloat16)
    x = torch.randn(T * hv, V, device=dev, dtype=torch.bfloat16)
    z = torch.randn(T * hv, V, device=dev, dtype=torch.bfloat16)
    w = torch.randn(V, device=dev, dtype=torch.bfloat16)

    def step():
        return ops.gdn_gating(A_log, a, b, dt_bias, 1.0, 20.0), ops.gated_rms_norm(x, w, z, 1e-6, V, True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (g, beta), y = step()
    for _ in range(2):
        for t in (a, b, x, z):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        og, ob = ops.gdn_gating(A_log.cpu(), a.cpu(), b.cpu(), dt_bias.cpu(), 1.0, 20.0)
        assert_close(g.cpu(), og)
        assert_close(beta.cpu(), ob)
        assert_close(y.cpu(), ops.gated_rms_norm(x.cpu(), w.cpu(), z.cpu(), 1e-6, V, True), torch.bfloat16)
