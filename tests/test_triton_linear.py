"""skinny_mm and gated_norm_linear (hybrid_compile/ops/linear.py) and their Triton kernels
(hybrid_compile/ops/triton/linear.py) against an fp64 matmul of the same values (after the norm as
transformers' gated-norm modules compute it).

On CPU the launcher runs under Triton's interpreter (the op itself is ``torch.mm`` there); the
``gpu`` tests run the registered CUDA op at the reference model's projection shapes (Triton at one
row and at two long rows, cuBLAS elsewhere), under opcheck and inside a CUDA graph.
"""

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops.linear import SKINNY_MAX_ROWS
from hybrid_compile.ops.triton import linear as tlin
from hybrid_compile.ops.triton.launch import pdl_launch, programmatic_launch_supported
from op_testing import assert_close, compile_and_compare, run_opcheck

INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def _expected(x, w):
    """fp64 product rounded to x's dtype: the exact value the kernel's fp32 sum approximates."""
    return (x.double() @ w.double().t()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(40, 256), (37, 100), (8, 2048), (1, 16)])
def test_kernel_matches_fp64_matmul(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    wide = torch.randn(m, k + 24, generator=g).to(dtype)
    x = wide[:, 8 : 8 + k]  # a strided view, as a packed projection's slice would be
    packed = torch.randn(n + 5, k, generator=g).to(dtype)
    w = packed[5:]  # rows of a packed buffer, storage offset != 0
    y = tlin.skinny_mm_triton(x, w)
    assert y.shape == (m, n) and y.dtype == dtype and y.is_contiguous()
    assert_close(y, _expected(x, w), dtype)
    assert_close(ops.skinny_mm(x, w), _expected(x, w), dtype)  # the CPU op (torch.mm)


def test_kernel_tile_configs_and_ragged_k():
    """Every tile shape the config picks (narrow long-row tiles, wide short-row tiles), a ``K`` that is
    not a multiple of the block (masked tail) and explicit configs give the same result."""
    for m in (1, 2):
        x = torch.randn(m, 4096 + 48)
        w = torch.randn(19, 4096 + 48)
        expected = _expected(x, w)
        for config in (None, (4, 1024, 8, 1), (8, 512, 4, 2), (2, 256, 4, 3), (16, 64, 4, 1), (8, 2048, 8, 2)):
            assert_close(tlin.skinny_mm_triton(x, w, config), expected, torch.float32, msg=f"{m} {config}")
    assert tlin.skinny_mm_config(2048, 5632, 1) == (8, 2048, 8, 2)
    assert tlin.skinny_mm_config(2048, 5632, 2) == (2, 512, 4, 3)
    assert tlin.skinny_mm_config(12352, 2048, 1)[:2] == (2, 2048)
    assert tlin.skinny_mm_config(40, 256, 1)[:2] == (2, 256)
    assert [tlin.use_skinny_kernel(m, k) for m, k in ((1, 2048), (2, 2048), (2, 4096), (3, 8192))] == [
        True, False, True, False]


def test_kernel_edge_shapes_and_errors():
    assert tlin.skinny_mm_triton(torch.randn(0, 32), torch.randn(8, 32)).shape == (0, 8)
    assert torch.equal(tlin.skinny_mm_triton(torch.randn(2, 0), torch.randn(8, 0)), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="at most 2 rows"):
        tlin.skinny_mm_triton(torch.randn(SKINNY_MAX_ROWS + 1, 32), torch.randn(8, 32))
    with pytest.raises(ValueError, match="weight"):
        ops.skinny_mm(torch.randn(2, 32), torch.randn(8, 31))
    with pytest.raises(ValueError, match="dtype"):
        ops.skinny_mm(torch.randn(2, 32), torch.randn(8, 32, dtype=torch.float64))


def test_op_opcheck_and_compile_without_graph_breaks():
    x, w = torch.randn(3, 64), torch.randn(24, 64)
    run_opcheck(ops.skinny_mm.default, (x, w))
    eager, compiled, _, _ = compile_and_compare(lambda a, b: torch.relu(ops.skinny_mm(a, b)) + 1, x, w)
    torch.testing.assert_close(compiled, eager)


def test_programmatic_launch_switches(monkeypatch):
    """Off on CPU and under the interpreter, on request for a launch, off everywhere with HYBRID_COMPILE_PDL=0."""
    assert not programmatic_launch_supported(torch.device("cpu"))
    assert pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    assert pdl_launch(torch.device("cpu"), True) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setenv("HYBRID_COMPILE_PDL", "0")
    assert not programmatic_launch_supported(torch.device("cuda"))


# --------------------------------------------------------------------------------------------
# gated_norm_linear: a mixer's gated RMSNorm + output projection
# --------------------------------------------------------------------------------------------


def _hf_gated_norm(x, z, norm_weight, eps, group_size, norm_before_gate):
    """The norm as transformers' modules write it (Qwen3NextRMSNormGated on ``[tokens * groups, G]``
    rows with a ``[G]`` weight; MambaRMSNormGated with group_size and a ``[K]`` weight), cast to x's dtype."""
    dtype = x.dtype
    t, k = x.shape
    h = x.float()
    if not norm_before_gate:
        h = h * torch.nn.functional.silu(z.float())
    g = h.reshape(t, k // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight if norm_weight.numel() == k else norm_weight.repeat(k // group_size)
    out = w * g.reshape(t, k).to(dtype)
    if norm_before_gate:
        out = out * torch.nn.functional.silu(z.float())
    return out.to(dtype)


GATED_CASES = [  # (rows, channels, group, norm_before_gate, per-group weight, dtype, out channels)
    (1, 256, 32, True, True, torch.float32, 24),  # Qwen3-Next order, a [G] weight
    (1, 256, 64, False, False, torch.bfloat16, 19),  # Mamba2 order, a [K] weight
    (1, 96, 32, True, True, torch.bfloat16, 8),  # K not a multiple of the tile: a masked tail of whole groups
    (1, 48, 48, False, False, torch.float32, 8),  # a group that is not a power of two: norm kernel + matvec
    (3, 256, 32, True, True, torch.bfloat16, 24),  # several rows: norm kernel + matmul
]


@pytest.mark.parametrize("m,k,group,nbg,per_group,dtype,n", GATED_CASES)
def test_gated_norm_linear_matches_the_norm_modules_then_the_projection(m, k, group, nbg, per_group, dtype, n):
    g = torch.Generator().manual_seed(k + group + m)
    packed = torch.randn(m, 2 * k + 8, generator=g).to(dtype)
    x, z = packed[:, :k], packed[:, k + 8:]  # strided views, as the mixer hands them over
    norm_weight = (1 + 0.3 * torch.randn(group if per_group else k, generator=g)).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    expected = _expected(_hf_gated_norm(x, z, norm_weight, 1e-6, group, nbg), w)
    assert_close(tlin.gated_norm_linear_triton(x, z, norm_weight, w, 1e-6, group, nbg), expected, dtype)
    assert_close(ops.gated_norm_linear(x, z, norm_weight, w, 1e-6, group, nbg), expected, dtype)  # CPU op
    if m == 1 and not group & (group - 1):  # explicit tiles of the normalising kernel
        for config in ((4, group, 4, 1), (2, 2 * group, 4, 2)):
            assert_close(tlin.gated_norm_linear_triton(x, z, norm_weight, w, 1e-6, group, nbg, config), expected,
                         dtype, msg=str(config))


def test_gated_norm_linear_checks_and_compiles_without_graph_breaks():
    x, z, w = torch.randn(2, 64), torch.randn(2, 64), torch.randn(16, 64)
    run_opcheck(ops.gated_norm_linear.default, (x, z, torch.rand(32) + 0.5, w, 1e-5, 32, True))
    run_opcheck(ops.gated_norm_linear.default, (x[:1], z[:1], torch.rand(64) + 0.5, w, 1e-5, 16, False))
    eager, compiled, _, _ = compile_and_compare(
        lambda a, b, c, d: ops.gated_norm_linear(a, b, c, d, 1e-6, 32, True) * 2, x, z, torch.ones(32), w)
    torch.testing.assert_close(compiled, eager)
    with pytest.raises(ValueError, match="norm_weight"):
        ops.gated_norm_linear(x, z, torch.ones(8), w, 1e-6, 32, True)
    with pytest.raises(ValueError, match="group_size"):
        ops.gated_norm_linear(x, z, torch.ones(64), w, 1e-6, 24, True)
    with pytest.raises(ValueError, match="z"):
        ops.gated_norm_linear(x, z[:, :32], torch.ones(64), w, 1e-6, 32, True)
    with pytest.raises(ValueError, match="whole groups"):
        tlin.gated_norm_linear_triton(x[:1], z[:1], torch.ones(64), w, 1e-6, 32, True, (2, 16, 4, 1))


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA op
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(12352, 2048), (2048, 5632), (2048, 4096), (151936, 2048)])
def test_cuda_op_at_model_shapes(n, k):
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    for m in (1, 2, 3, 8):  # Triton at 1 row (and 2 long rows), cuBLAS above
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert_close(ops.skinny_mm(x, w), _expected(x, w), torch.bfloat16, msg=f"m={m}")
    run_opcheck(ops.skinny_mm.default, (torch.randn(2, k, device="cuda", dtype=torch.bfloat16), w))


