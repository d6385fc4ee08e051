"""Float MoE experts (hybrid_compile/ops/moe.py) and their Triton kernels (hybrid_compile/ops/triton/moe.py:
the tensor-core grouped GEMM, and at decode the CUDA-core GEMV of hybrid_compile/ops/triton/gemv.py).

Oracle: the literal loop over (token, k) pairs in fp64, ``out[t] += w[t, k] * down[e] @ act(up[e] @ x[t])``
(transformers' experts math); for the op alone the literal loop over its rows. On CPU the kernel runs under
Triton's interpreter at tiny shapes, with the activation fused into the first grouped GEMM (transformers'
SiLU gate: ``silu_and_mul``; relu2: ``relu2``) and not (a plain function); the ``gpu`` tests run the
registered CUDA op at Qwen3.5-35B-A3B's expert shapes (256 experts, top-8, hidden 2048, expert width 512,
silu gate), Qwen3-Next-80B-A3B's (512 experts, top-10, hidden 2048, width 512, silu gate) and
Nemotron-3-Nano's (128 experts, top-6, hidden 2688, width 1856, relu2), each path of the kernel also
inside a CUDA graph whose routing changes between replays; the GEMV against the tensor cores and the
plain-torch op at 1-8 tokens.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import moe
from hybrid_compile.ops.triton import moe as tmoe
from op_testing import compile_and_compare, run_opcheck

INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def relu2(v):
    return F.relu(v) ** 2


def silu(v):
    """SiLU as a function of our own: an ``act_fn`` that is not fused."""
    return v * torch.sigmoid(v)


def _oracle(x, top_k_index, top_k_weights, up, down, act, has_gate):
    """The literal per-(token, k) loop in fp64."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            h = up[e].double() @ x[t].double()
            if has_gate:
                g, u = h.chunk(2)
                h = act(g) * u
            else:
                h = act(h)
            out[t] += float(top_k_weights[t, j]) * (down[e].double() @ h)
    return out


def _routing(tokens, experts, top_k, skew=False, generator=None):
    """Distinct experts per token; ``skew``: most pairs on expert 0 and 1, the last experts empty."""
    if skew:
        probs = torch.tensor([50.0, 20.0] + [1.0] * (experts - 4) + [0.0, 0.0])
        idx = torch.stack([torch.multinomial(probs, top_k, generator=generator) for _ in range(tokens)])
    else:
        idx = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1)
    return idx, w


def _weights(experts, hidden, inter, has_gate, dtype):
    up = torch.randn(experts, (2 if has_gate else 1) * inter, hidden) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter) / inter ** 0.5
    return up.to(dtype), down.to(dtype)


TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}
CASES = [(1, 2, False), (5, 2, True), (37, 3, True), (12, 1, False)]  # (tokens, top_k, skewed routing)


def _act_module(has_gate):
    """transformers' activation modules of the experts: fused into the first grouped GEMM."""
    return ACT2FN["silu"] if has_gate else ACT2FN["relu2"]


def _spy(linear, seen):
    """``linear`` recording the activation each call asked for."""
    def call(*args, activation="none", **kwargs):
        seen.append(activation)
        return linear(*args, activation=activation, **kwargs)
    return call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_gate", [True, False])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tokens,top_k,skew", CASES)
def test_experts_forward_matches_the_pair_loop(tokens, top_k, skew, fused, has_gate, dtype):
    """The CPU op and the Triton kernels (interpreter: the default path, and the tensor cores forced
    where the default is the GEMV) through the whole experts forward: T=1, uneven loads, experts with no tokens,
    silu-gate and relu2 experts; the activation fused into the first grouped GEMM (transformers'
    modules) or run between the GEMMs (plain functions)."""
    experts, hidden, inter = 6, 32, 24
    act = silu if has_gate else relu2
    act_fn = _act_module(has_gate) if fused else act
    idx, w = _routing(tokens, experts, top_k, skew)
    up, down = _weights(experts, hidden, inter, has_gate, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    expected = _oracle(x, idx, w, up, down, act, has_gate)
    atol, rtol = TOL[dtype]
    fused_act = ("silu_and_mul" if has_gate else "relu2") if fused else "none"
    # the default path (the GEMV up to two rows per expert) and, where that is the GEMV, the tensor
    # cores forced (the GEMV forced at 111 rows would take the interpreter long)
    default_path = tmoe.moe_path(tokens * top_k, experts)
    assert default_path == ("tensor_cores" if tokens == 37 else "gemv")
    forced = [functools.partial(tmoe.moe_grouped_linear_triton, path="tensor_cores")] if default_path == "gemv" else []
    for linear in (ops.moe_grouped_linear, tmoe.moe_grouped_linear_triton, *forced):
        seen = []
        out = moe.fused_moe_experts(x, idx, w, up, down, act_fn, has_gate, grouped_linear=_spy(linear, seen))
        assert seen == [fused_act, "none"]
        assert out.dtype == dtype and out.shape == (tokens, hidden)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol, msg=f"linear={linear}")


