"""Block-FP8 ops (hybrid_compile/ops/fp8.py) and their Triton kernels (hybrid_compile/ops/triton/fp8.py).

Oracles: the format's definition (e4m3 rounding to nearest even, checked on every tie of the e4m3 grid;
``scale = max|group| / 448``), an fp64 matmul of the dequantized operands for the plain-torch ops, and
the plain-torch ops for the kernels. On CPU the kernels run under Triton's interpreter (``tl.dot`` on
e4m3 operands runs there), tiny shapes; the ``gpu`` tests run the registered CUDA ops at the shapes
of Qwen3-Next-80B-A3B-FP8 (hidden 2048), under opcheck and in a CUDA graph.
"""

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import fp8
from hybrid_compile.ops.triton import fp8 as tfp8
from op_testing import compile_and_compare, fp8_linear_then_experts_graph, opcheck_fp8_inputs, run_opcheck

INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def _e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, ascending."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 0x7f is NaN
    return codes.view(fp8.FP8_DTYPE).float()


def _rounding_cases() -> torch.Tensor:
    """Each tie between neighbouring e4m3 values, a float just above and below it, and the values
    themselves, both signs: the inputs where a rounding or carry mistake shows."""
    g = _e4m3_grid()
    mid = (g[1:] + g[:-1]) / 2  # exact in fp32
    vals = torch.cat([g, mid, torch.nextafter(mid, torch.full_like(mid, 1e9)),
                      torch.nextafter(mid, torch.zeros_like(mid))])
    return torch.cat([vals, -vals])


