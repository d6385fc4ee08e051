"""The block-FP8 GEMV decode path (``gemv_kernel`` of hybrid_compile/ops/triton/gemv.py, ``SCALED`` by
the block scales): dense calls of a few rows and grouped (MoE experts) calls at decode.

Oracle, independent of the ops' code: the activation rounded to e4m3 per token and group of 128
channels by torch's own cast (``scale = max(|group|, 1e-10) / 448``), the weight dequantized block
by block, an fp64 matmul. On CPU the launchers run under Triton's interpreter on tiny shapes; the
``gpu`` tests run the registered CUDA ops at Qwen3-Next-80B-A3B's shapes, under opcheck and in a
CUDA graph with programmatic dependent launches.
"""

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import fp8
from hybrid_compile.ops.triton import fp8 as tfp8
from op_testing import fp8_linear_then_experts_graph, opcheck_fp8_inputs

INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def _oracle(x, weight, scale_inv, bias=None, counts=None):
    """fp64 ``dequant(e4m3(x)) @ dequant(weight).T`` (+ bias); ``counts``: rows per expert of a grouped call."""
    m, k = x.shape
    g = -(-k // 128)
    xg = torch.nn.functional.pad(x.float().cpu(), (0, g * 128 - k)).view(m, g, 128)
    scale = xg.abs().amax(-1).clamp(min=1e-10) / torch.tensor(448.0)
    xd = ((xg / scale[..., None]).to(torch.float8_e4m3fn).double() * scale[..., None].double()).view(m, -1)[:, :k]
    w = weight.cpu().double()
    s = scale_inv.cpu().double().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : w.shape[-2], :k]
    wd = w * s
    if counts is None:
        y = xd @ wd.t()
    else:
        y = torch.cat([xd[sum(counts[:e]): sum(counts[: e + 1])] @ wd[e].t() for e in range(len(counts))])
    return y + bias.cpu().double() if bias is not None else y


def _offsets(counts, dtype=torch.int64):
    off = torch.zeros(len(counts) + 1, dtype=dtype)
    off[1:] = torch.tensor(counts).cumsum(0)
    return off


def _weight(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return fp8.quantize_weight_blocks(torch.randn(*shape, generator=g) / shape[-1] ** 0.5)


def _close(got, want, dtype=torch.float32):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double().cpu(), want.to(dtype).double(), rtol=tol, atol=tol)


def test_dequantized_activation_is_the_references_bytes():
    """The GEMV's input: the quantize kernel's ``q * scale`` in fp32, bit for bit the reference's."""
    x = torch.randn(3, 300) * torch.logspace(-3, 2, 300)
    x[1, 128:256] = 0
    q, s = fp8.reference_quantize(x)
    want = fp8._dequantize_groups(q, s)
    assert torch.equal(tfp8.fp8_dequantized_activation_triton(x[:, :]), want)
    xs = torch.randn(2, 600)[:, ::2]  # strided
    q, s = fp8.reference_quantize(xs)
    assert torch.equal(tfp8.fp8_dequantized_activation_triton(xs), fp8._dequantize_groups(q, s))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8])
def test_dense_rows_up_to_the_threshold(m):
    """N = 130 (two weight block rows, the second partial), K = 300 (partial group; the default
    BLOCK_K does not divide it), bias, a strided activation: the op's CUDA path for ``m`` rows."""
    n, k = 130, 300
    q, s = _weight(n, k, seed=m)
    x = torch.randn(m, k + 6)[:, 3: 3 + k]
    bias = torch.randn(n)
    assert tfp8.use_gemv(m)
    _close(tfp8.fp8_block_linear_triton(x, q, s, bias), _oracle(x, q, s, bias))


