"""Triton state-copy kernels (hybrid_compile/ops/triton/state.py) against the plain-torch ops and a
brute-force per-row loop.

On CPU the launchers run under Triton's interpreter; the ``gpu`` tests run the registered CUDA ops
at model shapes, under opcheck and in a CUDA graph.
"""

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import state as torch_state
from hybrid_compile.ops.triton import state as tstate
from op_testing import run_opcheck

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def idx(*v, dtype=torch.int32, device="cpu"):
    return torch.tensor(v, dtype=dtype, device=device)


def pools(num_slots=8, dtype=torch.float32, device="cpu"):
    conv = torch.randn(num_slots, 3, 6, device=device).to(dtype)
    ssm = torch.randn(num_slots, 2, 4, 5, device=device).to(dtype)
    return conv, ssm


def _bits_equal(a, b):
    """Bit-for-bit equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copy_state_slots(dtype, index_dtype):
    conv, ssm = pools(dtype=dtype)
    conv[5, 0, 0] = float("nan")  # copied bit for bit
    src, dst = idx(0, 5, -1, 2, 7, dtype=index_dtype), idx(3, 1, 4, -1, 6, dtype=index_dtype)
    want = [conv.clone(), ssm.clone()]
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0 and d >= 0:
            for w, p in zip(want, (conv, ssm)):
                w[d] = p[s]
    op = [conv.clone(), ssm.clone()]
    torch_state.copy_state_slots(op, src, dst)
    got = [conv.clone(), ssm.clone()]
    tstate.copy_state_slots_triton(got, src, dst)
    for g, w, o in zip(got, want, op):
        assert _bits_equal(g, w) and _bits_equal(g, o)
    assert torch.isnan(got[0][1, 0, 0])


def test_copy_any_dtype_and_layouts():
    """Integer / bool pools and a pool whose slot stride is padded; a slot that is not one
    contiguous run is rejected (no silent slow path)."""
    ints = torch.randint(-100, 100, (6, 4), dtype=torch.int64)
    flags = torch.rand(6, 3) > 0.5
    padded = torch.randn(6, 10)[:, :7]  # slot stride 10, slot itself contiguous
    tensors = [ints, flags, padded]
    src, dst = idx(0, 3, -1), idx(2, 5, 1)
    want = [t.clone() for t in tensors]
    for w in want:
        w[2], w[5] = w[0].clone(), w[3].clone()
    got = [ints.clone(), flags.clone(), torch.empty(6, 10)[:, :7].copy_(padded)]
    assert got[2].stride() == (10, 1)  # the layout under test
    tstate.copy_state_slots_triton(got, src, dst)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    transposed = torch.randn(5, 6).t()  # [6, 5]: each slot is a strided column
    with pytest.raises(ValueError, match="one contiguous run"):
        tstate.copy_state_slots_triton([transposed], src, dst)


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("pool_dtype,inter_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_commit_speculative_state(steps, pool_dtype, inter_dtype):
    conv, ssm = pools(dtype=pool_dtype)
    batch = 5
    inter_conv = torch.randn(batch + 2, steps, *conv.shape[1:]).to(inter_dtype)  # buffer larger than the batch
    inter_ssm = torch.randn(batch + 2, steps, *ssm.shape[1:]).to(inter_dtype)
    slots = idx(6, -1, 2, 0, 3, dtype=torch.int64)
    accepted = idx(steps, 1, 0, 1, -1)  # padding row, 0 and negative accepted: skipped
    want = [conv.clone(), ssm.clone()]
    for b in range(batch):
        if slots[b] >= 0 and accepted[b] > 0:
            want[0][slots[b]] = inter_conv[b, accepted[b] - 1]
            want[1][slots[b]] = inter_ssm[b, accepted[b] - 1]
    op = [conv.clone(), ssm.clone()]
    torch_state.commit_speculative_state(op, [inter_conv, inter_ssm], slots, accepted)
    got = [conv.clone(), ssm.clone()]
    tstate.commit_speculative_state_triton(got, [inter_conv, inter_ssm], slots, accepted)
    for g, w, o in zip(got, want, op):
        assert _bits_equal(g, w) and _bits_equal(g, o)
    untouched = [s for s in range(conv.shape[0]) if s not in (6, 0)]
    assert _bits_equal(got[1][untouched], ssm[untouched])


def test_commit_skips_out_of_range_accepted():
    """accepted_steps > steps is rejected on CPU by the op; the kernel itself never reads past the buffer."""
    ssm = torch.randn(4, 2, 3)
    inter = torch.randn(2, 2, 2, 3)
    got = ssm.clone()
    tstate.commit_speculative_state_triton([got], [inter], idx(1, 2), idx(3, 2))
    assert torch.equal(got[1], ssm[1]) and torch.equal(got[2], inter[1, 1])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_track_chunk_states(pool_dtype):
    ssm = torch.randn(8, 2, 4, 5).to(pool_dtype)
    chunks = torch.randn(11, 2, 4, 5)  # fp32 chunk states, cast into the pool
    src, dst = idx(3, -1, 10, 0, 7), idx(0, 1, 7, -1, 4)
    want = ssm.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0 and d >= 0:
            want[d] = chunks[s].to(pool_dtype)
    op = ssm.clone()
    torch_state.track_chunk_states(op, chunks, src, dst, ssm_scales=None, scale_dim=-1)
    got = ssm.clone()
    tstate.track_chunk_states_triton(got, chunks, src, dst)
    assert _bits_equal(got, want) and _bits_equal(got, op)


def test_large_slot_spans_several_blocks():
    """A slot bigger than one program's block (4096) is split along the row."""
    ssm = torch.randn(3, 2, 64, 40)  # 5120 elements per slot
    got = ssm.clone()
    tstate.copy_state_slots_triton([got], idx(0), idx(2))
    assert torch.equal(got[2], ssm[0]) and torch.equal(got[:2], ssm[:2])


