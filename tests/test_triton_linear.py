"""skinny_mm (hybrid_compile/ops/linear.py) and its Triton matrix-vector kernel
(hybrid_compile/ops/triton/linear.py) against an fp64 matmul of the same values.

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
    assert tlin.skinny_mm_config(2048, 5632, 2) == (2, 1024, 4, 2)
    assert tlin.skinny_mm_config(2048, 4096, 2) == (2, 1024, 4, 1)
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
@pytest.mark.smoke
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