@pytest.mark.parametrize("config,rows", [((2, 128, 4, 1), None), ((16, 64, 2, 2), 1), ((4, 256, 4, 1), 4)])
def test_dense_configs_several_steps_and_row_tiles(config, rows):
    """Several K steps with a partial last one, explicit configs, rows per program below the rows
    (7 rows: several row tiles, the last partial), bf16 in and out."""
    n, k = 72, 330
    q, s = _weight(n, k, seed=1)
    x = torch.randn(7, k)
    _close(tfp8.fp8_gemv_triton(x, q, s, config=config, rows_per_program=rows), _oracle(x, q, s))
    xb = x[:3].to(torch.bfloat16)
    yb = tfp8.fp8_gemv_triton(xb, q, s, config=config)
    assert yb.dtype == torch.bfloat16
    _close(yb, _oracle(xb, q, s), torch.bfloat16)


@pytest.mark.parametrize("counts", [[1, 0, 2, 1], [0, 0, 3, 0], [1, 1, 1, 1], [0, 3, 0, 0, 0, 0, 1, 0]])
def test_grouped_decode(counts):
    """Empty experts, all rows on one expert (an odd count: a partial row pair), one row each; int32
    and int64 offsets; one and two rows per program."""
    e = len(counts)
    n, k = 40, 200
    q, s = _weight(e, n, k, seed=e)
    x = torch.randn(sum(counts), k)
    want = _oracle(x, q, s, counts=counts)
    assert tfp8.use_gemv(x.shape[0], e)
    _close(tfp8.fp8_grouped_linear_triton(x, q, s, _offsets(counts)), want)
    _close(tfp8.fp8_gemv_triton(x, q, s, expert_offsets=_offsets(counts, torch.int32), config=(8, 64, 4, 1),
                                rows_per_program=1), want)


@pytest.mark.parametrize("m,k,grouped", [(1, 300, False), (3, 256, False), (5, 200, True)])
def test_gemv_quantizing_its_own_activation(m, k, grouped):
    """The GEMV that quantizes its rows itself (batch-1 decode: no quantize kernel before it) gives the
    bytes of the GEMV after the quantize kernel: a partial last group, an all-zero group, a strided
    activation, several rows per program, grouped rows; the choice by the repeated work."""
    g = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k + 5, generator=g) * torch.logspace(-3, 2, k + 5))[:, 2: 2 + k]
    x[0, :128] = 0
    n = 72
    kw = {}
    if grouped:
        counts = [2, 0, 3]
        q, s = _weight(len(counts), n, k, seed=3)
        kw = dict(expert_offsets=_offsets(counts))
    else:
        q, s = _weight(n, k, seed=2)
    own = tfp8.fp8_gemv_triton(x, q, s, quantize_in_gemv=True, **kw)
    assert torch.equal(own, tfp8.fp8_gemv_triton(x, q, s, quantize_in_gemv=False, **kw))
    _close(own, _oracle(x, q, s, counts=[2, 0, 3]) if grouped else _oracle(x, q, s))
    # the default: batch-1 sizes of the 80B shapes quantize in the GEMV, two rows of its largest do not
    assert tfp8.gemv_quantizes_activation(1, 12288, 2048, tfp8.fp8_gemv_config(12288, 2048, 1))
    assert not tfp8.gemv_quantizes_activation(2, 12288, 2048, tfp8.fp8_gemv_config(12288, 2048, 2))
    # one row of the output projections quantizes in the GEMV, two rows of them do not (the H200 sweep)
    assert tfp8.gemv_quantizes_activation(1, 2048, 4096, tfp8.fp8_gemv_config(2048, 4096, 1))
    assert not tfp8.gemv_quantizes_activation(2, 2048, 4096, tfp8.fp8_gemv_config(2048, 4096, 2))
    assert not tfp8.gemv_quantizes_activation(1, 64, 64, (8, 64, 4, 1))  # a K step narrower than a group
    with pytest.raises(ValueError, match="quantize_a needs"):
        tfp8.fp8_gemv_triton(x, *(_weight(n, k, seed=2)), config=(8, 64, 4, 1), quantize_in_gemv=True)


