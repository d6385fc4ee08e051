"""Triton Mamba2 kernels (:mod:`hybrid_compile.ops.triton.mamba2`) against the plain-torch ops and the
per-token reference.

CPU: the launchers run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes
(P = N = 16, chunk 16 so requests span several chunks, one chunk-64 case); on a CUDA machine the
same tests run the compiled kernels on the GPU against the CPU op. GPU (``gpu`` marker):
the registered CUDA ops at Mamba2 shapes against the plain-torch op on CPU copies, opcheck on CUDA,
and the decode op captured in a CUDA graph.
"""

from __future__ import annotations

import math

import pytest
import torch

import hybrid_compile.ops.triton.mamba2 as tm
from hybrid_compile.ops import _varlen
from hybrid_compile.ops.mamba2 import selective_state_update, ssd_chunk_scan
from hybrid_compile.ops.reference.mamba2 import selective_state_update_reference, ssd_scan_reference
from op_testing import TOLERANCE, assert_close, run_opcheck
from test_ops_mamba2 import DECODE_ORDER, PREFILL_ORDER, check_pool, make_decode, make_prefill

INF = float("inf")
# Where the launchers run in the CPU-shaped tests: CPU tensors under the interpreter, else the GPU
# (so on a CUDA machine these edge cases run the compiled kernels too).
KDEV = "cpu" if tm._INTERPRET else "cuda"


def _clone(inp):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def _to(inp, device):
    """Tensors moved to ``device`` keeping their strides (views of one projection stay strided)."""

    def move(v):
        if not isinstance(v, torch.Tensor) or v.device.type == torch.device(device).type:
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device).copy_(v)

    return {k: move(v) for k, v in inp.items()}


def _tol_dtype(t):
    return torch.float32 if t.dtype == torch.float32 else torch.bfloat16


# --------------------------------------------------------------------------------------------
# ssd_chunk_scan (CPU, interpreter)
# --------------------------------------------------------------------------------------------


def _check_pool(actual, expected, before, written, tol_dtype, msg):
    """Written slots close to ``expected``, every other slot bit-identical to ``before``."""
    for s in range(actual.shape[0]):
        if s in written:
            assert_close(actual[s], expected[s], tol_dtype, msg=f"{msg} slot {s}")
        else:
            assert torch.equal(actual[s], before[s]), f"{msg}: untouched slot {s} changed"


def check_prefill(inp, chunk_size, dtype, output_chunk_states=True, state_tol=None):
    """Triton launcher vs the plain-torch op and the per-token reference: outputs, pool, chunk states.

    ``state_tol``: tolerance dtype of pool and chunk states (default: by the pool dtype / fp32).
    """
    lens = (inp["cu_seqlens"][1:] - inp["cu_seqlens"][:-1]).tolist()
    slots = inp["state_indices"].tolist()
    before = inp["ssm_states"].clone()
    y_ref, states_ref, history = ssd_scan_reference(*(inp[k] for k in PREFILL_ORDER))
    plain = _clone(inp)
    y_op, cs_op = ssd_chunk_scan(*(plain[k] for k in PREFILL_ORDER), chunk_size, output_chunk_states, ssm_scales=None)
    tri = _to(inp, KDEV)
    y, cs = tm.ssd_chunk_scan_triton(*(tri[k] for k in PREFILL_ORDER), chunk_size, output_chunk_states)
    y, cs, tri = y.cpu(), cs.cpu(), _to(tri, "cpu")

    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert cs.dtype == torch.float32 and cs.shape == cs_op.shape
    assert_close(y, y_ref, dtype, msg="y vs reference")
    assert_close(y, y_op, dtype, msg="y vs plain op")
    cu = inp["cu_seqlens"].tolist()
    for b, s in enumerate(slots):
        if s < 0:
            assert torch.all(y[cu[b] : cu[b + 1]] == 0), "padding request has non-zero output"
    written = [s for s, n in zip(slots, lens) if n > 0 and s >= 0]
    # with 16-bit inputs the kernel's matmuls use TF32 operands on the GPU (~1e-3 relative), so
    # the state is held to the input dtype's tolerance there, not the fp32 pool's
    pool_tol = state_tol or (_tol_dtype(before) if dtype == torch.float32 else dtype)
    _check_pool(tri["ssm_states"], states_ref, before, written, pool_tol, "pool vs reference")
    _check_pool(tri["ssm_states"], plain["ssm_states"], before, written, pool_tol, "pool vs plain op")
    if output_chunk_states:
        cs_tol = state_tol or (torch.float32 if dtype == torch.float32 else dtype)
        assert_close(cs, cs_op, cs_tol, msg="chunk states vs plain op")
        offsets = _varlen.chunk_row_offsets(inp["cu_seqlens"], chunk_size).tolist()
        used = torch.zeros(cs.shape[0], dtype=torch.bool)
        for b, n in enumerate(lens):
            if slots[b] < 0:
                continue
            for j in range(math.ceil(n / chunk_size)):
                assert_close(cs[offsets[b] + j], history[b][j * chunk_size], cs_tol, msg=f"chunk state b={b} j={j}")
                used[offsets[b] + j] = True
        assert torch.all(cs[~used] == 0), "unused chunk-state rows must be zero"
    else:
        assert cs.shape[0] == 0