@pytest.mark.gpu
@pytest.mark.parametrize("group,nbg,per_group", [(128, True, True), (512, False, False)])
def test_cuda_gated_norm_linear_at_model_shapes(group, nbg, per_group):
    """The reference models' output projections (Qwen3-Next: groups of 128, norm then gate; NemotronH:
    groups of 512, gate then norm), one row (the normalising kernel, found in the profile) and more."""
    torch.manual_seed(0)
    k, n = 4096, 2048
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    norm_weight = (1 + 0.3 * torch.randn(group if per_group else k, device="cuda")).to(torch.bfloat16)
    for m in (1, 2, 5):
        x, z = torch.randn(2, m, k, device="cuda").to(torch.bfloat16).unbind()
        expected = _expected(_hf_gated_norm(x, z, norm_weight, 1e-6, group, nbg), w)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = ops.gated_norm_linear(x, z, norm_weight, w, 1e-6, group, nbg)
            torch.cuda.synchronize()
        assert_close(got, expected, torch.bfloat16, msg=f"m={m}")
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert any("_gated_norm_matvec_kernel" in nm for nm in names) == (m == 1), names
    run_opcheck(ops.gated_norm_linear.default, (x[:1], z[:1], norm_weight, w, 1e-6, group, nbg))


@pytest.mark.gpu
def test_cuda_op_in_a_cuda_graph_and_kernel_choice():
    w = torch.randn(3000, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)  # one row: the Triton kernel
    out = torch.empty(1, 3000, device="cuda", dtype=torch.bfloat16)
    ops.skinny_mm(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(ops.skinny_mm(x, w))
    x.copy_(torch.randn_like(x))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    assert_close(out, _expected(x, w), torch.bfloat16)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_skinny_mm_kernel" in n for n in names), names


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and programmatic_launch_supported(torch.device("cuda"))),
                    reason="needs a GPU with programmatic dependent launch (Hopper or later)")
def test_programmatic_launch_waits_for_the_kernel_that_writes_x():
    """A chain of dependent launches inside a CUDA graph (each kernel's x is written by the kernel
    right before it: a pointwise op, or the previous skinny_mm) gives the sequential result."""
    torch.manual_seed(0)
    ws = [(torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
          for n, k in ((4096, 2048), (2048, 4096), (8192, 2048), (2048, 8192))]
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)

    def chain(pdl):
        h = x
        for w in ws:  # x written by a pointwise kernel
            h = tlin.skinny_mm_triton(torch.tanh(h) * 2, w, pdl=pdl)
        for w in ws:  # x written by the previous skinny_mm
            h = tlin.skinny_mm_triton(h, w, pdl=pdl)
        return h

    chain(True)
    torch.cuda.synchronize()
    out = torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(chain(True))
    for _ in range(20):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = chain(False)  # the same kernels, launched plainly, one after the other
        assert torch.equal(out, expected)
        assert expected.abs().sum() > 0