def test_which_activations_fuse():
    """transformers' SiLU classes (ACT2FN "silu" / "swish", nn.SiLU) or F.silu (LFM2-MoE's) with a gate,
    relu2 without one; nothing else (another function, a subclass that may change forward)."""
    assert moe.fused_activation(F.silu, True) == "silu_and_mul"
    assert moe.fused_activation(ACT2FN["silu"], True) == "silu_and_mul"
    assert moe.fused_activation(ACT2FN["swish"], True) == "silu_and_mul"
    assert moe.fused_activation(nn.SiLU(), True) == "silu_and_mul"
    assert moe.fused_activation(ACT2FN["relu2"], False) == "relu2"
    class MySiLU(nn.SiLU):
        pass

    for act_fn, has_gate in ((ACT2FN["silu"], False), (F.silu, False), (ACT2FN["relu2"], True), (silu, True),
                             (relu2, False), (MySiLU(), True), (ACT2FN["gelu"], True), (ACT2FN["gelu"], False)):
        assert moe.fused_activation(act_fn, has_gate) == "none", (act_fn, has_gate)


def _row_loop(x, weight, offsets, gather, scatter, activation):
    """The op's rows one by one in fp64: ``y[scatter[r]] = act(weight[e] @ x[gather[r]])``."""
    rows = gather.shape[0] if gather is not None else x.shape[0]
    width = weight.shape[1] // 2 if activation == "silu_and_mul" else weight.shape[1]
    y = torch.zeros(rows, width, dtype=torch.float64, device=x.device)
    for e in range(weight.shape[0]):
        for r in range(int(offsets[e]), int(offsets[e + 1])):
            h = weight[e].double() @ x[int(gather[r]) if gather is not None else r].double()
            if activation == "silu_and_mul":
                g, u = h.chunk(2)
                h = F.silu(g) * u
            elif activation == "relu2":
                h = relu2(h)
            y[int(scatter[r]) if scatter is not None else r] = h
    return y


@pytest.mark.parametrize("activation", ["silu_and_mul", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[1, 0, 0], [0, 13, 2], [20, 0, 37]])
def test_grouped_activation_matches_the_row_loop(counts, dtype, activation):
    """The fused activation in the op and the kernel (default tiles, and experts over several row
    tiles and an output width over two column tiles under forced 16 x 16 tiles) against the row loop:
    one row, uneven loads, experts without rows, with and without gather / scatter; the default's
    path (bit for bit the forced path's output)."""
    k, n_out = 40, 20
    n = 2 * n_out if activation == "silu_and_mul" else n_out
    weight = (torch.randn(3, n, k) / k ** 0.5).to(dtype)
    rows = sum(counts)
    x = torch.randn(rows + 2, k).to(dtype)
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    gather, scatter = torch.randint(0, rows + 2, (rows,)), torch.randperm(rows)
    atol, rtol = TOL[dtype]
    for g, s in ((gather, scatter), (None, None)):
        xs = x if g is not None else x[:rows]
        expected = _row_loop(xs, weight, off, g, s, activation)
        got = ops.moe_grouped_linear(xs, weight, off, g, s, activation)
        assert got.shape == (rows, n_out) and got.dtype == dtype
        torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol)
        for config in (None, (16, 16, 16, 4, 1)):
            got = tmoe.moe_grouped_linear_triton(xs, weight, off.to(torch.int32), g, s, activation, config=config,
                                                 path="tensor_cores")
            torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol, msg=f"{config} {g is not None}")
        # the default took the GEMV for one row over three experts; for 15 and 57 rows the tensor cores,
        # or torch._grouped_mm in bf16 (ops.triton.moe.LARGE_CALLS_PATH)
        path = "gemv" if rows == 1 else "grouped_mm" if dtype == torch.bfloat16 else "tensor_cores"
        assert tmoe.moe_path(rows, 3, dtype) == path
        assert torch.equal(tmoe.moe_grouped_linear_triton(xs, weight, off, g, s, activation),
                           tmoe.moe_grouped_linear_triton(xs, weight, off, g, s, activation, path=path))


