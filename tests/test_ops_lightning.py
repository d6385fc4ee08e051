"""Lightning attention ops (hybrid_compile/ops/lightning.py) against the per-token reference
(ops/reference/lightning.py): chunked varlen prefill with chunk states, split prefill (a request
continued from its slot), decode and verify with intermediate states, draft-tree verify (every
node's root path run as a chain through the reference: ops/reference/tree.py), opcheck, fullgraph
compile."""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import lightning
from hybrid_compile.ops.reference import lightning as ref
from hybrid_compile.ops.reference import tree as ref_tree
from op_testing import VARLEN_CASES, assert_close, compile_and_compare, cu_seqlens_of, distinct_slots, run_opcheck

ops = torch.ops.hybrid_compile
C = lightning.LIGHTNING_CHUNK_SIZE
NUM_SLOTS = 10
H, K, V = 2, 8, 6


def slopes(h=H):
    """MiniMax's per-head slopes (transformers' ``get_slope_rate`` at layer 0)."""
    base = 1 / (2 ** (8 / h))
    return (base ** (torch.arange(h) + 1)).float()


def chunk_inputs(lens, dims=(H, K, V), dtype=torch.float32, pool_dtype=torch.float32, pad_rows=(), device="cpu",
                 num_slots=NUM_SLOTS):
    h, kd, vd = dims
    T = sum(lens)
    q = (torch.randn(T, h, kd) / kd ** 0.5).to(device=device, dtype=dtype)
    k = (torch.randn(T, h, kd) / kd ** 0.5).to(device=device, dtype=dtype)
    v = torch.randn(T, h, vd).to(device=device, dtype=dtype)
    pool = (torch.randn(num_slots, h, kd, vd) * 0.5).to(device=device, dtype=pool_dtype)
    cu = cu_seqlens_of(lens, device)
    slots = distinct_slots(len(lens), num_slots, pad_rows=pad_rows).to(device)
    has_init = (torch.arange(len(lens)) % 2 == 1).to(device)
    return q, k, v, slopes(h).to(device), pool, cu, slots, has_init


def recurrent_inputs(B, L, dims=(H, K, V), dtype=torch.float32, pad_rows=(), device="cpu", num_slots=NUM_SLOTS):
    h, kd, vd = dims
    q = (torch.randn(B, L, h, kd) / kd ** 0.5).to(device=device, dtype=dtype)
    k = (torch.randn(B, L, h, kd) / kd ** 0.5).to(device=device, dtype=dtype)
    v = torch.randn(B, L, h, vd).to(device=device, dtype=dtype)
    pool = (torch.randn(num_slots, h, kd, vd) * 0.5).to(device)
    return q, k, v, slopes(h).to(device), pool, distinct_slots(B, num_slots, pad_rows=pad_rows).to(device)


def check_pool(actual, expected, original, slots, tol_dtype=torch.float32):
    written = sorted({int(s) for s in slots if int(s) >= 0})
    untouched = [i for i in range(original.shape[0]) if i not in written]
    assert torch.equal(actual[untouched], original[untouched]), "untouched slots changed"
    assert_close(actual[written], expected[written], tol_dtype, msg="written slots")


@pytest.mark.parametrize("lens", VARLEN_CASES)
def test_chunk_matches_reference(lens):
    pad_rows = (0,) if len(lens) > 2 else ()
    q, k, v, s, pool, cu, slots, has_init = chunk_inputs(lens, pad_rows=pad_rows)
    got = pool.clone()
    o, cs = ops.chunk_lightning_attention(q, k, v, s, got, cu, slots, has_init, True, None)
    want_o, want_pool, want_cs = ref.chunk_lightning_attention_ref(q, k, v, s, pool, cu, slots, has_init, True, C)
    assert_close(o, want_o, msg="output")
    check_pool(got, want_pool, pool, [sl for sl, n in zip(slots.tolist(), lens) if n > 0])
    assert_close(cs, want_cs, msg="chunk states")
    got2 = pool.clone()
    o2, cs2 = ops.chunk_lightning_attention(q, k, v, s, got2, cu, slots, has_init, False, None)
    assert cs2.shape[0] == 0 and torch.equal(o2, o) and torch.equal(got2, got)