def test_no_rows_no_channels_and_bad_arguments():
    q, s = _weight(32, 64)
    assert tfp8.fp8_gemv_triton(torch.randn(0, 64), q, s).shape == (0, 32)
    qe, se = _weight(3, 16, 0)
    bias = torch.randn(16)
    assert torch.equal(tfp8.fp8_gemv_triton(torch.randn(2, 0), qe[0], se[0], bias), bias.expand(2, 16))
    with pytest.raises(ValueError, match="BLOCK_N"):
        tfp8.fp8_gemv_triton(torch.randn(2, 64), q, s, config=(24, 64, 4, 1))
    with pytest.raises(ValueError, match="BLOCK_K"):
        tfp8.fp8_gemv_triton(torch.randn(2, 64), q, s, config=(8, 96, 4, 1))
    for bad in (0, 5):  # (0 is no default: refused like any count outside 1..4)
        with pytest.raises(ValueError, match="rows_per_program"):
            tfp8.fp8_gemv_triton(torch.randn(2, 64), q, s, rows_per_program=bad)


def test_dense_op_dispatch_follows_the_weight_shape(monkeypatch):
    """``fp8_block_linear_triton`` without a config: two rows over a wide weight go to the tensor-core
    GEMM, one row over it and two rows over a narrow one to the GEMV (each path stubbed: the dispatch only)."""
    calls = []
    monkeypatch.setattr(tfp8, "fp8_gemv_triton", lambda *a, **kw: calls.append("gemv"))
    monkeypatch.setattr(tfp8, "fp8_gemm_triton", lambda *a, **kw: calls.append("tc"))
    wide = torch.empty(8192, 2048, dtype=fp8.FP8_DTYPE)
    narrow = torch.empty(2048, 4096, dtype=fp8.FP8_DTYPE)
    for rows, w in ((1, wide), (2, wide), (2, narrow)):
        tfp8.fp8_block_linear_triton(torch.empty(rows, w.shape[1]), w, torch.empty(1))
    assert calls == ["gemv", "tc", "gemv"]


def test_gemv_config_and_dispatch():
    for n, k in [(12288, 2048), (2048, 4096), (1024, 2048), (2048, 512), (40, 100)]:
        for rows in range(1, tfp8.FP8_DECODE_MAX_ROWS + 1):
            bn, bk, warps, stages = tfp8.fp8_gemv_config(n, k, rows)
            assert fp8.FP8_BLOCK % bn == 0 and bk & (bk - 1) == 0 and bk < 2 * k
            assert bn * bk * min(rows, tfp8.FP8_GEMV_MAX_ROWS) <= 16384  # accumulators: 64 a thread at 8 warps
    # the H200 sweep's 1-2 row tiles by the weight's shape: wide (in_proj_qkvz), long rows (out_proj), the rest
    assert tfp8.fp8_gemv_config(12288, 2048, 1) == (32, 256, 4, 2)
    assert tfp8.fp8_gemv_config(2048, 4096, 2) == (8, 512, 8, 2)
    assert tfp8.fp8_gemv_config(1024, 2048, 1) == (8, 1024, 8, 2)
    assert tfp8.fp8_gemv_config(2048, 512, 1) == (8, 512, 8, 2)  # BLOCK_K capped at the row
    assert tfp8.fp8_gemv_config(1024, 2048, 1, grouped=True) == (16, 256, 4, 2)
    # the experts' tiles are the float experts' rule (one 256-column step streamed as two of 128: TP 2's down_proj)
    assert tfp8.fp8_gemv_config(2048, 256, 1, grouped=True) == (32, 128, 4, 2)
    from hybrid_compile.ops.triton.moe import moe_gemv_config
    for n, k in [(1024, 2048), (2048, 512), (2048, 256), (2048, 128), (512, 2048), (40, 100)]:
        assert tfp8.fp8_gemv_config(n, k, 1, grouped=True) == moe_gemv_config(n, k, torch.bfloat16)
    assert tfp8.use_gemv(tfp8.FP8_DECODE_MAX_ROWS) and not tfp8.use_gemv(tfp8.FP8_DECODE_MAX_ROWS + 1)
    # wide projections (in_proj_qkvz, q_proj) take the tensor cores from two rows, the others up to 8 rows
    assert tfp8.use_gemv(1, weight_shape=(12288, 2048)) and not tfp8.use_gemv(2, weight_shape=(12288, 2048))
    assert tfp8.use_gemv(8, weight_shape=(2048, 4096)) and tfp8.use_gemv(8, weight_shape=(1024, 2048))
    # experts: one row per 16 of them (512 experts: 3 tokens of top-10), at least the dense calls' 8 rows
    assert tfp8.use_gemv(32, 512) and not tfp8.use_gemv(33, 512)
    assert tfp8.use_gemv(8, 4) and not tfp8.use_gemv(9, 4)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at Qwen3-Next-80B-A3B's shapes