@pytest.mark.parametrize("counts", [[1, 0, 2, 1], [20, 0, 40, 9], [0, 0, 0, 5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_kernel_matches_op_with_gather_and_scatter(counts, dtype):
    """Experts spanning several row tiles (forced 16-row tiles), non-contiguous x and weight; at 4 and
    5 rows the GEMV (the default path there) also forced with explicit tiles on the same strides."""
    n, k = 40, 48
    weight = (torch.randn(4, k, n) / k ** 0.5).to(dtype).transpose(1, 2)  # [E, N, K], K not innermost
    rows = sum(counts)
    x = torch.randn(k, rows + 3).to(dtype).t()  # [rows + 3, K], strided
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    gather = torch.randint(0, rows + 3, (rows,))
    scatter = torch.randperm(rows)
    atol, rtol = TOL[dtype]
    for g, s in ((None, None), (gather, None), (gather, scatter), (None, scatter)):
        xs = x if g is not None else x[:rows]
        expected = ops.moe_grouped_linear(xs, weight, off, g, s)
        gemv = [("gemv", (8, 16, 4, 1)), ("gemv", None)] if rows <= 8 else []  # the GEMV's sizes (interpreter time)
        for path, config in ((None, None), (None, (16, 16, 16, 4, 1)), (None, (32, 64, 32, 4, 2)), *gemv):
            got = tmoe.moe_grouped_linear_triton(xs, weight, off.to(torch.int32), g, s, config=config, path=path)
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=f"{path} {config} gather={g is not None}")


def _cpu_grouped_mm() -> bool:
    """Whether this torch runs ``torch._grouped_mm`` on the CPU (2.13 does; the GPU machine's 2.11 runs
    the CUDA tests below)."""
    try:
        torch._grouped_mm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(1, 16, 16, dtype=torch.bfloat16),
                          offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False
    return True


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("activation", ["none", "silu_and_mul", "relu2"])
@pytest.mark.parametrize("counts", [[1, 0, 0], [0, 13, 2], [20, 0, 37], [0, 0, 0]])
def test_grouped_mm_path_matches_the_row_loop(counts, activation, monkeypatch):
    """The forced ``path="grouped_mm"`` (``torch._grouped_mm``, bf16; CPU here, the same call as on CUDA)
    against the row loop, with and without gather / scatter, experts without rows, no rows at all; its
    product is rounded to bf16 before the activation (the bf16 tolerance holds); other dtypes and a
    ``config`` are errors."""
    k, n_out = 40, 24
    n = 2 * n_out if activation == "silu_and_mul" else n_out
    weight = (torch.randn(3, n, k) / k ** 0.5).bfloat16()
    rows = sum(counts)
    x = torch.randn(rows + 2, k).bfloat16()
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    gather, scatter = torch.randint(0, rows + 2, (rows,)), torch.randperm(rows)
    atol, rtol = TOL[torch.bfloat16]
    for g, s in ((gather, scatter), (None, None), (gather, None)):
        xs = x if g is not None else x[:rows]
        expected = _row_loop(xs, weight, off, g, s, activation)
        got = tmoe.moe_grouped_linear_triton(xs, weight, off, g, s, activation, path="grouped_mm")
        if rows and activation == "none":  # scattered in bf16: bit for bit the product's rows moved
            product = torch._grouped_mm(xs[g] if g is not None else xs, weight.transpose(1, 2),
                                        offs=off[1:].to(torch.int32))
            assert torch.equal(got, product if s is None else torch.empty_like(product).index_copy_(0, s, product))
        assert got.shape == (rows, n_out) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol, msg=f"gather={g is not None}")
    # as the default of calls above decode size (ops.triton.moe.LARGE_CALLS_PATH): bf16 only
    monkeypatch.setattr(tmoe, "LARGE_CALLS_PATH", "grouped_mm")
    assert tmoe.moe_path(57, 3, torch.bfloat16) == "grouped_mm" and tmoe.moe_path(57, 3, torch.float32) == "tensor_cores"
    assert tmoe.moe_path(1, 3, torch.bfloat16) == "gemv"
    if rows > 6:  # (above decode size over three experts)
        assert torch.equal(tmoe.moe_grouped_linear_triton(x, weight, off, gather, scatter, activation),
                           tmoe.moe_grouped_linear_triton(x, weight, off, gather, scatter, activation, path="grouped_mm"))
    monkeypatch.setattr(tmoe, "LARGE_CALLS_PATH", "cublas")
    with pytest.raises(ValueError, match="LARGE_CALLS_PATH must be"):
        tmoe.moe_path(57, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="takes bf16 rows and weights"):
        moe.grouped_mm_linear(x.float(), weight.float(), off)
    with pytest.raises(ValueError, match="takes no `config`"):
        tmoe.moe_grouped_linear_triton(x[:rows], weight, off, activation=activation, path="grouped_mm",
                                       config=(16, 16, 16, 4, 1))


GEMV_COUNTS = [0, 1, 2, 3, 0, 1]  # experts with 0 / 1 / 2 / 3 rows: 7 rows over 6 experts, the GEMV's


@pytest.mark.parametrize("activation", ["none", "silu_and_mul", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [True, False])
def test_gemv_path_matches_the_reference(indexed, dtype, activation):
    """The decode path (few rows per expert: the GEMV by default) against the plain-torch op's
    reference and the literal row loop: every activation, with (``indexed``) and without gather and
    scatter (each alone: ``test_grouped_kernel_matches_op_with_gather_and_scatter``), experts with 0-3
    rows, K = 40 (no multiple of BLOCK_K: a partial last step), K = 48 over 16-column steps and K = 1040
    (2-byte weights: the few-rows default of 512-column steps, a partial third); one, three and four
    rows a program; and the by-expert GEMV (``path="gemv_by_expert"``: a program per expert and column
    tile; the default at K = 40 without a gate), one (default), two (the 3-row expert in two passes) and
    four rows a pass."""
    rows = sum(GEMV_COUNTS)
    off = torch.tensor([0, *torch.tensor(GEMV_COUNTS).cumsum(0).tolist()])
    assert tmoe.moe_path(rows, len(GEMV_COUNTS)) == "gemv"
    g = torch.randint(0, rows + 3, (rows,)) if indexed else None
    s = torch.randperm(rows) if indexed else None
    atol, rtol = TOL[dtype]
    n_out = 12
    n = 2 * n_out if activation == "silu_and_mul" else n_out
    # (the default path at K = 40 / 48 is the by-expert GEMV for the ungated activations: moe_path)
    for k, configs in ((40, [(None, None, None), ("gemv", (2, 32, 2, 2), 3), ("gemv_by_expert", (2, 32, 2, 2), 2)]),
                       (48, [("gemv", (4, 16, 4, 1), 4), ("gemv_by_expert", (4, 16, 4, 1), 4)]),
                       (1040, [(None, None, None)])):  # 1040: a few rows' default over 512-column steps
        weight = (torch.randn(len(GEMV_COUNTS), n, k) / k ** 0.5).to(dtype)
        x = torch.randn(rows + 3 if g is not None else rows, k).to(dtype)
        want = moe.reference_moe_grouped_linear(x, weight, off, g, s, activation)
        literal = _row_loop(x, weight, off, g, s, activation)
        for path, config, rows_per_program in configs:
            got = tmoe.moe_grouped_linear_triton(x, weight, off, g, s, activation, config=config, path=path,
                                                 rows_per_program=rows_per_program)
            assert got.shape == (rows, n_out) and got.dtype == dtype
            if path is None:  # the default path: the GEMV's output, bit for bit
                assert torch.equal(got, tmoe.moe_grouped_linear_triton(x, weight, off, g, s, activation, path="gemv"))
            msg = f"k={k} {path} {config} rows/program={rows_per_program}"
            # the reference's fp32 products, summed in another order: an ulp of the output dtype
            torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-2,
                                       rtol=1e-5 if dtype == torch.float32 else 1e-2, msg=msg)
            torch.testing.assert_close(got.double(), literal, atol=atol, rtol=rtol, msg=msg)


def test_which_path_and_gemv_tiles():
    """The GEMV for at most two rows per expert on average, the tensor cores above; the GEMV's tiles
    (the table's, halved for silu_and_mul, BLOCK_K shortened to a short K with BLOCK_N widened);
    the path / config / rows_per_program errors."""
    assert tmoe.moe_path(1024, 512) == "gemv" and tmoe.moe_path(1025, 512) == "tensor_cores"
    assert tmoe.moe_path(10, 512) == "gemv" and tmoe.moe_path(6 * 64, 128) == "tensor_cores"
    bf16, fp32 = torch.bfloat16, torch.float32
    # by expert: ungated rows of at most 256 channels (the 80B down_proj slices at TP 4 / 2), at least a
    # row per expert on average (64 tokens of top-10 over 512 experts; not 16)
    assert tmoe.moe_path(640, 512, bf16, k=128) == tmoe.moe_path(640, 512, bf16, k=256) == "gemv_by_expert"
    assert tmoe.moe_path(160, 512, bf16, k=128) == "gemv" and tmoe.moe_path(640, 512, bf16, k=512) == "gemv"
    assert tmoe.moe_path(640, 512, bf16, k=128, gated=True) == "gemv"
    assert tmoe.moe_path(1025, 512, bf16, k=128) == "grouped_mm"
    assert tmoe.moe_gemv_tiles("gemv_by_expert", 2048, 128, bf16, False, 640) == ((32, 128, 4, 2), 1)
    assert tmoe.moe_gemv_tiles("gemv_by_expert", 2048, 256, bf16, False, 640) == ((32, 128, 4, 2), 1)
    assert tmoe.moe_gemv_tiles("gemv", 2048, 128, bf16, False, 640, rows_per_program=2) == ((16, 128, 4, 2), 2)
    assert tmoe.moe_gemv_config(512, 2048, bf16, gated=True) == (8, 256, 4, 2)  # Qwen3-Next-80B gate_up
    assert tmoe.moe_gemv_config(2048, 512, bf16) == (16, 256, 4, 2)  # its down_proj
    assert tmoe.moe_gemv_config(1856, 2688, torch.float16) == (16, 256, 4, 2)  # Nemotron-3-Nano up
    assert tmoe.moe_gemv_config(2048, 512, fp32) == (32, 128, 4, 2)
    assert tmoe.moe_gemv_config(512, 2048, fp32, gated=True) == (16, 128, 4, 2)
    assert tmoe.moe_gemv_config(2048, 512, bf16, rows=2) == (8, 256, 4, 2)
    assert tmoe.moe_gemv_config(2048, 40, bf16) == (64, 64, 4, 2)  # short K: the same 4096 accumulators
    assert tmoe.moe_gemv_config(2048, 256, bf16) == (32, 128, 4, 2)  # one 256-column step: two of 128 instead
    assert tmoe.moe_gemv_config(2048, 128, bf16) == (32, 128, 4, 2)  # the down_proj of TP 4's slice
    assert tmoe.moe_gemv_config(20, 40, bf16) == (32, 64, 4, 2)  # no wider than 20 columns need
    # one decode token's rows over a narrow slice (a grid of <= 384 programs): 512-column steps, BLOCK_N halved
    assert tmoe.moe_gemv_config(128, 2048, bf16, gated=True, total_rows=10) == (4, 512, 4, 2)  # gate_up, TP 4
    assert tmoe.moe_gemv_config(256, 2048, bf16, gated=True, total_rows=11) == (4, 512, 4, 2)  # TP 2, + shared expert
    assert tmoe.moe_gemv_config(2048, 2048, torch.float16, total_rows=3) == (8, 512, 4, 2)
    assert tmoe.moe_gemv_config(128, 2048, bf16, gated=True, total_rows=160) == (8, 256, 4, 2)  # 16 tokens
    assert tmoe.moe_gemv_config(512, 2048, bf16, gated=True, total_rows=10) == (8, 256, 4, 2)  # TP 1: 640 programs
    assert tmoe.moe_gemv_config(128, 512, bf16, total_rows=10) == (16, 256, 4, 2)  # one 512-column step: no
    assert tmoe.moe_gemv_config(128, 2048, fp32, gated=True, total_rows=10) == (16, 128, 4, 2)  # 2-byte weights only
    assert tmoe.moe_gemv_config(128, 2048, bf16, gated=True, rows=2, total_rows=10) == (4, 256, 4, 2)
    x, w, off = torch.randn(3, 16), torch.randn(2, 8, 16), torch.tensor([0, 1, 3])
    with pytest.raises(ValueError, match="`path` must be one of"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="cutlass")
    with pytest.raises(ValueError, match="a GEMV config is"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="gemv", config=(16, 16, 16, 4, 1))
    with pytest.raises(ValueError, match="a tensor-core config is"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="tensor_cores", config=(16, 16, 4, 1))
    with pytest.raises(ValueError, match="`rows_per_program` is an option of the GEMV"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="tensor_cores", rows_per_program=1)
    with pytest.raises(ValueError, match="rows_per_program must be 1..4"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="gemv", rows_per_program=5)
    with pytest.raises(ValueError, match="BLOCK_K=24"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="gemv", config=(8, 24, 4, 1))
    with pytest.raises(ValueError, match="BLOCK_N=6"):
        tmoe.moe_grouped_linear_triton(x, w, off, path="gemv", config=(6, 16, 4, 1))
    # no rows / no input channels on the GEMV: an empty output / zeros
    assert tmoe.moe_grouped_linear_triton(x[:0], w, torch.tensor([0, 0, 0]), path="gemv").shape == (0, 8)
    zeros = tmoe.moe_grouped_linear_triton(x[:, :0], w[:, :, :0], off, path="gemv", activation="silu_and_mul")
    assert torch.equal(zeros, torch.zeros(3, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scatter_rows_is_the_permutations_scatter(dtype):
    """``scatter_rows`` (a gather through the inverse permutation) writes every row where ``index_copy_``
    would, bit for bit; an empty permutation gives an empty tensor."""
    g = torch.Generator().manual_seed(3)
    y = torch.randn(37, 24, generator=g).to(dtype)
    perm = torch.randperm(37, generator=g)
    want = torch.empty_like(y).index_copy_(0, perm, y)
    assert torch.equal(moe.scatter_rows(y, perm), want)
    assert moe.scatter_rows(y[:0], perm[:0]).shape == (0, 24)


def _sort_oracle(ids, experts):
    """The stable sort by its definition: pairs ordered by (expert, pair index); offsets by counting."""
    flat = ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    offsets = [sum(v < e for v in flat) for e in range(experts + 1)]
    return order, offsets, [p // ids.shape[1] for p in order]


SORT_CASES = [(0, 4, 8), (1, 1, 1), (3, 2, 4), (5, 10, 512), (64, 10, 512), (50, 2, 3), (33, 8, 200),
              (150, 10, 512), (410, 10, 64)]  # the last: 4,100 pairs, above MOE_SORT_MAX_PAIRS (torch's sort)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("tokens,top_k,experts", SORT_CASES)
@pytest.mark.parametrize("impl", ["op", "triton"])
def test_sort_pairs_matches_the_stable_order(impl, tokens, top_k, experts, dtype):
    """``moe_sort_pairs`` (the CPU op, the Triton kernel under the interpreter) against the sort by
    definition: many ties (3 experts over 100 pairs), empty experts (512 experts over 15 pairs),
    pair counts across the kernel's 16-pair blocks and its 1,024-pair steps (1,500 pairs: two steps),
    none, and above the kernel's size."""
    assert tokens * top_k <= tmoe.MOE_SORT_MAX_PAIRS or (tokens, top_k) == (410, 10)
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g).to(dtype)
    want = _sort_oracle(ids, experts)
    if impl == "op":
        runs = [ops.moe_sort_pairs(ids, experts)]
    else:  # the GPU's 16-pair programs and the interpreter's default 64
        runs = [tmoe.moe_sort_pairs_triton(ids, experts, block_i=tmoe.SORT_BLOCK_I),
                tmoe.moe_sort_pairs_triton(ids, experts)]
    for order, offsets, token_of_row in runs:
        assert all(t.dtype == torch.int64 for t in (order, offsets, token_of_row))
        assert (order.tolist(), offsets.tolist(), token_of_row.tolist()) == want


def test_sort_pairs_opcheck_and_compile():
    """opcheck; ``sort_pairs_by_expert`` under torch.compile(fullgraph=True) calls the op (several tokens)
    without a graph break and equals eager."""
    ids = torch.randint(0, 6, (5, 3))
    run_opcheck(ops.moe_sort_pairs.default, (ids, 6))
    eager, compiled, _, _ = compile_and_compare(lambda i: tuple(moe.sort_pairs_by_expert(i, 6)), ids)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    with pytest.raises(ValueError, match="num_experts"):
        ops.moe_sort_pairs(ids, 0)
    with pytest.raises(ValueError, match="top_k_index"):
        ops.moe_sort_pairs(ids.float(), 6)


def test_routing_sort_and_op_argument_errors():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    r = moe.sort_pairs_by_expert(idx, 4)
    assert r.order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: pairs of one expert keep (token, k) order
    assert r.expert_offsets.tolist() == [0, 2, 3, 6, 6] and r.token_of_row.tolist() == [0, 2, 1, 0, 1, 2]
    x, w = torch.randn(3, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="expert_offsets"):
        ops.moe_grouped_linear(x, w, torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="dtype"):
        ops.moe_grouped_linear(x, w.double(), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="input channels"):
        ops.moe_grouped_linear(x, torch.randn(2, 5, 7), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="gather_index"):
        ops.moe_grouped_linear(x, w, torch.tensor([0, 1, 2]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="scatter_index"):
        ops.moe_grouped_linear(x, w, torch.tensor([0, 1, 3]), None, torch.tensor([0, 1]))
    off = torch.tensor([0, 1, 3])
    for call in (ops.moe_grouped_linear, tmoe.moe_grouped_linear_triton):
        with pytest.raises(ValueError, match="`activation` must be one of 'none', 'silu_and_mul', 'relu2', got 'gelu'"):
            call(x, w, off, activation="gelu")
        with pytest.raises(ValueError, match="`activation`='silu_and_mul' needs an even number of weight rows.*5"):
            call(x, w, off, activation="silu_and_mul")  # 5 weight rows: no gate / up halves


@pytest.mark.parametrize("activation", ["none", "silu_and_mul", "relu2"])
def test_op_opcheck(activation):
    x, w = torch.randn(5, 16), torch.randn(3, 12, 16)
    off = torch.tensor([0, 2, 2, 5])
    run_opcheck(ops.moe_grouped_linear.default, (x, w, off, None, None, activation))
    run_opcheck(ops.moe_grouped_linear.default,
                (x, w, off, torch.tensor([4, 0, 0, 1, 3]), torch.tensor([1, 0, 4, 2, 3]), activation))


def _combine_oracle(out, weights):
    """The literal sum over each token's top-k rows in fp64."""
    tokens, top_k = weights.shape
    y = torch.zeros(tokens, out.shape[1], dtype=torch.float64, device=out.device)
    for t in range(tokens):
        for j in range(top_k):
            y[t] += float(weights[t, j]) * out[t * top_k + j].double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 8), (7, 6, 40), (3, 10, 64), (0, 4, 8)])
def test_combine_top_k_matches_the_sum(tokens, top_k, hidden, dtype):
    """``moe_combine_top_k``: the CPU op and the Triton kernel (interpreter; 16-column blocks, so a
    width of 40 has a masked last block) against the literal sum; weights in fp32 and non-contiguous
    (a column slice), rows in ``dtype``; the output in ``dtype``."""
    out = torch.randn(tokens * top_k, hidden).to(dtype)
    weights = torch.rand(tokens, 2 * top_k)[:, ::2]  # (stride 2 along k)
    expected = _combine_oracle(out, weights)
    atol, rtol = TOL[dtype]
    for name, call in (("op", ops.moe_combine_top_k),
                       ("triton", functools.partial(tmoe.moe_combine_top_k_triton, block_h=16))):
        got = call(out, weights)
        assert got.dtype == dtype and got.shape == (tokens, hidden), name
        torch.testing.assert_close(got.double(), expected, atol=atol, rtol=rtol, msg=name)
    with pytest.raises(ValueError, match="tokens \\* top_k"):
        ops.moe_combine_top_k(out[1:] if tokens else torch.randn(1, hidden).to(dtype), weights)
    run_opcheck(ops.moe_combine_top_k.default, (torch.randn(6, 8), torch.rand(2, 3)))


@pytest.mark.parametrize("act_fn,has_gate", [(ACT2FN["silu"], True), (F.silu, True), (ACT2FN["relu2"], False)])
def test_compile_without_graph_breaks(act_fn, has_gate):
    """The experts forward with the fused activation (picked from the module / function inside the graph)."""
    up, down = _weights(3, 16, 8, has_gate, torch.float32)
    idx, rw = _routing(4, 3, 2)

    def fn(h, i, weights):
        return moe.fused_moe_experts(h * 2, i, weights, up, down, act_fn, has_gate) + 1

    eager, compiled, _, _ = compile_and_compare(fn, torch.randn(4, 16), idx, rw)
    torch.testing.assert_close(compiled, eager)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA op at Qwen3.5-35B-A3B's, Qwen3-Next-80B-A3B's and Nemotron-3-Nano-30B's expert shapes
# --------------------------------------------------------------------------------------------

# name: (experts, top_k, hidden, expert width, has_gate): the silu_and_mul and the relu2 experts
SHAPES = {"qwen35_moe": (256, 8, 2048, 512, True), "qwen3_next_80b": (512, 10, 2048, 512, True),
          "nemotron3_nano": (128, 6, 2688, 1856, False)}


def _cuda_case(tokens, shape, dtype=torch.bfloat16):
    """Routing drawn on the CPU; weights and activations drawn on the GPU (up to 5 GiB of fp32)."""
    experts, top_k, hidden, inter, has_gate = SHAPES[shape]
    gen = torch.Generator().manual_seed(tokens)
    idx, w = _routing(tokens, experts, top_k, generator=gen)
    torch.manual_seed(tokens)
    up = torch.randn(experts, (2 if has_gate else 1) * inter, hidden, device="cuda").mul_(hidden ** -0.5).to(dtype)
    down = torch.randn(experts, hidden, inter, device="cuda").mul_(inter ** -0.5).to(dtype)
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    return x, idx.cuda(), w.cuda(), up, down


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, pytest.param(16, marks=pytest.mark.smoke), 64])
def test_cuda_experts_at_real_shapes(tokens, shape, fused):
    """bf16 experts forward on CUDA vs the pair loop in fp64 (the same bf16 weights), the activation
    fused into the first grouped GEMM (transformers' SiLU / relu2 modules) or not (plain functions);
    the fused first projection alone against the plain-torch op on the GPU."""
    has_gate = SHAPES[shape][4]
    act = silu if has_gate else relu2
    x, idx, w, up, down = _cuda_case(tokens, shape)
    seen = []
    out = moe.fused_moe_experts(x, idx, w, up, down, _act_module(has_gate) if fused else act, has_gate,
                                grouped_linear=_spy(ops.moe_grouped_linear, seen))
    activation = ("silu_and_mul" if has_gate else "relu2") if fused else "none"
    assert seen == [activation, "none"]
    expected = _oracle(x, idx.cpu(), w.cpu(), up, down, act, has_gate)  # fp64 on the GPU, pair by pair
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=3e-2)
    r = moe.sort_pairs_by_expert(idx, up.shape[0])
    got = ops.moe_grouped_linear(x, up, r.expert_offsets, r.token_of_row, None, activation)
    ref = moe.reference_moe_grouped_linear(x.float(), up.float(), r.expert_offsets, r.token_of_row, None, activation)
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    h = torch.randn(5, x.shape[1], device="cuda", dtype=torch.bfloat16)
    run_opcheck(ops.moe_grouped_linear.default, (h, up[:3], torch.tensor([0, 2, 2, 5], device="cuda"),
                                                 torch.tensor([4, 0, 0, 1, 3], device="cuda"), None, activation))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["none", "silu_and_mul", "relu2"])
