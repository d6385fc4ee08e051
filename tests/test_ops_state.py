"""State ops (copy / commit / track) against a brute-force per-row loop."""

import pytest
import torch

import hybrid_compile  # noqa: F401
from op_testing import compile_and_compare, run_opcheck

ops = torch.ops.hybrid_compile


def idx(*v, dtype=torch.int32):
    return torch.tensor(v, dtype=dtype)


def pools(num_slots=8, dtype=torch.float32):
    conv = torch.randn(num_slots, 3, 6).to(dtype)
    ssm = torch.randn(num_slots, 2, 4, 5).to(dtype)
    return conv, ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copy_state_slots(dtype, index_dtype):
    conv, ssm = pools(dtype=dtype)
    src, dst = idx(0, 5, -1, 2, dtype=index_dtype), idx(3, 1, 4, -1, dtype=index_dtype)
    want_conv, want_ssm = conv.clone(), ssm.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        if s >= 0 and d >= 0:
            want_conv[d] = conv[s]
            want_ssm[d] = ssm[s]
    ops.copy_state_slots([conv, ssm], src, dst)
    assert torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)
    run_opcheck(ops.copy_state_slots, ([conv, ssm], src, dst))


@pytest.mark.parametrize("steps", [1, 4])
def test_commit_speculative_state(steps):
    conv, ssm = pools()
    batch = 4
    inter_conv = torch.randn(batch + 2, steps, *conv.shape[1:])  # buffer larger than the batch
    inter_ssm = torch.randn(batch + 2, steps, *ssm.shape[1:])
    slots = idx(6, -1, 2, 0)
    accepted = idx(steps, 1, 0, 1)
    want_conv, want_ssm = conv.clone(), ssm.clone()
    for b in range(batch):
        if slots[b] >= 0 and accepted[b] > 0:
            want_conv[slots[b]] = inter_conv[b, accepted[b] - 1]
            want_ssm[slots[b]] = inter_ssm[b, accepted[b] - 1]
    ops.commit_speculative_state([conv, ssm], [inter_conv, inter_ssm], slots, accepted)
    assert torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)
    run_opcheck(ops.commit_speculative_state, ([conv, ssm], [inter_conv, inter_ssm], slots, accepted))


def test_commit_casts_into_pool_dtype():
    ssm = torch.zeros(3, 2, 2, dtype=torch.bfloat16)
    inter = torch.randn(1, 2, 2, 2)
    ops.commit_speculative_state([ssm], [inter], idx(1), idx(2))
    assert torch.equal(ssm[1], inter[0, 1].to(torch.bfloat16))
    assert torch.equal(ssm[0], torch.zeros(2, 2, dtype=torch.bfloat16))


def test_track_chunk_states():
    _, ssm = pools()
    chunk_states = torch.randn(5, *ssm.shape[1:])
    src, dst = idx(4, 0, -1), idx(1, 7, 3)
    want = ssm.clone()
    want[1] = chunk_states[4]
    want[7] = chunk_states[0]
    ops.track_chunk_states(ssm, chunk_states, src, dst, ssm_scales=None, scale_dim=-1)
    assert torch.equal(ssm, want)
    run_opcheck(ops.track_chunk_states, (ssm, chunk_states, src, dst, None, -1))


def test_empty_index_lists_are_no_ops():
    conv, ssm = pools()
    before = conv.clone()
    ops.copy_state_slots([conv], idx(), idx())
    ops.track_chunk_states(ssm, torch.randn(0, *ssm.shape[1:]), idx(), idx(), ssm_scales=None, scale_dim=-1)
    assert torch.equal(conv, before)


def test_invalid_arguments():
    conv, ssm = pools()
    with pytest.raises(IndexError, match="src_slots"):
        ops.copy_state_slots([conv], idx(8), idx(0))
    with pytest.raises(IndexError, match="dst_slots"):
        ops.copy_state_slots([conv], idx(0), idx(-2))
    with pytest.raises(ValueError, match="repeated"):
        ops.copy_state_slots([conv], idx(0, 1), idx(3, 3))
    with pytest.raises(ValueError, match="dtype"):
        ops.copy_state_slots([conv], torch.tensor([0.0]), idx(1))
    with pytest.raises(ValueError, match="same number of slots"):
        ops.copy_state_slots([conv, ssm[:4]], idx(0), idx(1))
    with pytest.raises(ValueError, match="shape"):
        ops.copy_state_slots([conv], idx(0, 1), idx(1))
    with pytest.raises(ValueError, match="intermediate_states"):
        ops.commit_speculative_state([ssm], [torch.randn(2, 3, 2, 4)], idx(0, 1), idx(1, 1))
    with pytest.raises(IndexError, match="accepted_steps"):
        ops.commit_speculative_state([ssm], [torch.randn(2, 3, *ssm.shape[1:])], idx(0, 1), idx(1, 4))
    with pytest.raises(ValueError, match="slot shape"):
        ops.track_chunk_states(ssm, torch.randn(3, 2, 4, 4), idx(0), idx(0), ssm_scales=None, scale_dim=-1)
    with pytest.raises(IndexError, match="src_chunks"):
        ops.track_chunk_states(ssm, torch.randn(3, *ssm.shape[1:]), idx(3), idx(0), ssm_scales=None, scale_dim=-1)


def test_compiled_state_ops_match_eager():
    conv, ssm = pools()
    inter = torch.randn(3, 2, *ssm.shape[1:])
    chunk_states = torch.randn(4, *ssm.shape[1:])

    def step(conv, ssm, inter, chunk_states, src, dst, slots, accepted):
        ops.copy_state_slots([conv, ssm], src, dst)
        ops.commit_speculative_state([ssm], [inter], slots, accepted)
        ops.track_chunk_states(ssm, chunk_states, idx(1), idx(7), ssm_scales=None, scale_dim=-1)
        return ssm.sum(dim=(1, 2, 3)) + conv.sum(dim=(1, 2))

    args = (conv, ssm, inter, chunk_states, idx(0, 1), idx(4, 5), idx(2, -1, 6), idx(1, 2, 2))
    eager, compiled, eager_args, compiled_args = compile_and_compare(step, *args)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled_args[0], eager_args[0])
    torch.testing.assert_close(compiled_args[1], eager_args[1])