def test_split_prefill_equals_one_prefill():
    """A request prefilled in two pieces (the second from its slot) equals one prefill of it."""
    q, k, v, s, pool, _, _, _ = chunk_inputs([150])
    slot = torch.tensor([3], dtype=torch.int32)
    one = pool.clone()
    o_all, _ = ops.chunk_lightning_attention(q, k, v, s, one, cu_seqlens_of([150]), slot, torch.tensor([False]), False,
                                             None)
    two = pool.clone()
    o1, _ = ops.chunk_lightning_attention(q[:70], k[:70], v[:70], s, two, cu_seqlens_of([70]), slot,
                                          torch.tensor([False]), False, None)
    o2, _ = ops.chunk_lightning_attention(q[70:], k[70:], v[70:], s, two, cu_seqlens_of([80]), slot,
                                          torch.tensor([True]), False, None)
    assert_close(torch.cat([o1, o2]), o_all)
    assert_close(two, one)


@pytest.mark.parametrize("disable", [False, True])
@pytest.mark.parametrize("L", [1, 3])
def test_recurrent_matches_reference(L, disable):
    B = 4
    q, k, v, s, pool, slots = recurrent_inputs(B, L, pad_rows=(2,))
    inter = torch.zeros(B, L + 1, H, K, V)
    got_pool, got_inter = pool.clone(), inter.clone()
    o = ops.recurrent_lightning_attention_update(q, k, v, s, got_pool, slots, disable, got_inter, None, None)
    want_o, want_pool, want_inter = ref.recurrent_lightning_attention_update_ref(q, k, v, s, pool, slots, disable,
                                                                                 inter)
    assert_close(o, want_o)
    assert torch.all(o[2] == 0)
    if disable:
        assert torch.equal(got_pool, pool)
    else:
        check_pool(got_pool, want_pool, pool, slots)
    assert_close(got_inter, want_inter)
    assert torch.all(got_inter[:, L] == 0) and torch.all(got_inter[2] == 0)


# draft trees: row 0 a padding row, the others a branching tree, a chain written as parents, a star
TREES = [[-1, 0, 0, 1, 2, 1], [-1, 0, 0, 1, 2, 1], [-1, 0, 1, 2, 3, 4], [-1, -1, 0, 1, 0, 3]]


def tree_inputs(dtype=torch.float32, inter_dtype=torch.float32, device="cpu"):
    """Verify inputs over the rows of ``TREES`` (row 0 padding), their parents and an intermediate
    buffer filled with 7 (rows the op must not touch keep it)."""
    B, L = len(TREES), len(TREES[0])
    q, k, v, s, pool, slots = recurrent_inputs(B, L, dtype=dtype, pad_rows=(0,), device=device)
    inter = torch.full((B + 1, L, H, K, V), 7.0, dtype=inter_dtype, device=device)
    return (q, k, v, s, pool, slots, inter), torch.tensor(TREES, dtype=torch.int32, device=device)


def tree_oracle(args, parents):
    """Every node's root path run as a CHAIN through the per-token reference; a node's output and
    state are its path's last step's."""
    q, k, v, s, pool, slots, _ = (a.cpu() for a in args)

    def chain(b, xs, n):
        o, states = ref.lightning_ref(xs[0][0], xs[1][0], xs[2][0], s, pool[int(slots[b])])
        return o[None], states[None, 1:]

    return ref_tree.tree_by_paths(chain, [q, k, v], parents.cpu())


def check_tree_result(run, inter_dtype):
    """``run(q, k, v, slope, pool, slots, inter, parents) -> o`` over :func:`tree_inputs` against
    the chain oracle: the real rows' outputs and stored states, the pool untouched, the padding row
    and the buffer's extra row left alone. Returns (args, parents, o, tolerance dtype)."""
    args, parents = tree_inputs(inter_dtype=inter_dtype)
    want_o, want_states = tree_oracle(args, parents)
    q, k, v, s, pool, slots, inter = args
    got_pool = pool.clone()
    o = run(q, k, v, s, got_pool, slots, inter, parents)
    real = [1, 2, 3]
    # (a bf16 buffer: a parent is read as stored; the chain keeps fp32 between steps)
    tol = torch.float32 if inter_dtype == torch.float32 else torch.bfloat16
    assert_close(o[real], want_o[real].to(o.dtype), tol)
    assert_close(inter[real].float(), want_states[real], tol)
    assert torch.equal(got_pool, pool)
    assert torch.all(o[0] == 0) and torch.all(inter[0] == 7.0) and torch.all(inter[4] == 7.0)
    return args, parents, o, tol