@pytest.mark.parametrize("dtype,tokens", [(torch.float32, 300), (torch.float32, 4096), (torch.float16, 2048)])
def test_cuda_grouped_op_other_dtypes_and_prefill_tiles(dtype, tokens, activation):
    """fp32 (IEEE dot) and fp16, decode tiles (300 tokens) and the 128 / 64-row prefill tiles (4096,
    2048 tokens: the two accumulators of silu_and_mul at the largest tiles), against the plain-torch op."""
    x, idx, w, up, down = _cuda_case(tokens, "qwen35_moe", dtype)
    r = moe.sort_pairs_by_expert(idx, up.shape[0])
    got = ops.moe_grouped_linear(x, up, r.expert_offsets, r.token_of_row, r.order, activation)
    # the plain-torch op on the GPU in fp32 (torch's CUDA matmuls default to exact fp32, no TF32)
    expected = moe.reference_moe_grouped_linear(x.float(), up.float(), r.expert_offsets, r.token_of_row, r.order,
                                                activation)
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype][0] * 10, rtol=TOL[dtype][1] * 10)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["none", "silu_and_mul", "relu2"])
@pytest.mark.parametrize("tokens", [300, 4096])
def test_cuda_grouped_mm_path_at_prefill_sizes(tokens, activation):
    """``path="grouped_mm"`` (torch._grouped_mm, bf16) on the GPU at Qwen3.5-MoE's expert shape against the
    plain-torch op in fp32 (its product rounds to bf16 before the activation: bf16 tolerance)."""
    x, idx, w, up, down = _cuda_case(tokens, "qwen35_moe", torch.bfloat16)
    r = moe.sort_pairs_by_expert(idx, up.shape[0])
    got = tmoe.moe_grouped_linear_triton(x, up, r.expert_offsets, r.token_of_row, r.order, activation,
                                         path="grouped_mm")
    expected = moe.reference_moe_grouped_linear(x.float(), up.float(), r.expert_offsets, r.token_of_row, r.order,
                                                activation)
    torch.testing.assert_close(got.float(), expected, atol=TOL[torch.bfloat16][0] * 10, rtol=TOL[torch.bfloat16][1] * 10)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (4, torch.bfloat16),
                                          (8, torch.bfloat16), (2, torch.float32)])
