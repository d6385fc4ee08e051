"""Triton causal conv1d kernels (hybrid_compile/ops/triton/conv1d.py) against the plain-torch ops
and the per-token reference.

On CPU the launchers run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1);
the ``gpu`` tests run the registered CUDA ops at model shapes, under opcheck and in a CUDA graph.
"""

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import conv1d as torch_conv1d
from hybrid_compile.ops.reference.conv1d import (
    causal_conv1d_fn_ref,
    causal_conv1d_update_ref,
    track_conv_window_ref,
)
from hybrid_compile.ops.triton import conv1d as tconv
from op_testing import VARLEN_CASES, assert_close, cu_seqlens_of, distinct_slots, run_opcheck

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile
NUM_SLOTS = 16
TINY = dict(block_t=32, block_d=16, block_b=2)  # blocks that split requests, channels and the request scan
# (x dtype, pool dtype, launch blocks): the default launch config, and tiny blocks
CONFIGS = [
    (torch.float32, torch.float32, {}),
    (torch.bfloat16, torch.bfloat16, TINY),
    (torch.float32, torch.bfloat16, TINY),
]
CONFIG_IDS = ["f32", "bf16-tiny", "f32-bf16pool-tiny"]


def _x(rows, dim, dtype):
    """Non-contiguous [rows, dim] view (a column slice of a wider projection)."""
    return torch.randn(rows, dim + 5).to(dtype)[:, 2 : 2 + dim]


def _params(dim, width, dtype=torch.float32, bias=True):
    weight = (torch.randn(dim, width) * 0.5).to(dtype)
    return weight, ((torch.randn(dim) * 0.1).to(dtype) if bias else None)


def _batch(lens, dim, width, dtype, pool_dtype, pad_rows=(), idx_dtype=torch.int32):
    x = _x(sum(lens), dim, dtype)
    states = torch.randn(NUM_SLOTS, width - 1, dim).to(pool_dtype)
    qsl = cu_seqlens_of(lens, dtype=idx_dtype)
    idx = distinct_slots(len(lens), NUM_SLOTS, pad_rows=pad_rows).to(idx_dtype)
    has_init = torch.tensor([b % 2 == 0 for b in range(len(lens))], dtype=torch.bool)
    return x, states, qsl, idx, has_init


def _written_mask(num_slots, slots):
    mask = torch.zeros(num_slots, dtype=torch.bool)
    for s in slots:
        if s >= 0:
            mask[s] = True
    return mask


# --------------------------------------------------------------------------------------------
# causal_conv1d_fn
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,pool_dtype,blocks", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("lens", VARLEN_CASES, ids=str)
def test_fn_matches_op_and_reference(lens, width, dtype, pool_dtype, blocks):
    dim = 24
    weight, bias = _params(dim, width, dtype)
    pad = (1,) if len(lens) >= 3 else ()
    x, states, qsl, idx, has_init = _batch(lens, dim, width, dtype, pool_dtype, pad_rows=pad)
    want_out, want_states = causal_conv1d_fn_ref(x, weight, bias, states, qsl, idx, has_init, "silu")
    op_states = states.clone()
    op_out = torch_conv1d.causal_conv1d_fn(x, weight, bias, op_states, qsl, idx, has_init, "silu")

    got_states = states.clone()
    out = tconv._causal_conv1d_fn(x, weight, bias, got_states, qsl, idx, has_init, "silu", **blocks)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert_close(out, want_out, dtype)
    assert_close(out, op_out, dtype)
    # windows hold raw inputs (cast to the pool dtype): exact, and untouched slots bit-identical
    assert torch.equal(got_states, want_states) and torch.equal(got_states, op_states)
    written = _written_mask(NUM_SLOTS, [int(s) for s, n in zip(idx, lens) if n > 0])
    assert torch.equal(got_states[~written], states[~written])
    for b in range(len(lens)):
        if idx[b] < 0:
            assert torch.count_nonzero(out[qsl[b] : qsl[b + 1]]) == 0


@pytest.mark.parametrize("lens", [[1, 3, 6, 0, 7, 12], [2]], ids=str)
def test_fn_wide_kernel_short_requests(lens):
    """W = 8: requests shorter than the window keep its newest part, shifted."""
    dim, width = 16, 8
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch(lens, dim, width, torch.float32, torch.float32)
    want_out, want_states = causal_conv1d_fn_ref(x, weight, None, states, qsl, idx, has_init, None)
    out = tconv._causal_conv1d_fn(x, weight, None, states, qsl, idx, has_init, None, block_t=16, block_d=8)
    assert_close(out, want_out)
    assert torch.equal(states, want_states)