def _quantize_expected(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the e4m3 grid, found by search (not by a cast)."""
    g = _e4m3_grid().double()
    a = v.double().abs()
    idx = torch.searchsorted(g, a).clamp(1, len(g) - 1)
    lo, hi = g[idx - 1], g[idx]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (idx % 2 == 0))  # tie: even code (hi's code is idx)
    r = torch.where(a >= hi, hi, torch.where(pick_hi, hi, lo))
    return (torch.sign(v.double()) * r).float()


def _with_unit_scale(v: torch.Tensor) -> torch.Tensor:
    """Rows of 128 whose first element is 448, so the group scale is exactly 1 and q = round(v)."""
    per_row = fp8.FP8_GROUP - 1
    n = -(-v.numel() // per_row)
    body = torch.zeros(n * per_row)
    body[: v.numel()] = v
    return torch.cat([torch.full((n, 1), fp8.FP8_MAX), body.view(n, per_row)], 1)


def test_quantize_rounds_to_nearest_even_on_every_tie():
    x = _with_unit_scale(_rounding_cases())
    expected = _quantize_expected(x)
    q, s = ops.fp8_quantize_per_token_group(x)
    assert torch.equal(s, torch.ones(x.shape[0], 1))
    assert torch.equal(q.float(), expected)
    qk, sk = tfp8.fp8_quantize_triton(x)  # the kernel's explicit rounding, under the interpreter
    assert torch.equal(qk.float(), expected) and torch.equal(sk, s)


def test_quantize_groups_scales_and_partial_groups():
    x = torch.randn(5, 300) * torch.logspace(-3, 2, 300)
    x[1, 128:256] = 0  # an all-zero group: finite scale, zeros
    q, s = ops.fp8_quantize_per_token_group(x)
    assert q.shape == (5, 300) and q.dtype == fp8.FP8_DTYPE and s.shape == (5, 3) and s.dtype == torch.float32
    amax = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128).abs().amax(-1)
    torch.testing.assert_close(s, amax.clamp(min=fp8.FP8_EPS) / fp8.FP8_MAX, rtol=1e-6, atol=0)
    deq = q.float() * s.repeat_interleave(128, 1)[:, :300]
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normals, absolute <= 2**-10 * scale below
    err = (deq - x).abs()
    assert bool((err <= x.abs() * 2 ** -4 + s.repeat_interleave(128, 1)[:, :300] * 2 ** -10).all())
    assert torch.equal(q[1, 128:256].float(), torch.zeros(128))
    qk, sk = tfp8.fp8_quantize_triton(x[:, :])
    assert torch.equal(qk.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sk, s)
    xs = torch.randn(3, 600)[:, ::2]  # strided input
    qk, sk = tfp8.fp8_quantize_triton(xs)
    q, s = ops.fp8_quantize_per_token_group(xs)
    assert torch.equal(qk.view(torch.uint8), q.view(torch.uint8)) and torch.equal(sk, s)


def test_weight_block_quantization_round_trip():
    w = torch.randn(3, 200, 260) * torch.linspace(0.01, 3, 260)
    w[0, :128, :128] = 0
    q, s = fp8.quantize_weight_blocks(w)
    assert q.dtype == fp8.FP8_DTYPE and s.shape == (3, 2, 3)
    assert s[0, 0, 0] == 1.0 and torch.equal(q[0, :128, :128].float(), torch.zeros(128, 128))
    blocks = torch.nn.functional.pad(w, (0, 124, 0, 56)).view(3, 2, 128, 3, 128)
    torch.testing.assert_close(s[1:], blocks.abs().amax((2, 4))[1:] / fp8.FP8_MAX, rtol=1e-6, atol=0)
    deq = fp8.dequantize_weight_blocks(q, s)
    scale_full = fp8._expand_blocks(s, 200, 260, 128, 128)
    assert bool(((deq - w).abs() <= w.abs() * 2 ** -4 + scale_full * 2 ** -10).all())
    # bf16 input, and the weight's own dtype out
    qb, sb = fp8.quantize_weight_blocks(w[1].to(torch.bfloat16))
    assert fp8.dequantize_weight_blocks(qb, sb, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float weight"):
        fp8.quantize_weight_blocks(torch.ones(8, dtype=torch.int32))


def _dequantized_product(x, q, s, bias=None):
    """fp64 product of the dequantized activation and weight: what the op approximates in fp32."""
    xq, xs = ops.fp8_quantize_per_token_group(x)
    xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, : x.shape[1]]
    y = xd @ fp8.dequantize_weight_blocks(q, s, torch.float64).t()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("m,n,k", [(1, 40, 100), (3, 130, 300), (70, 256, 128)])
def test_linear_op_is_the_dequantized_product(m, n, k):
    x = torch.randn(m, k)
    q, s = fp8.quantize_weight_blocks(torch.randn(n, k) / k ** 0.5)
    bias = torch.randn(n)
    torch.testing.assert_close(ops.fp8_block_linear(x, q, s, bias).double(), _dequantized_product(x, q, s, bias),
                               rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)
    yb = ops.fp8_block_linear(xb, q, s)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), _dequantized_product(xb, q, s), rtol=1e-2, atol=1e-2)


def _expert_offsets(counts):
    off = torch.zeros(len(counts) + 1, dtype=torch.int64)
    off[1:] = torch.tensor(counts).cumsum(0)
    return off


def test_grouped_op_is_each_experts_product():
    k, n = 200, 96
    q, s = fp8.quantize_weight_blocks(torch.randn(4, n, k) / k ** 0.5)
    counts = [3, 0, 9, 1]
    x = torch.randn(sum(counts), k)
    off = _expert_offsets(counts)
    y = ops.fp8_grouped_linear(x, q, s, off)
    for e in range(4):
        lo, hi = off[e], off[e + 1]
        torch.testing.assert_close(y[lo:hi], ops.fp8_block_linear(x[lo:hi], q[e], s[e]), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expert_offsets"):
        ops.fp8_grouped_linear(x, q, s, _expert_offsets([3, 0, 9, 2]))


def _routed_oracle(x, q, s, off, gather, scatter, activation):
    """``fp8_grouped_linear`` with a gather, an activation and a scatter, row by row: each sorted row
    ``r`` of expert ``e`` is ``fp8_block_linear(x[gather[r]], weight[e])`` in fp32 (the op's product,
    the ungathered op as the ground truth), then the activation, stored at ``scatter[r]``."""
    out = None
    for e in range(q.shape[0]):
        for r in range(int(off[e]), int(off[e + 1])):
            row = x[int(gather[r])][None].float()
            y = fp8.reference_block_linear(row, q[e], s[e]).double()  # (fp32 in, fp32 out: no rounding of x)
            if activation == "silu_and_mul":
                gate, up = y.chunk(2, dim=-1)
                y = torch.nn.functional.silu(gate) * up
            elif activation == "relu2":
                y = torch.relu(y) ** 2
            if out is None:
                out = torch.zeros(gather.shape[0], y.shape[1], dtype=torch.float64)
            out[int(scatter[r])] = y[0]
    return out


@pytest.mark.parametrize("activation", ["none", "silu_and_mul", "relu2"])
def test_grouped_op_gathers_activates_and_scatters(activation):
    """The routed form the experts forward calls: row ``r`` reads ``x[gather[r]]``, the activation
    runs on the fp32 products, the row lands at ``scatter[r]``; the CPU op against a row-by-row oracle,
    the Triton launcher (GEMV: gather, silu_and_mul with each half's block scales, scatter in the
    kernel; tensor cores: around the GEMM) against the op under the interpreter."""
    torch.manual_seed(0)
    k, n = 160, 96  # silu_and_mul: 48 gate rows then 48 up rows in one 128-row block of scales
    q, s = fp8.quantize_weight_blocks(torch.randn(4, n, k) / k ** 0.5)
    x = torch.randn(5, k)
    counts = [3, 0, 4, 1]
    gather = torch.tensor([4, 0, 2, 2, 1, 3, 0, 4])
    scatter = torch.randperm(8)
    off = _expert_offsets(counts)
    got = ops.fp8_grouped_linear(x, q, s, off, gather, scatter, activation=activation)
    torch.testing.assert_close(got.double(), _routed_oracle(x, q, s, off, gather, scatter, activation),
                               rtol=1e-5, atol=1e-5)
    assert tfp8.use_gemv(8, 4)
    torch.testing.assert_close(tfp8.fp8_grouped_linear_triton(x, q, s, off, gather, scatter, activation), got,
                               rtol=1e-5, atol=1e-5)
    # the tensor-core path (a config asks for it) and a GEMV tile of 16 columns (3 of the 48 gate rows)
    torch.testing.assert_close(tfp8.fp8_grouped_linear_triton(x, q, s, off, gather, scatter, activation,
                                                              config=(16, 16, 4, 1)), got, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off, gather_index=gather,
                                                    scatter_index=scatter, activation=activation,
                                                    config=(16, 64, 4, 1)), got, rtol=1e-5, atol=1e-5)
    if activation == "silu_and_mul":
        with pytest.raises(ValueError, match="BLOCK_N .32. to divide the output columns .48."):
            tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off, gather_index=gather, activation=activation,
                                 config=(32, 64, 4, 1))
        with pytest.raises(ValueError, match="even number of weight rows"):
            ops.fp8_grouped_linear(x, q[:, :95], s, off, gather, scatter, activation=activation)
    with pytest.raises(ValueError, match="gather_index"):
        ops.fp8_grouped_linear(x, q, s, off, gather + 1, scatter, activation=activation)


def test_silu_and_mul_up_rows_take_their_own_block_scales():
    """Gate rows and up rows in different 128-row blocks of scales (an intermediate of 128 per half),
    the up block scaled 1000x the gate block's: a kernel reading the gate's scales for the up rows is
    off by that factor."""
    torch.manual_seed(1)
    k, half = 256, 128
    w = torch.randn(2, 2 * half, k) / k ** 0.5
    w[:, half:] *= 1000
    q, s = fp8.quantize_weight_blocks(w)
    assert float(s[0, 1, 0] / s[0, 0, 0]) > 100
    x = torch.randn(3, k)
    off, gather = _expert_offsets([2, 2]), torch.tensor([0, 1, 2, 0])
    want = ops.fp8_grouped_linear(x, q, s, off, gather, None, activation="silu_and_mul")
    for config in (None, (8, 128, 4, 1)):
        torch.testing.assert_close(tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off, gather_index=gather,
                                                        activation="silu_and_mul", config=config),
                                   want, rtol=1e-4, atol=1e-3)  # (fp32 sums in another order; the bug is 1000x)


def test_op_argument_errors():
    q, s = fp8.quantize_weight_blocks(torch.randn(64, 64))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        ops.fp8_block_linear(torch.randn(2, 64), q, s[:, :0])
    with pytest.raises(ValueError, match="input channels"):
        ops.fp8_block_linear(torch.randn(2, 65), q, s)
    with pytest.raises(ValueError, match="dtype"):
        ops.fp8_block_linear(torch.randn(2, 64), q.float(), s)
    with pytest.raises(ValueError, match="expert_offsets"):
        ops.fp8_grouped_linear(torch.randn(2, 64), q[None], s[None], torch.tensor([0, 1, 2]))


# --------------------------------------------------------------------------------------------
# Triton kernels under the interpreter
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(1, 40, 100), (9, 160, 256), (66, 48, 130)])
def test_linear_kernel_matches_op(m, n, k):
    """1 row: the GEMV kernel; 9 rows (the decode tiles) and 66 (and any explicit tile config): the
    quantize kernel + the tensor-core GEMM, also with the activation quantized inside the GEMM
    (``quant_in_gemm``)."""
    assert tfp8.use_gemv(m) == (m == 1)
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k + 8, generator=g)[:, 4 : 4 + k]  # strided
    q, s = fp8.quantize_weight_blocks(torch.randn(n, k, generator=g) / k ** 0.5)
    bias = torch.randn(n, generator=g)
    expected = ops.fp8_block_linear(x, q, s, bias)
    torch.testing.assert_close(tfp8.fp8_block_linear_triton(x, q, s, bias), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tfp8.fp8_gemm_triton(x, q, s, bias, quant_in_gemm=True), expected, rtol=1e-5,
                               atol=1e-5)
    # an explicit config with narrow column tiles (each divides the 128-row weight block)
    torch.testing.assert_close(tfp8.fp8_block_linear_triton(x, q, s, None, config=(16, 32, 4, 1)),
                               ops.fp8_block_linear(x, q, s), rtol=1e-5, atol=1e-5)
    # the launch order walking 3 row tiles at a time column by column (a last group of fewer); column
    # tiles spanning two weight blocks (a scale per column)
    for config in ((16, 16, 4, 1, 3), (16, 256, 4, 1, 2)):
        torch.testing.assert_close(tfp8.fp8_block_linear_triton(x, q, s, bias, config=config), expected,
                                   rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)
    torch.testing.assert_close(tfp8.fp8_block_linear_triton(xb, q, s).float(),
                               ops.fp8_block_linear(xb, q, s).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("counts", [[1, 0, 2, 1], [20, 0, 40, 9]])
def test_grouped_kernel_matches_op(counts):
    """Empty experts, experts spanning several row tiles, the GEMV (4 rows over 4 experts) and the
    tensor-core path (69 rows)."""
    assert tfp8.use_gemv(sum(counts), len(counts)) == (sum(counts) == 4)
    k, n = 160, 48
    q, s = fp8.quantize_weight_blocks(torch.randn(4, n, k) / k ** 0.5)
    x = torch.randn(sum(counts), k)
    off = _expert_offsets(counts)
    expected = ops.fp8_grouped_linear(x, q, s, off)
    torch.testing.assert_close(tfp8.fp8_grouped_linear_triton(x, q, s, off), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tfp8.fp8_grouped_linear_triton(x, q, s, off.to(torch.int32), config=(16, 16, 4, 1)),
                               expected, rtol=1e-5, atol=1e-5)
    for config in ((16, 16, 4, 1, 4), (16, 256, 4, 1, 1)):
        torch.testing.assert_close(tfp8.fp8_grouped_linear_triton(x, q, s, off, config=config),
                                   expected, rtol=1e-5, atol=1e-5)


def test_kernel_edge_shapes_and_configs():
    q, s = fp8.quantize_weight_blocks(torch.randn(32, 64))
    assert tfp8.fp8_block_linear_triton(torch.randn(0, 64), q, s).shape == (0, 32)
    qz, sz = tfp8.fp8_quantize_triton(torch.randn(0, 64))
    assert qz.shape == (0, 64) and sz.shape == (0, 1)
    with pytest.raises(ValueError, match="BN"):
        tfp8.fp8_block_linear_triton(torch.randn(2, 64), q, s, config=(16, 48, 4, 1))
    with pytest.raises(ValueError, match="GROUP_M"):
        tfp8.fp8_block_linear_triton(torch.randn(2, 64), q, s, config=(16, 16, 4, 1, 0))
    with pytest.raises(ValueError, match="config is"):
        tfp8.fp8_block_linear_triton(torch.randn(2, 64), q, s, config=(16, 16, 4))
    # decode: narrow column tiles so about two programs per SM stream the weight; prefill: 64 x 128
    assert tfp8.fp8_gemm_config(1, 2048, 2048, sms=132)[:2] == (16, 16)
    assert tfp8.fp8_gemm_config(1, 12288, 2048, sms=132)[:2] == (16, 32)
    assert tfp8.fp8_gemm_config(4096, 2048, 2048, sms=132) == (64, 128, 4, 3, 8)
    assert tfp8.fp8_gemm_config(40960, 1024, 2048, grouped=True, experts=512, sms=132) == (64, 128, 4, 4, 8)


@pytest.mark.parametrize("m,k", [(5, 256), (8, 200), (1, 128)])
def test_quantize_in_cublas_layout(m, k):
    """The activation cuBLAS's block-scaled GEMM takes: the reference's bytes in rows padded to a multiple
    of 4 (zeros, scale of a zero group) and column-major scales (``[G, rows]``)."""
    x = torch.randn(m, k + 3)[:, :k] * 3  # strided
    q, st = tfp8.fp8_quantize_for_cublas(x)
    rows = -(-m // 4) * 4
    assert q.shape == (rows, k) and st.shape == (-(-k // 128), rows)
    qr, sr = fp8.reference_quantize(x)
    assert torch.equal(q[:m].float(), qr.float()) and torch.equal(st.t()[:m], sr)
    assert torch.equal(q[m:].float(), torch.zeros(rows - m, k))
    assert torch.equal(st.t()[m:], torch.full((rows - m, st.shape[0]), fp8.FP8_EPS / fp8.FP8_MAX))


def test_cublas_choice(monkeypatch):
    """``HYBRID_COMPILE_FP8_GEMM``: ``auto`` takes cuBLAS only where it runs (never on a CPU or under the
    interpreter), ``triton`` never, ``cublas`` where it cannot run is an error naming the setting, as
    is an unknown value; decode sizes stay on the GEMV whatever the choice."""
    q, s = fp8.quantize_weight_blocks(torch.randn(128, 256))
    x = torch.randn(16, 256)
    assert not tfp8.cublas_block_gemm_supported(x.device) and not tfp8.use_cublas(x, q)
    monkeypatch.setenv(tfp8.FP8_GEMM_ENV, "triton")
    assert not tfp8.use_cublas(x, q)
    monkeypatch.setenv(tfp8.FP8_GEMM_ENV, "cublas")
    assert not tfp8.use_cublas(x[:1], q)
    with pytest.raises(RuntimeError, match="HYBRID_COMPILE_FP8_GEMM=cublas"):
        tfp8.use_cublas(x, q)
    monkeypatch.setenv(tfp8.FP8_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="HYBRID_COMPILE_FP8_GEMM='fast'"):
        tfp8.use_cublas(x, q)


def test_ops_opcheck_and_compile_without_graph_breaks():
    q, s = fp8.quantize_weight_blocks(torch.randn(48, 64))
    qe, se = fp8.quantize_weight_blocks(torch.randn(3, 32, 48))
    x = torch.randn(5, 64)
    off = _expert_offsets([2, 0, 3])
    run_opcheck(ops.fp8_quantize_per_token_group.default, (x,))
    opcheck_fp8_inputs(ops.fp8_block_linear.default, (x, q, s, torch.randn(48)))
    opcheck_fp8_inputs(ops.fp8_grouped_linear.default, (x[:, :48], qe, se, off))
    # the routed form: gathered rows, silu_and_mul, scattered rows
    routed = (x[:, :48], qe, se, _expert_offsets([3, 1, 2]), torch.tensor([4, 0, 2, 2, 1, 3]), torch.randperm(6))
    opcheck_fp8_inputs(ops.fp8_grouped_linear.default, routed, {"activation": "silu_and_mul"})

    def fn(a, w, ws, we, wes, o):
        h = torch.relu(ops.fp8_block_linear(a, w, ws)) + 1
        return ops.fp8_grouped_linear(h, we, wes, o) * 2

    eager, compiled, _, _ = compile_and_compare(fn, x, q, s, qe, se, off)
    torch.testing.assert_close(compiled, eager)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at the real checkpoints' shapes
# --------------------------------------------------------------------------------------------

# Qwen3-Next-80B-A3B-FP8: GDN in_proj_qkvz / out_proj, attention q (gated) / k / o, shared expert
QWEN3_NEXT_LINEARS = [(12288, 2048), pytest.param(2048, 4096, marks=pytest.mark.smoke), (8192, 2048), (512, 2048),
                      (1024, 2048), (2048, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", QWEN3_NEXT_LINEARS)
def test_cuda_linear_at_model_shapes(n, k):
    torch.manual_seed(0)
    q, s = fp8.quantize_weight_blocks(torch.randn(n, k, device="cuda") / k ** 0.5)
    for m in (1, 16, 64, 65, 512):  # the GEMV, the tensor cores' decode tiles and the prefill tiles
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        expected = fp8.reference_block_linear(x.float(), q, s)
        torch.testing.assert_close(ops.fp8_block_linear(x, q, s).float(), expected, rtol=2e-2, atol=2e-2,
                                   msg=f"m={m}")
    opcheck_fp8_inputs(ops.fp8_block_linear.default, (torch.randn(3, k, device="cuda", dtype=torch.bfloat16), q, s))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_cublas_block_gemm_against_reference_and_our_kernel(dtype):
    """Dense calls above decode size on a Hopper GPU go to cuBLAS's block-scaled GEMM: rows not a
    multiple of 4 (padded), a bias, fp32 and bf16 activations; equal to the reference and to our
    tensor-core kernel within the output's rounding, and replayed from a CUDA graph with new inputs.
    K blocks not a multiple of 4 (torch refuses their weight scales) stay on our kernel."""
    if not tfp8.cublas_block_gemm_supported(torch.device("cuda")):
        pytest.skip("cuBLAS's block-scaled FP8 GEMM needs Hopper, CUDA 12.9+ and torch 2.9+")
    torch.manual_seed(0)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    for n, k in ((2048, 4096), (256, 640)):
        q, s = fp8.quantize_weight_blocks(torch.randn(n, k, device="cuda") / k ** 0.5)
        bias = torch.randn(n, device="cuda").to(dtype)
        for m in (9, 65, 4099):
            x = torch.randn(m, k, device="cuda").to(dtype)
            assert tfp8.use_cublas(x, q) == (k % 512 == 0)
            expected = fp8.reference_block_linear(x.float(), q, s, bias.float())
            got = ops.fp8_block_linear(x, q, s, bias)
            assert got.shape == (m, n) and got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol, msg=f"n={n} k={k} m={m}")
            torch.testing.assert_close(got.float(), tfp8.fp8_block_linear_triton(x, q, s, bias).float(),
                                       rtol=tol, atol=tol)
    q, s = fp8.quantize_weight_blocks(torch.randn(256, 512, device="cuda") / 512 ** 0.5)
    x = torch.randn(33, 512, device="cuda").to(dtype)
    assert tfp8.use_cublas(x, q)
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    ops.fp8_block_linear(static, q, s)  # warm
    with torch.cuda.graph(graph):
        out = ops.fp8_block_linear(static, q, s)
    static.copy_(x)
    graph.replay()
    torch.testing.assert_close(out, ops.fp8_block_linear(x, q, s), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, pytest.param(16, marks=pytest.mark.smoke), 300])
def test_cuda_grouped_at_qwen3_next_expert_shapes(tokens):
    """512 experts, top-10, moe_intermediate 512: gate_up [512, 1024, 2048] and down [512, 2048, 512]."""
    torch.manual_seed(0)
    experts, top_k = 512, 10
    for n, k in ((1024, 2048), (2048, 512)):
        q, s = fp8.quantize_weight_blocks(torch.randn(experts, n, k, device="cuda") / k ** 0.5)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).flatten()
        counts = torch.bincount(ids, minlength=experts)
        off = torch.zeros(experts + 1, dtype=torch.int64, device="cuda")
        off[1:] = counts.cumsum(0)
        x = torch.randn(ids.numel(), k, device="cuda").to(torch.bfloat16)
        expected = fp8.reference_grouped_linear(x.float(), q, s, off)
        torch.testing.assert_close(ops.fp8_grouped_linear(x, q, s, off).float(), expected, rtol=2e-2, atol=2e-2)
        # as the experts forward calls it: gate_up reads each token's row and fuses silu_and_mul, down_proj
        # writes its rows back in (token, k) order
        order = torch.argsort(ids, stable=True)
        gather, scatter, act = (order // top_k, None, "silu_and_mul") if n == 1024 else (None, order, "none")
        xt = x[:tokens] if gather is not None else x
        expected = fp8.reference_grouped_linear(xt.float(), q, s, off, gather, scatter, act)
        torch.testing.assert_close(ops.fp8_grouped_linear(xt, q, s, off, gather, scatter, activation=act).float(),
                                   expected, rtol=2e-2, atol=2e-2)
    opcheck_fp8_inputs(ops.fp8_grouped_linear.default,
                        (x[:5], q[:3], s[:3], torch.tensor([0, 2, 2, 5], device="cuda")))


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_quantize_op_at_model_shapes():
    """The registered CUDA op (the quantize kernel): scales ``amax / 448`` per group of 128 (partial
    last group, an all-zero group), values within e4m3's rounding; with unit scales every tie
    rounds to the even code exactly."""
    x = torch.randn(300, 2100) * torch.logspace(-3, 2, 2100)
    x[7, 128:256] = 0
    q, s = ops.fp8_quantize_per_token_group(x.cuda())
    q, s = q.cpu(), s.cpu()
    assert q.shape == (300, 2100) and q.dtype == fp8.FP8_DTYPE and s.shape == (300, 17)
    amax = torch.nn.functional.pad(x, (0, 17 * 128 - 2100)).view(300, 17, 128).abs().amax(-1)
    torch.testing.assert_close(s, amax.clamp(min=fp8.FP8_EPS) / fp8.FP8_MAX, rtol=1e-6, atol=0)
    scale = s.repeat_interleave(128, 1)[:, :2100]
    assert bool(((q.float() * scale - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -10).all())
    assert torch.equal(q[7, 128:256].float(), torch.zeros(128))
    ties = _with_unit_scale(_rounding_cases())
    qt, st = ops.fp8_quantize_per_token_group(ties.cuda())
    assert torch.equal(st.cpu(), torch.ones(ties.shape[0], 1)) and torch.equal(qt.cpu().float(), _quantize_expected(ties))


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_ops_in_a_cuda_graph():
    """The tensor-core decode path of both ops (24 rows over 8 experts: above the GEMV's rows)
    replayed from a CUDA graph, the activation and the routing changed between replays."""
    assert not tfp8.use_gemv(24) and not tfp8.use_gemv(24, 8)
    off, new_off = [0, 3, 3, 9, 9, 9, 9, 24, 24], [0, 0, 6, 6, 6, 9, 9, 9, 24]  # routing changes between replays
    out, eager, _ = fp8_linear_then_experts_graph(
        24, off, new_off,
        lambda x, q, s, qe, se, off: ops.fp8_grouped_linear(ops.fp8_block_linear(x, q, s), qe, se, off))
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