def test_cuda_impls_validate_arguments():
    conv, ssm = pools()
    with pytest.raises(ValueError, match=r"copy_state_slots: `dst_slots` has repeated"):
        tstate._copy_state_slots_cuda([conv, ssm], idx(0, 1), idx(3, 3))
    with pytest.raises(IndexError, match=r"accepted_steps"):
        tstate._commit_speculative_state_cuda([ssm], [torch.randn(1, 2, 2, 4, 5)], idx(0), idx(3))
    with pytest.raises(ValueError, match=r"track_chunk_states: `chunk_states`"):
        tstate._track_chunk_states_cuda(ssm, torch.randn(4, 2, 4, 6), idx(0), idx(1))
    tstate._copy_state_slots_cuda([conv, ssm], idx(0), idx(1))
    assert torch.equal(conv[1], conv[0])


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops at model shapes (skipped without CUDA)
# --------------------------------------------------------------------------------------------


def _registered(name):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hybrid_compile::{name}", "CUDA")


def _model_pools(num_slots, dev, ssm_dtype=torch.float32):
    """Qwen3-Next-like per-layer views of stacked buffers: conv [S, 3, 8192] bf16, ssm [S, 32, 128, 128]."""
    conv = torch.randn(2, num_slots, 3, 8192, device=dev, dtype=torch.bfloat16)
    ssm = torch.randn(2, num_slots, 32, 128, 128, device=dev).to(ssm_dtype)
    return [conv[0], ssm[0], conv[1], ssm[1]]


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_copy_and_track_model_shapes():
    assert all(_registered(n) for n in ("copy_state_slots", "commit_speculative_state", "track_chunk_states"))
    dev = "cuda"
    states = _model_pools(16, dev)
    src, dst = idx(0, 3, -1, 5, device=dev), idx(7, 8, 9, -1, device=dev)
    want = [s.cpu() for s in states]
    ops.copy_state_slots(want, src.cpu(), dst.cpu())
    ops.copy_state_slots(states, src, dst)
    for s, w in zip(states, want):
        assert torch.equal(s.cpu(), w)
    ssm = states[1].to(torch.bfloat16)
    chunks = torch.randn(40, 32, 128, 128, device=dev)
    s_src, s_dst = idx(0, 39, -1, 12, device=dev), idx(1, 2, 3, 4, device=dev)
    want = ssm.cpu()
    ops.track_chunk_states(want, chunks.cpu(), s_src.cpu(), s_dst.cpu(), ssm_scales=None, scale_dim=-1)
    ops.track_chunk_states(ssm, chunks, s_src, s_dst, ssm_scales=None, scale_dim=-1)
    assert torch.equal(ssm.cpu(), want)
    run_opcheck(ops.copy_state_slots, (states[:2], src, dst))
    run_opcheck(ops.track_chunk_states, (ssm, chunks, s_src, s_dst, None, -1))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_commit_cuda_graph_replay():
    """The speculative commit captured once, replayed with new slots / accepted lengths (-1 rows)."""
    dev, batch, steps, num_slots = "cuda", 8, 4, 32
    states = _model_pools(num_slots, dev)[:2]
    inter = [torch.randn(batch, steps, *s.shape[1:], device=dev, dtype=s.dtype) for s in states]
    slot_buf = torch.arange(batch, device=dev, dtype=torch.int32)
    acc_buf = torch.ones(batch, device=dev, dtype=torch.int32)
    ops.commit_speculative_state(states, inter, slot_buf, acc_buf)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.commit_speculative_state(states, inter, slot_buf, acc_buf)
    run_opcheck(ops.commit_speculative_state, (states, inter, slot_buf, acc_buf))
    for _ in range(3):
        slots = torch.randperm(num_slots, device=dev)[:batch].to(torch.int32)
        slots[2] = -1
        acc = torch.randint(0, steps + 1, (batch,), device=dev, dtype=torch.int32)
        for t in inter:
            t.copy_(torch.randn_like(t))
        slot_buf.copy_(slots)
        acc_buf.copy_(acc)
        want = [s.cpu() for s in states]
        ops.commit_speculative_state(want, [t.cpu() for t in inter], slots.cpu(), acc.cpu())
        graph.replay()
        torch.cuda.synchronize()
        for s, w in zip(states, want):
            assert torch.equal(s.cpu(), w)