LENS = [0, 1, 15, 16, 17, 40]
PREFILL_CASES = [
    # lens, chunk, dict(make_prefill options)
    (LENS, 16, dict(pad_rows=(2,))),
    (LENS, 16, dict(dtype=torch.bfloat16, pool_dtype=torch.bfloat16, pad_rows=(4,))),
    (LENS, 16, dict(H=2, G=1, pool_dtype=torch.bfloat16, with_D=False, with_z=False, with_bias=False,
                    softplus=False, dt_min=0.05, dt_max=0.9, init=[True] * 6)),
    ([17, 0, 33], 16, dict(dtype=torch.float16, pool_dtype=torch.float16, G=4, dt_min=0.1, dt_max=0.6,
                           init=[True, True, False])),
    ([70, 3, 0, 64], 64, dict(H=2, G=1, dtype=torch.bfloat16, init=[True, False, True, False])),
    ([5, 3], 16, dict(pad_rows=(0, 1))),  # every request is padding
]


@pytest.mark.parametrize("lens,chunk_size,opts", PREFILL_CASES)
def test_ssd_chunk_scan_triton(lens, chunk_size, opts):
    inp = make_prefill(lens, P=16, N=16, **opts)
    check_prefill(inp, chunk_size, opts.get("dtype", torch.float32))


def test_ssd_chunk_scan_triton_no_chunk_states_and_mixed_dtypes():
    """output_chunk_states=False; x bf16 with fp32 B/C takes the fp32-operand matmul path."""
    inp = make_prefill([16, 1, 23], H=2, G=2, P=16, N=16, dtype=torch.bfloat16, pad_rows=(1,))
    inp["B"] = inp["B"].float()
    inp["C"] = inp["C"].float()
    assert tm._dot_mode(inp["x"], inp["B"], inp["C"]) == tm._DOT_IEEE
    check_prefill(inp, 16, torch.bfloat16, output_chunk_states=False)


def test_ssd_chunk_scan_triton_activation_dot_operands(monkeypatch):
    """The mamba_ssm-style path: matmul operands cast to the activation dtype (bf16)."""
    monkeypatch.setattr(tm, "SSD_DOT_OPERANDS", "activation")
    inp = make_prefill([40, 1, 17], P=16, N=16, dtype=torch.bfloat16, pad_rows=(1,))
    assert tm._dot_mode(inp["x"], inp["B"], inp["C"]) in (tm._DOT_LOWP, tm._DOT_EMULATE)
    check_prefill(inp, 16, torch.bfloat16, state_tol=torch.bfloat16)  # states from bf16-rounded operands


def test_ssd_chunk_scan_triton_empty_batch():
    inp = _to(make_prefill([0, 0], P=16, N=16), KDEV)
    before = inp["ssm_states"].clone()
    y, cs = tm.ssd_chunk_scan_triton(*(inp[k] for k in PREFILL_ORDER), 16, True)
    assert y.shape == (0, 4, 16) and cs.shape == (2, 4, 16, 16) and torch.all(cs == 0)
    assert torch.equal(inp["ssm_states"], before)


# --------------------------------------------------------------------------------------------
# selective_state_update (CPU, interpreter)
# --------------------------------------------------------------------------------------------