# --------------------------------------------------------------------------------------------

LINEARS = [(12288, 2048), (2048, 4096), (8192, 2048), (4608, 2048), (1024, 2048), (2048, 512)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LINEARS)
def test_cuda_gemv_at_model_shapes(n, k):
    torch.manual_seed(0)
    q, s = fp8.quantize_weight_blocks(torch.randn(n, k, device="cuda") / k ** 0.5)
    for m in range(1, tfp8.FP8_DECODE_MAX_ROWS + 1):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        want = fp8.reference_block_linear(x.float(), q, s)
        torch.testing.assert_close(ops.fp8_block_linear(x, q, s).float(), want, rtol=2e-2, atol=2e-2, msg=f"m={m}")
        torch.testing.assert_close(tfp8.fp8_gemv_triton(x.float(), q, s), want, rtol=1e-4, atol=1e-4)
    opcheck_fp8_inputs(ops.fp8_block_linear.default, (torch.randn(2, k, device="cuda", dtype=torch.bfloat16), q, s))


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("tokens", [1, 4, 40])
def test_cuda_grouped_gemv_at_expert_shapes(tokens):
    """512 experts, top-10 distinct: gate_up [512, 1024, 2048] and down [512, 2048, 512]; and all of
    the rows on one expert."""
    torch.manual_seed(0)
    experts, top_k = 512, 10
    for n, k in ((1024, 2048), (2048, 512)):
        q, s = fp8.quantize_weight_blocks(torch.randn(experts, n, k, device="cuda") / k ** 0.5)
        ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(tokens)]).flatten()
        one_expert = torch.zeros(experts, dtype=torch.int64, device="cuda").index_fill_(0, ids[:1], ids.numel())
        for counts in (torch.bincount(ids, minlength=experts), one_expert):
            off = torch.zeros(experts + 1, dtype=torch.int64, device="cuda")
            off[1:] = counts.cumsum(0)
            x = torch.randn(ids.numel(), k, device="cuda").to(torch.bfloat16)
            want = fp8.reference_grouped_linear(x.float(), q, s, off)
            torch.testing.assert_close(tfp8.fp8_gemv_triton(x, q, s, expert_offsets=off).float(), want,
                                       rtol=2e-2, atol=2e-2)  # (at 40 tokens the op takes the tensor cores)
            torch.testing.assert_close(ops.fp8_grouped_linear(x, q, s, off).float(), want, rtol=2e-2, atol=2e-2)
    assert tfp8.use_gemv(3, 3)  # the opcheck below runs the GEMV path
    opcheck_fp8_inputs(ops.fp8_grouped_linear.default,
                       (x[:3], q[:3], s[:3], torch.tensor([0, 2, 2, 3], device="cuda")))


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_gemv_in_a_cuda_graph():
    """Dense then grouped GEMV replayed from a CUDA graph (programmatic dependent launches on Hopper),
    the activation and the routing changed between replays."""
    assert tfp8.use_gemv(2) and tfp8.use_gemv(2, 8)
    out, eager, (x, q, s, qe, se, off) = fp8_linear_then_experts_graph(
        2, [0, 1, 1, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 2, 2],
        lambda x, q, s, qe, se, off: ops.fp8_grouped_linear(ops.fp8_block_linear(x, q, s), qe, se, off))
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    h = fp8.reference_block_linear(x.float(), q, s).to(torch.bfloat16)
    want = fp8.reference_grouped_linear(h.float(), qe, se, off)
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)