def test_fn_zero_length_and_nan_padding():
    """Zero-length requests leave their slot alone; a padded request reads nothing (NaN pools stay out)."""
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    states = torch.full((4, width - 1, dim), float("nan"))
    states[1] = torch.randn(width - 1, dim)  # the only slot a non-empty request reads
    before = states.clone()
    x = torch.randn(5, dim)
    qsl = cu_seqlens_of([0, 3, 2, 0], dtype=torch.int64)
    idx = torch.tensor([0, 1, -1, 2], dtype=torch.int64)
    has_init = torch.tensor([True, True, True, True])
    out = tconv.causal_conv1d_fn_triton(x, weight, bias, states, qsl, idx, has_init, "silu")
    assert torch.isfinite(out).all() and torch.count_nonzero(out[3:]) == 0
    bits = states.view(torch.int32)
    for s in (0, 2, 3):  # zero-length requests' slots and the unused one: bit-identical (still NaN)
        assert torch.equal(bits[s], before.view(torch.int32)[s])
    want_out, want_states = causal_conv1d_fn_ref(x, weight, bias, before, qsl, idx, has_init, "silu")
    assert_close(out, want_out)
    assert torch.equal(states[1], want_states[1]) and torch.equal(states[1, 2], x[2])


def test_fn_many_requests_scan_chunks():
    """More requests than one scan chunk (block_b) and blocks > requests (grid bound T // BT + B)."""
    lens = [3, 0, 17, 1, 16, 33, 0, 2, 5, 1, 1]
    dim, width = 8, 3
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch(lens, dim, width, torch.float32, torch.float32, pad_rows=(4,))
    want_out, want_states = causal_conv1d_fn_ref(x, weight, bias, states, qsl, idx, has_init, "silu")
    out = tconv._causal_conv1d_fn(x, weight, bias, states, qsl, idx, has_init, "silu", block_t=16, block_b=4)
    assert_close(out, want_out)
    assert torch.equal(states, want_states)


# --------------------------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,pool_dtype,blocks", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("mode", ["plain", "intermediate", "verify"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("width", [2, 4])
def test_update_matches_op_and_reference(width, steps, mode, dtype, pool_dtype, blocks):
    batch, dim = 4, 24
    weight, bias = _params(dim, width, dtype)
    x = _x(batch * steps, dim, dtype).reshape(batch, steps, dim)
    states = torch.randn(NUM_SLOTS, width - 1, dim).to(pool_dtype)
    idx = distinct_slots(batch, NUM_SLOTS, pad_rows=(2,))
    inter = torch.randn(batch + 2, steps, width - 1, dim).to(pool_dtype) if mode != "plain" else None
    disable = mode == "verify"
    want_out, want_states, want_inter = causal_conv1d_update_ref(x, states, weight, bias, "silu", idx, disable, inter)
    op_states, op_inter = states.clone(), None if inter is None else inter.clone()
    op_out = torch_conv1d.causal_conv1d_update(x, op_states, weight, bias, "silu", idx, disable, op_inter)

    got_states, got_inter = states.clone(), None if inter is None else inter.clone()
    block_d = blocks.get("block_d")
    out = tconv._causal_conv1d_update(x, got_states, weight, bias, "silu", idx, disable, got_inter, block_d=block_d)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, want_out, dtype)
    assert_close(out, op_out, dtype)
    assert torch.count_nonzero(out[2]) == 0
    assert torch.equal(got_states, want_states) and torch.equal(got_states, op_states)
    if disable:
        assert torch.equal(got_states, states)
    else:
        written = _written_mask(NUM_SLOTS, idx.tolist())
        assert torch.equal(got_states[~written], states[~written])
    if inter is not None:
        assert torch.equal(got_inter, want_inter) and torch.equal(got_inter, op_inter)
        assert torch.equal(got_inter[2], inter[2]) and torch.equal(got_inter[batch:], inter[batch:])