def check_decode(inp, dtype):
    batch = inp["x"].shape[0]
    slots = inp["state_indices"].tolist()
    before = inp["ssm_states"].clone()
    inter_before = None if inp["intermediate_states"] is None else inp["intermediate_states"].clone()
    y_ref, states_ref, inter_ref = selective_state_update_reference(*(inp[k] for k in DECODE_ORDER))
    plain = _clone(inp)
    y_op = selective_state_update(*(plain[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    tri = _to(inp, KDEV)
    y = tm.selective_state_update_triton(*(tri[k] for k in DECODE_ORDER))
    y, tri = y.cpu(), _to(tri, "cpu")

    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert_close(y, y_ref, dtype, msg="y vs reference")
    assert_close(y, y_op, dtype, msg="y vs plain op")
    for b, s in enumerate(slots):
        if s < 0:
            assert torch.all(y[b] == 0), "padding row has non-zero output"
    written = [] if inp["disable_state_update"] else slots
    check_pool(tri["ssm_states"], states_ref, before, written, "pool vs reference")
    check_pool(tri["ssm_states"], plain["ssm_states"], before, written, "pool vs plain op")
    if inter_ref is not None:
        inter = tri["intermediate_states"]
        for b in range(inter.shape[0]):
            if b < batch and slots[b] >= 0:
                assert_close(inter[b], inter_ref[b], _tol_dtype(inter), msg=f"intermediate row {b}")
            else:
                assert torch.equal(inter[b], inter_before[b]), f"intermediate row {b} must stay untouched"


DECODE_CASES = [
    (4, 1, dict(pad_rows=(1,), inter=False)),
    (3, 1, dict(with_D=False, with_z=False, with_bias=False, inter=False, H=2, G=1)),
    (3, 4, dict(pad_rows=(0,))),
    (2, 3, dict(disable=True, dt_min=0.1, dt_max=0.7, G=1)),
    (3, 2, dict(pool_dtype=torch.bfloat16, inter_dtype=torch.bfloat16, pad_rows=(2,), G=4)),
    (2, 2, dict(pad_rows=(0, 1))),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,steps,opts", DECODE_CASES)
def test_selective_state_update_triton(dtype, batch, steps, opts):
    inp = make_decode(batch, steps, P=16, N=16, dtype=dtype, **opts)
    check_decode(inp, dtype)


def test_selective_state_update_triton_strided_inputs_and_odd_dims():
    """x / z / B / C as views of one projection, P and N not powers of two, softplus off."""
    batch, steps, H, G, P, N = 3, 2, 4, 2, 12, 10
    proj = torch.randn(batch, steps, 2 * H * P + 2 * G * N + 5)
    x = proj[..., : H * P].view(batch, steps, H, P)
    B = (0.5 * proj[..., H * P : H * P + G * N]).reshape(batch, steps, G, N)
    C = proj[..., H * P + G * N : H * P + 2 * G * N].view(batch, steps, G, N)
    z = proj[..., H * P + 2 * G * N : 2 * H * P + 2 * G * N].view(batch, steps, H, P)
    inp = make_decode(batch, steps, H=H, G=G, P=P, N=N, pad_rows=(1,))
    inp.update(x=x, B=B, C=C, z=z, dt_softplus=False, dt=inp["dt"].abs() * 0.3)
    assert not x.is_contiguous() and not C.is_contiguous()
    check_decode(inp, torch.float32)


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_dtype", [torch.float32, torch.bfloat16])
def test_selective_state_update_takes_A_log(a_dtype):
    """A_is_log: the plain op and the kernel take ``A = -exp(A_log)`` themselves (the decode step of
    the Mamba2 layer op launches nothing for it); same result as passing that ``A``."""
    inp = make_decode(3, 2, P=16, N=16, dtype=torch.bfloat16, pad_rows=(1,))
    a_log = torch.log(-inp["A"]).to(a_dtype)
    given_a = _clone(inp)
    given_a["A"] = -torch.exp(a_log.float())
    y_ref = selective_state_update(*(given_a[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    plain = _clone(inp)
    plain["A"] = a_log
    tri = _to(_clone(plain), KDEV)
    y_op = selective_state_update(*(plain[k] for k in DECODE_ORDER), True, ssm_scales=None, intermediate_scales=None)
    y = tm.selective_state_update_triton(*(tri[k] for k in DECODE_ORDER), True).cpu()
    assert torch.equal(y_op, y_ref) and torch.equal(plain["ssm_states"], given_a["ssm_states"])
    assert_close(y, y_ref, torch.bfloat16, msg="kernel with A_log vs plain op with A")
    assert_close(tri["ssm_states"].cpu(), given_a["ssm_states"], torch.float32, msg="pool")
    with pytest.raises(ValueError, match="`A`"):  # without the flag, A must be fp32 (already negated)
        selective_state_update(*(a_log.to(torch.bfloat16) if k == "A" else inp[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)


def test_registered_as_cuda_kernels():
    for op in ("ssd_chunk_scan", "selective_state_update"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_compile::{op}", "CUDA")


def test_cuda_impls_validate_then_launch():
    """The registered impls run the op's validation, then the launcher."""
    inp = _to(make_prefill([9, 0, 3], P=16, N=16, pad_rows=(2,)), KDEV)
    y, cs = tm._ssd_chunk_scan_cuda_impl(*(inp[k] for k in PREFILL_ORDER), 16, True)
    assert y.shape == inp["x"].shape and cs.shape[0] == _varlen.max_chunk_rows(12, 3, 16)
    bad = dict(inp, dt=torch.randn(12, 3, device=KDEV))
    with pytest.raises(ValueError, match="ssd_chunk_scan: `dt`"):
        tm._ssd_chunk_scan_cuda_impl(*(bad[k] for k in PREFILL_ORDER), 16, True)
    dec = _to(make_decode(2, 1, P=16, N=16), KDEV)
    assert tm._selective_state_update_cuda_impl(*(dec[k] for k in DECODE_ORDER)).shape == dec["x"].shape
    dec["z"] = torch.randn(2, 1, 4, 8, device=KDEV)
    with pytest.raises(ValueError, match="selective_state_update: `z`"):
        tm._selective_state_update_cuda_impl(*(dec[k] for k in DECODE_ORDER))


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at Mamba2 shapes (H=128, P=64, N=128, G=8, chunk 256)
# --------------------------------------------------------------------------------------------

GPU_DIMS = dict(H=128, G=8, P=64, N=128)


def _gpu_compare(actual, expected, dtype, what):
    """Relative Frobenius error plus an elementwise check; the tolerances are a bit above
    TOLERANCE's because the sums are long (N = 128 states, 256-token chunks)."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    rel = ((actual - expected).norm() / expected.norm().clamp_min(1e-6)).item()
    assert rel < (2e-5 if dtype == torch.float32 else 1e-2), f"{what}: relative error {rel}"
    atol, rtol = (5e-4, 5e-4) if dtype == torch.float32 else (6e-2, 3e-2)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "lens,opts",
    [
        ([1000, 0, 257, 1, 700], dict(dtype=torch.bfloat16, pad_rows=(3,), init=[True, False, True, True, False])),
        ([513, 256, 40], dict(dtype=torch.bfloat16, pool_dtype=torch.bfloat16, init=[False, True, True])),
        pytest.param([300, 17], dict(H=16, G=2, P=64, N=128, init=[True, False]),  # fp32: exact matmuls
                     marks=pytest.mark.smoke),
    ],
)
def test_gpu_ssd_chunk_scan_matches_plain(lens, opts):
    opts = dict(opts)
    dims = dict(GPU_DIMS)
    dims.update({k: opts.pop(k) for k in ("H", "G", "P", "N") if k in opts})
    dtype = opts.get("dtype", torch.float32)
    inp = make_prefill(lens, **dims, **opts)
    cpu = _clone(inp)
    y_ref, cs_ref = ssd_chunk_scan(*(cpu[k] for k in PREFILL_ORDER), 256, True, ssm_scales=None)
    gpu = _to(inp, "cuda")
    y, cs = torch.ops.hybrid_compile.ssd_chunk_scan(*(gpu[k] for k in PREFILL_ORDER), 256, True, ssm_scales=None)
    torch.cuda.synchronize()
    assert y.dtype == dtype and y.is_cuda
    _gpu_compare(y, y_ref, dtype, "y")
    _gpu_compare(cs, cs_ref, torch.float32 if dtype == torch.float32 else torch.bfloat16, "chunk states")
    slots = inp["state_indices"].tolist()
    written = [s for s, n in zip(slots, lens) if n > 0 and s >= 0]
    for s in range(inp["ssm_states"].shape[0]):
        if s in written:
            _gpu_compare(gpu["ssm_states"][s], cpu["ssm_states"][s],
                             _tol_dtype(gpu["ssm_states"]) if dtype == torch.float32 else dtype, f"slot {s}")
        else:
            assert torch.equal(gpu["ssm_states"][s].cpu(), inp["ssm_states"][s]), f"untouched slot {s} changed"


@pytest.mark.gpu
def test_gpu_ssd_chunk_scan_activation_dot_operands(monkeypatch):
    monkeypatch.setattr(tm, "SSD_DOT_OPERANDS", "activation")
    inp = make_prefill([700, 5, 300], **GPU_DIMS, dtype=torch.bfloat16, init=[True, False, True])
    cpu = _clone(inp)
    y_ref, cs_ref = ssd_chunk_scan(*(cpu[k] for k in PREFILL_ORDER), 256, True, ssm_scales=None)
    gpu = _to(inp, "cuda")
    y, cs = torch.ops.hybrid_compile.ssd_chunk_scan(*(gpu[k] for k in PREFILL_ORDER), 256, True, ssm_scales=None)
    rel = ((y.float().cpu() - y_ref.float()).norm() / y_ref.float().norm()).item()
    assert rel < 2e-2, rel
    rel_cs = ((cs.cpu() - cs_ref).norm() / cs_ref.norm()).item()
    assert rel_cs < 2e-2, rel_cs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        (64, 1, dict(dtype=torch.bfloat16, pad_rows=(3, 60), inter=False)),
        (16, 4, dict(dtype=torch.bfloat16, pool_dtype=torch.bfloat16, inter_dtype=torch.bfloat16, pad_rows=(0,),
                     disable=True)),
        (8, 3, dict(pad_rows=(5,))),
    ],
)
def test_gpu_selective_state_update_matches_plain(batch, steps, opts):
    dtype = opts.get("dtype", torch.float32)
    inp = make_decode(batch, steps, **GPU_DIMS, num_slots=batch + 8, **opts)
    cpu = _clone(inp)
    y_ref = selective_state_update(*(cpu[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    gpu = _to(inp, "cuda")
    y = torch.ops.hybrid_compile.selective_state_update(*(gpu[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    torch.cuda.synchronize()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float().cpu(), y_ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(gpu["ssm_states"].float().cpu(), cpu["ssm_states"].float(), atol=atol, rtol=rtol)
    if inp["disable_state_update"]:
        assert torch.equal(gpu["ssm_states"].cpu(), inp["ssm_states"])
    if inp["intermediate_states"] is not None:
        torch.testing.assert_close(gpu["intermediate_states"].float().cpu(), cpu["intermediate_states"].float(),
                                   atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_opcheck():
    pre = _to(make_prefill([0, 37, 1, 20], P=16, N=16, pad_rows=(3,), dtype=torch.bfloat16), "cuda")
    run_opcheck(torch.ops.hybrid_compile.ssd_chunk_scan.default, tuple(pre[k] for k in PREFILL_ORDER) + (16, True))
    pre = _to(make_prefill([5, 12], H=2, G=1, P=16, N=16, with_D=False, with_z=False), "cuda")
    run_opcheck(torch.ops.hybrid_compile.ssd_chunk_scan.default, tuple(pre[k] for k in PREFILL_ORDER) + (8, False))
    dec = _to(make_decode(3, 2, P=16, N=16, pad_rows=(1,)), "cuda")
    run_opcheck(torch.ops.hybrid_compile.selective_state_update.default, tuple(dec[k] for k in DECODE_ORDER) + (False,))
    dec = _to(make_decode(4, 1, P=16, N=16, inter=False, dtype=torch.bfloat16), "cuda")
    run_opcheck(torch.ops.hybrid_compile.selective_state_update.default, tuple(dec[k] for k in DECODE_ORDER) + (False,))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_decode_cuda_graph_replay():
    batch, num_slots = 8, 16
    inp = make_decode(batch, 1, **GPU_DIMS, dtype=torch.bfloat16, num_slots=num_slots, inter=False)
    static = _to(inp, "cuda")
    op = torch.ops.hybrid_compile.selective_state_update

    def call():
        return op(*(static[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)

    pool0 = static["ssm_states"].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    static["ssm_states"].copy_(pool0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = call()

    for pad_rows in [(), (2, 7)]:
        new = make_decode(batch, 1, **GPU_DIMS, dtype=torch.bfloat16, num_slots=num_slots, inter=False,
                          pad_rows=pad_rows)
        new["A"], new["D"], new["dt_bias"] = inp["A"], inp["D"], inp["dt_bias"]
        for k in ("x", "dt", "B", "C", "z", "ssm_states", "state_indices"):
            static[k].copy_(new[k])
        graph.replay()
        torch.cuda.synchronize()
        cpu = _clone(new)
        y_ref = selective_state_update(*(cpu[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
        torch.testing.assert_close(y_static.float().cpu(), y_ref.float(), atol=3e-2, rtol=3e-2)
        for r in pad_rows:
            assert torch.all(y_static[r] == 0)
        written = [v for v in new["state_indices"].tolist() if v >= 0]
        for slot in range(num_slots):
            if slot in written:
                torch.testing.assert_close(static["ssm_states"][slot].cpu(), cpu["ssm_states"][slot],
                                           atol=3e-2, rtol=3e-2)
            else:
                assert torch.equal(static["ssm_states"][slot].cpu(), new["ssm_states"][slot])