@pytest.mark.parametrize("shape", ["qwen3_next_80b", "nemotron3_nano"])
def test_cuda_gemv_vs_tensor_cores_at_decode(shape, tokens, dtype):
    """Both projections at decode sizes (the GEMV's, by default): the op's output = the GEMV forced,
    the tensor cores forced, both against the plain-torch op in fp32 on the GPU; random routing and
    every token on expert 3 too (a column tile of one expert streamed by every row's program)."""
    experts, top_k, _, inter, has_gate = SHAPES[shape]
    x, idx, _, up, down = _cuda_case(tokens, shape, dtype)
    assert tmoe.moe_path(tokens * top_k, experts) == "gemv"
    h = torch.randn(tokens * top_k, inter, device="cuda").to(dtype)
    one_expert = idx.clone()
    one_expert[:, 0] = 3
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    for routing in (idx, one_expert):
        r = moe.sort_pairs_by_expert(routing, experts)
        for inp, weight, gather, scatter, activation in (
                (x, up, r.token_of_row, None, "silu_and_mul" if has_gate else "relu2"),
                (h, down, None, r.order, "none")):
            args = (inp, weight, r.expert_offsets, gather, scatter, activation)
            want = moe.reference_moe_grouped_linear(inp.float(), weight.float(), *args[2:])
            got = ops.moe_grouped_linear(*args)
            assert torch.equal(got, tmoe.moe_grouped_linear_triton(*args, path="gemv"))  # the op took the GEMV
            tensor_cores = tmoe.moe_grouped_linear_triton(*args, path="tensor_cores")
            for out, path in ((got, "gemv"), (tensor_cores, "tensor_cores")):
                torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol, msg=f"{path} {activation}")