def test_update_mixed_dtypes_no_bias_identity():
    dim, width, steps = 8, 4, 2
    weight, _ = _params(dim, width, torch.float16)
    x = torch.randn(3, steps, dim).to(torch.float16)
    states = torch.randn(NUM_SLOTS, width - 1, dim).to(torch.bfloat16)
    inter = torch.zeros(3, steps, width - 1, dim, dtype=torch.float32)
    idx = torch.tensor([4, -1, 0], dtype=torch.int64)
    want_out, want_states, want_inter = causal_conv1d_update_ref(x, states, weight, None, None, idx, False, inter)
    out = tconv.causal_conv1d_update_triton(x, states, weight, None, None, idx, False, inter)
    assert out.dtype == torch.float16
    assert_close(out, want_out, torch.float16)
    assert torch.equal(states, want_states) and torch.equal(inter, want_inter)


def test_fn_then_update_chain():
    """Prefill with the kernel, then decode steps with the kernel == one prefill over everything."""
    dim, width, prompt, decode = 16, 4, [6, 1, 2], 3
    weight, bias = _params(dim, width)
    full = [n + decode for n in prompt]
    x, states, qsl_full, idx, has_init = _batch(full, dim, width, torch.float32, torch.float32)
    want_out, want_states = causal_conv1d_fn_ref(x, weight, bias, states, qsl_full, idx, has_init, "silu")
    xp = torch.cat([x[qsl_full[b] : qsl_full[b] + prompt[b]] for b in range(3)])
    tconv.causal_conv1d_fn_triton(xp, weight, bias, states, cu_seqlens_of(prompt), idx, has_init, "silu")
    for t in range(decode):
        xt = torch.stack([x[qsl_full[b] + prompt[b] + t] for b in range(3)])[:, None]
        ot = tconv.causal_conv1d_update_triton(xt, states, weight, bias, "silu", idx)
        for b in range(3):
            assert_close(ot[b, 0], want_out[qsl_full[b] + prompt[b] + t])
    assert torch.equal(states, want_states)


# --------------------------------------------------------------------------------------------
# track_conv_window
# --------------------------------------------------------------------------------------------


def _track_case(width, dim, pool_dtype=torch.float32, idx_dtype=torch.int32):
    lens = [5, 0, 7, 1, 3, 9, 4]
    track = [2, 0, 7, -1, 0, 3, 4]  # < W-1, empty request, full length, none, zero, mid, padded row
    x, states, qsl, idx, has_init = _batch(lens, dim, width, torch.float32, pool_dtype, pad_rows=(6,),
                                           idx_dtype=idx_dtype)
    free = [s for s in range(NUM_SLOTS) if s not in idx.tolist()]
    dst = torch.tensor([free[0], free[1], free[2], free[3], free[4], -1, free[5]], dtype=idx_dtype)
    return x, states, qsl, idx, has_init, torch.tensor(track, dtype=idx_dtype), dst


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_track_matches_op_and_reference(width, pool_dtype):
    dim = 24
    x, states, qsl, idx, has_init, tl, dst = _track_case(width, dim, pool_dtype)
    want = track_conv_window_ref(states, x, qsl, idx, has_init, tl, dst)
    op_states = states.clone()
    torch_conv1d.track_conv_window(op_states, x, qsl, idx, has_init, tl, dst)
    got = states.clone()
    tconv._track_conv_window(got, x, qsl, idx, has_init, tl, dst, block_d=8)
    assert torch.equal(got, want) and torch.equal(got, op_states)
    tracked = [int(dst[b]) for b in range(len(tl)) if tl[b] >= 0 and dst[b] >= 0 and idx[b] >= 0]
    written = _written_mask(NUM_SLOTS, tracked)
    assert written.sum() == 4 and torch.equal(got[~written], states[~written])


def test_track_destination_is_another_rows_source():
    """All windows are gathered before any write (as the op documents)."""
    dim, width = 8, 4
    x = torch.randn(6, dim)
    states = torch.randn(4, width - 1, dim)
    qsl = cu_seqlens_of([3, 3])
    idx = torch.tensor([0, 1])
    has_init = torch.tensor([True, True])
    tl = torch.tensor([1, 2])
    dst = torch.tensor([1, 0])  # row 0 writes row 1's source and vice versa
    want = track_conv_window_ref(states, x, qsl, idx, has_init, tl, dst)
    tconv.track_conv_window_triton(states, x, qsl, idx, has_init, tl, dst)
    assert torch.equal(states, want)