@pytest.mark.parametrize("inter_dtype", [torch.float32, torch.bfloat16])
def test_recurrent_tree_matches_the_chain_reference_per_path(inter_dtype):
    """Each node of a draft tree starts from its parent's stored state (-1: the slot's): outputs
    and stored states equal each root path's chain (:func:`check_tree_result`)."""
    (q, k, v, s, pool, slots, inter), _, o, tol = check_tree_result(
        lambda q, k, v, s, p, sl, i, par: ops.recurrent_lightning_attention_update(q, k, v, s, p, sl, True, i, None,
                                                                                   None, par),
        inter_dtype)
    # a chain written as parents is the chain
    chain_inter = torch.zeros_like(inter)
    chain = ops.recurrent_lightning_attention_update(q[2:3], k[2:3], v[2:3], s, pool, slots[2:3], True,
                                                     chain_inter[:1], None, None)
    assert_close(o[2:3], chain, tol)


def test_tree_arguments_raise_clear_errors():
    (q, k, v, s, pool, slots, inter), parents = tree_inputs()
    with pytest.raises(ValueError, match="recurrent_lightning_attention_update: `parent_indices` .* needs the "
                                         "intermediate buffer"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, None, None, None, parents)
    with pytest.raises(ValueError, match="needs disable_state_update=True"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, False, inter, None, None, parents)
    bad = parents.clone()
    bad[1, 3] = 3
    with pytest.raises(ValueError, match=r"`parent_indices\[1, 3\]` = 3, must be in \[-1, 3\)"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, inter, None, None, bad)
    with pytest.raises(ValueError, match="`parent_indices`"):
        ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, inter, None, None, parents[:, :2])


def test_bad_arguments_raise_clear_errors():
    q, k, v, s, pool, cu, slots, has_init = chunk_inputs([5])
    with pytest.raises(ValueError, match="chunk_lightning_attention: `slope`"):
        ops.chunk_lightning_attention(q, k, v, s[:1], pool, cu, slots, has_init, False, None)
    with pytest.raises(ValueError, match="chunk_lightning_attention: `ssm_states`"):
        ops.chunk_lightning_attention(q, k, v, s, pool[:, :, :3], cu, slots, has_init, False, None)
    rq, rk, rv, rs, rpool, rslots = recurrent_inputs(2, 2)
    with pytest.raises(ValueError, match="recurrent_lightning_attention_update: `intermediate_states`"):
        ops.recurrent_lightning_attention_update(rq, rk, rv, rs, rpool, rslots, True, torch.zeros(2, 1, H, K, V), None,
                                                 None)


def test_opcheck():
    args = chunk_inputs([70, 0, 5], pad_rows=(1,))
    run_opcheck(ops.chunk_lightning_attention, (*args, True))
    run_opcheck(ops.chunk_lightning_attention, (*args, False))
    q, k, v, s, pool, slots = recurrent_inputs(3, 2, pad_rows=(1,))
    run_opcheck(ops.recurrent_lightning_attention_update, (q, k, v, s, pool, slots, False, torch.zeros(3, 2, H, K, V)))
    run_opcheck(ops.recurrent_lightning_attention_update, (q, k, v, s, pool, slots, True, None))
    args, parents = tree_inputs()
    run_opcheck(ops.recurrent_lightning_attention_update, (*args[:6], True, args[6], None, None, parents))


def test_fullgraph_compile():
    q, k, v, s, pool, slots = recurrent_inputs(3, 1)

    def decode(q, k, v, s, pool, slots):
        return ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, False, None, None, None) * 2

    eager, compiled, eager_args, compiled_args = compile_and_compare(decode, q, k, v, s, pool, slots)
    assert_close(compiled, eager)
    assert_close(compiled_args[4], eager_args[4])

    cq, ck, cv, cs_, cpool, cu, cslots, chi = chunk_inputs([70, 5])

    def prefill(q, k, v, s, pool, cu, slots, hi):
        o, cs = ops.chunk_lightning_attention(q, k, v, s, pool, cu, slots, hi, True, None)
        return o + 1, cs

    eager, compiled, eager_args, compiled_args = compile_and_compare(prefill, cq, ck, cv, cs_, cpool, cu, cslots, chi)
    assert_close(compiled[0], eager[0])
    assert_close(compiled[1], eager[1])
    assert_close(compiled_args[4], eager_args[4])