@pytest.mark.gpu
@pytest.mark.parametrize("path", [pytest.param(None, marks=pytest.mark.smoke), "tensor_cores"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cuda_experts_in_a_cuda_graph(shape, path):
    """The fused-activation experts forward captured once, replayed after the routing changed: 4
    tokens, the op's default path (the GEMV with programmatic dependent launches on Hopper) and the
    tensor cores forced."""
    experts, top_k, _, _, has_gate = SHAPES[shape]
    x, idx, w, up, down = _cuda_case(4, shape)
    act_fn = _act_module(has_gate)
    assert tmoe.moe_path(4 * top_k, experts) == "gemv"
    linear = None if path is None else functools.partial(tmoe.moe_grouped_linear_triton, path=path)

    def step():
        return moe.fused_moe_experts(x, idx, w, up, down, act_fn, has_gate, grouped_linear=linear)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    idx2, w2 = _routing(4, experts, top_k, generator=torch.Generator().manual_seed(1))
    idx2[:, 0] = 3  # routing changes between replays (one expert gets every token)
    for dst, src in ((x, torch.randn_like(x)), (idx, idx2), (w, w2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)
    expected = _oracle(x, idx.cpu(), w.cpu(), up, down, silu if has_gate else relu2, has_gate)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=pytest.mark.smoke), torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("shape", ["qwen3_next_80b", "nemotron3_nano"])
def test_cuda_combine_top_k(shape, tokens, dtype):
    """``moe_combine_top_k`` on CUDA at the real top-k and hidden widths (2,688: a masked last column
    block) against the literal sum on the GPU in fp64 and the plain-torch op; fp32 weights as the
    routers give them; also inside a CUDA graph replayed on new inputs; opcheck."""
    _, top_k, hidden, _, _ = SHAPES[shape]
    out = torch.randn(tokens * top_k, hidden, device="cuda").to(dtype)
    weights = torch.rand(tokens, top_k, device="cuda")
    got = ops.moe_combine_top_k(out, weights)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    want = (out.double().view(tokens, top_k, hidden) * weights.double()[..., None]).sum(1)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(got, moe.reference_moe_combine_top_k(out, weights), atol=tol, rtol=tol)
    ops.moe_combine_top_k(out, weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.moe_combine_top_k(out, weights)
    out.copy_(torch.randn_like(out))
    weights.copy_(torch.rand_like(weights))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ops.moe_combine_top_k(out, weights))
    run_opcheck(ops.moe_combine_top_k.default, (out[: 2 * top_k], weights[:2]))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,experts", [(2, 10, 512), pytest.param(64, 10, 512, marks=pytest.mark.smoke),
                                                  (16, 8, 256), (400, 10, 512), (1000, 6, 128)])
def test_cuda_sort_pairs(tokens, top_k, experts):
    """``moe_sort_pairs`` on CUDA at decode / extend sizes of the real routings (the last above the
    kernel's size: torch's sort) against the plain-torch op, also inside a CUDA graph replayed on new ids."""
    ids = torch.randint(0, experts, (tokens, top_k), device="cuda")
    want = moe.reference_moe_sort_pairs(ids, experts)
    assert all(torch.equal(a, b) for a, b in zip(ops.moe_sort_pairs(ids, experts), want))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.moe_sort_pairs(ids, experts)
    ids.copy_(torch.randint(0, experts, (tokens, top_k), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, moe.reference_moe_sort_pairs(ids, experts)))