# --------------------------------------------------------------------------------------------
# the registered CUDA impls validate before launching (checked here on CPU tensors)
# --------------------------------------------------------------------------------------------


def test_cuda_impls_validate_arguments():
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch([3, 2], dim, width, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"causal_conv1d_fn: `x` has shape"):
        tconv._causal_conv1d_fn_cuda(torch.randn(5, 9), weight, bias, states, qsl, idx, has_init, "silu")
    with pytest.raises(ValueError, match=r"unsupported `activation`"):
        tconv._causal_conv1d_fn_cuda(x, weight, bias, states, qsl, idx, has_init, "relu")
    with pytest.raises(IndexError, match=r"`conv_state_indices` has values"):
        tconv._causal_conv1d_update_cuda(
            torch.randn(2, 1, dim), states, weight, bias, "silu", torch.tensor([0, 99])
        )
    with pytest.raises(ValueError, match=r"`dst_slots` has repeated"):
        tconv._track_conv_window_cuda(
            states, x, qsl, idx, has_init, torch.tensor([1, 1]), torch.tensor([5, 5])
        )
    out = tconv._causal_conv1d_fn_cuda(x, weight, bias, states.clone(), qsl, idx, has_init, "silu")
    assert out.shape == x.shape


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at model shapes (skipped without CUDA)
# --------------------------------------------------------------------------------------------

CONV_DIM = 8192  # Qwen3-Next conv_dim (2 * 16 * 128 + 32 * 128)


def _cuda_kernel_registered(name):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_compile::{name}", "CUDA")


def _cpu(*ts):
    return [t.cpu() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [[20000], pytest.param([700, 1, 0, 3, 64, 129, 2, 2048] + [5] * 40, marks=pytest.mark.smoke)],
                         ids=["long", "many"])
def test_gpu_fn_model_shapes(lens, pool_dtype):
    assert _cuda_kernel_registered("causal_conv1d_fn")
    dev, width, dim = "cuda", 4, CONV_DIM
    batch = len(lens)
    proj = torch.randn(sum(lens), dim + 256, device=dev, dtype=torch.bfloat16)
    x = proj[:, 128 : 128 + dim]  # a strided view, as split from the input projection
    weight = (torch.randn(dim, width, device=dev) * 0.5).to(torch.bfloat16)
    bias = None
    states = torch.randn(batch + 8, width - 1, dim, device=dev).to(pool_dtype)
    qsl = cu_seqlens_of(lens, device=dev)
    idx = torch.randperm(batch + 8, device=dev)[:batch].to(torch.int32)
    if batch > 3:
        idx[3] = -1
    has_init = torch.rand(batch, device=dev) > 0.5
    cx, cw, cs, cq, ci, ch = _cpu(x, weight, states, qsl, idx, has_init)
    want = ops.causal_conv1d_fn(cx, cw, bias, cs, cq, ci, ch, "silu")
    out = ops.causal_conv1d_fn(x, weight, bias, states, qsl, idx, has_init, "silu")
    torch.cuda.synchronize()
    assert_close(out.cpu(), want, torch.bfloat16)
    assert torch.equal(states.cpu(), cs)


@pytest.mark.gpu
@pytest.mark.parametrize("steps,mode", [(1, "plain"), (4, "verify"), (3, "intermediate")])
def test_gpu_update_model_shapes(steps, mode):
    assert _cuda_kernel_registered("causal_conv1d_update")
    dev, width, dim, batch = "cuda", 4, CONV_DIM, 64
    x = torch.randn(batch * steps, dim + 64, device=dev, dtype=torch.bfloat16)[:, :dim].reshape(batch, steps, dim)
    weight = (torch.randn(dim, width, device=dev) * 0.5).to(torch.bfloat16)
    bias = torch.randn(dim, device=dev, dtype=torch.bfloat16) * 0.1
    states = torch.randn(256, width - 1, dim, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(256, device=dev)[:batch]
    idx[::7] = -1
    inter = None if mode == "plain" else torch.zeros(batch + 4, steps, width - 1, dim, device=dev, dtype=torch.bfloat16)
    disable = mode == "verify"
    cx, cs, cw, cb, ci, cint = _cpu(x, states, weight, bias, idx, inter)
    want = ops.causal_conv1d_update(cx, cs, cw, cb, "silu", ci, disable, cint)
    out = ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, disable, inter)
    torch.cuda.synchronize()
    assert_close(out.cpu(), want, torch.bfloat16)
    assert torch.equal(states.cpu(), cs)
    if inter is not None:
        assert torch.equal(inter.cpu(), cint)


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_track_model_shapes():
    dev, width, dim = "cuda", 4, CONV_DIM
    lens = [300, 2, 0, 64, 1000]
    x = torch.randn(sum(lens), dim, device=dev, dtype=torch.bfloat16)
    states = torch.randn(32, width - 1, dim, device=dev, dtype=torch.bfloat16)
    qsl = cu_seqlens_of(lens, device=dev)
    idx = torch.tensor([0, 1, 2, -1, 4], device=dev, dtype=torch.int32)
    has_init = torch.tensor([True, True, False, True, False], device=dev)
    tl = torch.tensor([256, 1, 0, 64, 1000], device=dev, dtype=torch.int32)
    dst = torch.tensor([10, 11, 12, 13, -1], device=dev, dtype=torch.int32)
    cs, cx, cq, ci, ch, ct, cd = _cpu(states, x, qsl, idx, has_init, tl, dst)
    ops.track_conv_window(cs, cx, cq, ci, ch, ct, cd)
    ops.track_conv_window(states, x, qsl, idx, has_init, tl, dst)
    assert torch.equal(states.cpu(), cs)


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_opcheck():
    dev, width, dim = "cuda", 4, 256
    weight = torch.randn(dim, width, device=dev)
    bias = torch.randn(dim, device=dev)
    lens = [0, 37, 1, 5]
    x = torch.randn(sum(lens), dim, device=dev)
    states = torch.randn(NUM_SLOTS, width - 1, dim, device=dev)
    qsl = cu_seqlens_of(lens, device=dev)
    idx = torch.tensor([3, 5, -1, 7], device=dev, dtype=torch.int32)
    has_init = torch.tensor([True, False, True, True], device=dev)
    run_opcheck(ops.causal_conv1d_fn, (x, weight, bias, states, qsl, idx, has_init, "silu"))
    xd = torch.randn(4, 3, dim, device=dev)
    inter = torch.zeros(5, 3, width - 1, dim, device=dev)
    run_opcheck(ops.causal_conv1d_update, (xd, states, weight, bias, "silu", idx, False, inter))
    run_opcheck(ops.causal_conv1d_update, (xd[:, :1], states, weight, None, None, idx, True, None))
    tl = torch.tensor([0, 10, -1, 2], device=dev, dtype=torch.int32)
    dst = torch.tensor([1, 2, 4, -1], device=dev, dtype=torch.int32)
    run_opcheck(ops.track_conv_window, (states, x, qsl, idx, has_init, tl, dst))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_update_cuda_graph_replay():
    """Decode conv update captured once, replayed with new inputs and slots (-1 padding rows)."""
    dev, width, dim, batch, num_slots = "cuda", 4, CONV_DIM, 16, 64
    weight = (torch.randn(dim, width, device=dev) * 0.5).to(torch.bfloat16)
    bias = torch.randn(dim, device=dev, dtype=torch.bfloat16) * 0.1
    states = torch.randn(num_slots, width - 1, dim, device=dev, dtype=torch.bfloat16)
    x_buf = torch.randn(batch, 1, dim, device=dev, dtype=torch.bfloat16)
    idx_buf = torch.arange(batch, device=dev, dtype=torch.int32)
    ops.causal_conv1d_update(x_buf, states, weight, bias, "silu", idx_buf, False, None)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = ops.causal_conv1d_update(x_buf, states, weight, bias, "silu", idx_buf, False, None)
    for _ in range(3):
        x_new = torch.randn(batch, 1, dim, device=dev, dtype=torch.bfloat16)
        idx_new = torch.randperm(num_slots, device=dev)[:batch].to(torch.int32)
        idx_new[[1, 5]] = -1
        x_buf.copy_(x_new)
        idx_buf.copy_(idx_new)
        cs = states.cpu()
        want = ops.causal_conv1d_update(x_new.cpu(), cs, weight.cpu(), bias.cpu(), "silu", idx_new.cpu(), False, None)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out_buf.cpu(), want, torch.bfloat16)
        assert torch.count_nonzero(out_buf[1]) == 0 and torch.count_nonzero(out_buf[5]) == 0
        assert torch.equal(states.cpu(), cs)
