"""Triton lightning attention kernels (hybrid_compile/ops/triton/lightning.py) against the
plain-torch ops and the per-token reference (draft trees: each node's root path as a chain).

On CPU the launchers run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at
tiny head dims; the ``gpu`` tests run the registered CUDA ops at MiniMax-Text-01 shapes (64 heads
of dim 128), under opcheck and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import lightning
from hybrid_compile.ops._varlen import chunk_row_offsets
from hybrid_compile.ops.reference import lightning as ref
from hybrid_compile.ops.triton import lightning as tl_lightning
from op_testing import assert_close, run_opcheck
from hybrid_compile.ops.reference import tree as ref_tree
from test_ops_lightning import C, H, K, V, check_pool, check_tree_result, chunk_inputs, recurrent_inputs, tree_oracle

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


@pytest.mark.parametrize("lens,dims,pool_dtype", [
    ([5], (H, 16, V), torch.float32),  # tl.dot needs blocks >= 16
    ([65, 0, 3], (H, 16, V), torch.float32),
    ([130, 1], (H, 16, V), torch.float32),
    ([70, 3], (2, 24, 40), torch.bfloat16),  # K and V padded to powers of two, V in two blocks; bf16 pool
])
def test_interpreted_chunk_matches_reference(lens, dims, pool_dtype):
    pad_rows = (1,) if len(lens) > 2 else ()
    q, k, v, s, pool, cu, slots, has_init = chunk_inputs(lens, dims, pool_dtype=pool_dtype, pad_rows=pad_rows)
    got = pool.clone()
    o, cs = tl_lightning.chunk_lightning_attention_triton(q, k, v, s, got, cu, slots, has_init, True)
    want_o, want_pool, want_cs = ref.chunk_lightning_attention_ref(q, k, v, s, pool, cu, slots, has_init, True, C)
    tol = torch.bfloat16 if pool_dtype == torch.bfloat16 else torch.float32
    assert_close(o, want_o, tol, msg="output")
    check_pool(got, want_pool, pool, [sl for sl, n in zip(slots.tolist(), lens) if n > 0], tol)
    assert_close(cs, want_cs, tol, msg="chunk states")


@pytest.mark.parametrize("disable", [False, True])
def test_interpreted_recurrent_matches_reference(disable):
    B, L = 3, 2
    q, k, v, s, pool, slots = recurrent_inputs(B, L, pad_rows=(1,))
    inter = torch.zeros(B, L, H, K, V)
    got_pool, got_inter = pool.clone(), inter.clone()
    o = tl_lightning.recurrent_lightning_attention_update_triton(q, k, v, s, got_pool, slots, disable, got_inter)
    want_o, want_pool, want_inter = ref.recurrent_lightning_attention_update_ref(q, k, v, s, pool, slots, disable,
                                                                                 inter)
    assert_close(o, want_o)
    if disable:
        assert torch.equal(got_pool, pool)
    else:
        check_pool(got_pool, want_pool, pool, slots)
    assert_close(got_inter, want_inter)


@pytest.mark.parametrize("inter_dtype", [torch.float32, torch.bfloat16])
def test_interpreted_recurrent_tree_matches_chain_reference_and_op(inter_dtype):
    """The kernel over draft trees (each node from its parent's stored row, -1 from the slot's
    state): the chain reference per root path, and the plain op."""
    (q, k, v, s, pool, slots, inter), parents, o, tol = check_tree_result(
        lambda q, k, v, s, p, sl, i, par: tl_lightning.recurrent_lightning_attention_update_triton(
            q, k, v, s, p, sl, True, i, par), inter_dtype)
    op_inter = torch.full_like(inter, 7.0)
    op_o = lightning.recurrent_lightning_attention_update(q, k, v, s, pool.clone(), slots, True, op_inter, None, None,
                                                          parents)
    # (a bf16 buffer: a one-ulp rounding of a stored state, fp32 sums apart, carries into its children)
    assert_close(o, op_o, tol)
    assert_close(inter.float(), op_inter.float(), tol)


def test_interpreted_recurrent_random_trees_one_program_per_path():
    """The kernel walks each root-to-leaf path in its own programs (``common.tree_path``): random
    trees of 11 nodes, a forest (several nodes from the slot's state) and a chain, against the
    chain reference per root path and the plain op; every node stored exactly once."""
    gen = torch.Generator().manual_seed(8)
    B, L = 5, 11
    parents = ref_tree.trees_forest_and_chain(B, gen)  # random trees, a forest, a chain
    q, k, v, s, pool, slots = recurrent_inputs(B, L, pad_rows=(1,))
    inter = torch.full((B + 1, L, H, K, V), 7.0)
    want_o, want_states = tree_oracle((q, k, v, s, pool, slots, inter), parents)
    got_pool = pool.clone()
    o = tl_lightning.recurrent_lightning_attention_update_triton(q, k, v, s, got_pool, slots, True, inter, parents)
    op_inter = torch.full_like(inter, 7.0)
    op_o = lightning.recurrent_lightning_attention_update(q, k, v, s, pool.clone(), slots, True, op_inter, None, None,
                                                          parents)
    real = [0, 2, 3, 4]
    assert_close(o[real], want_o[real].to(o.dtype))
    assert_close(inter[real], want_states[real])
    assert_close(o, op_o)
    assert_close(inter, op_inter)
    assert torch.equal(got_pool, pool)
    assert torch.all(o[1] == 0) and torch.all(inter[1] == 7.0) and torch.all(inter[B] == 7.0)


# ------------------------------------------------------------------------------------------------
# GPU: the registered CUDA kernels at MiniMax-Text-01 shapes
# ------------------------------------------------------------------------------------------------

MINIMAX = (64, 128, 128)  # H, K, V
GPU_SLOTS = 64
GPU_LENS = [1000, 0, 1, 63, 64, 65, 130, 300]  # request 5 is a padding row
DEV = "cuda"


def _cpu(*xs):
    return [None if x is None else x.cpu() for x in xs]


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_gpu_chunk_matches_torch_op(dtype, pool_dtype):
    q, k, v, s, pool, cu, slots, has_init = chunk_inputs(GPU_LENS, MINIMAX, dtype, pool_dtype, (5,), DEV, GPU_SLOTS)
    got = pool.clone()
    o, cs = ops.chunk_lightning_attention(q, k, v, s, got, cu, slots, has_init, True, None)
    torch.cuda.synchronize()
    cq, ck, cv, cs_, cpool, ccu, cslots, chi = _cpu(q, k, v, s, pool, cu, slots, has_init)
    want_pool = cpool.clone()
    want_o, want_cs = lightning.chunk_lightning_attention(cq, ck, cv, cs_, want_pool, ccu, cslots, chi, True, None)
    tol = torch.bfloat16 if torch.bfloat16 in (dtype, pool_dtype) else torch.float32
    assert_close(o.cpu(), want_o, tol, msg="output")
    assert_close(got.cpu(), want_pool, tol, msg="pool")
    assert_close(cs.cpu(), want_cs, tol, msg="chunk states")
    offs = chunk_row_offsets(ccu, C)
    assert torch.all(o[cu[5] : cu[6]] == 0) and torch.all(cs[offs[5] : offs[5] + 2] == 0)


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("L", [1, 4])
def test_gpu_recurrent_matches_torch_op_and_replays_in_cuda_graph(L):
    B = 16
    q, k, v, s, pool, slots = recurrent_inputs(B, L, MINIMAX, torch.bfloat16, (3,), DEV, GPU_SLOTS)
    inter = torch.zeros(B, L, *MINIMAX, device=DEV)
    got_pool = pool.clone()
    o = ops.recurrent_lightning_attention_update(q, k, v, s, got_pool, slots, False, inter, None, None)
    cq, ck, cv, cs_, cpool, cslots, cinter = _cpu(q, k, v, s, pool, slots, torch.zeros_like(inter))
    want_pool = cpool.clone()
    want = lightning.recurrent_lightning_attention_update(cq, ck, cv, cs_, want_pool, cslots, False, cinter, None, None)
    assert_close(o.cpu(), want, torch.bfloat16)
    assert_close(got_pool.cpu(), want_pool)
    assert_close(inter.cpu(), cinter)
    # in a CUDA graph: capture once, replay with new inputs
    pool0 = pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, inter, None, None)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, inter, None, None)
    nq, nk, nv, _, _, _ = recurrent_inputs(B, L, MINIMAX, torch.bfloat16, (3,), DEV, GPU_SLOTS)
    for dst, src in ((q, nq), (k, nk), (v, nv)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = lightning.recurrent_lightning_attention_update(*_cpu(q, k, v, s, pool0), slots.cpu(), True, None, None, None)
    assert_close(out.cpu(), want, torch.bfloat16)
    assert torch.equal(pool, pool0)


@pytest.mark.gpu
@pytest.mark.parametrize("nodes", [4, 16])
def test_gpu_recurrent_tree_matches_torch_op_in_a_cuda_graph(nodes):
    """The CUDA op over random draft trees at MiniMax shapes against the plain op on CPU copies,
    eagerly and replayed from a CUDA graph with new trees; opcheck."""
    B = 8
    gen = torch.Generator().manual_seed(nodes)
    q, k, v, s, pool, slots = recurrent_inputs(B, nodes, MINIMAX, torch.bfloat16, (3,), DEV, GPU_SLOTS)
    inter = torch.zeros(B, nodes, *MINIMAX, device=DEV)
    parents = ref_tree.random_parents(B, nodes, gen).to(DEV)

    def check(o, parents):
        cinter = torch.zeros(B, nodes, *MINIMAX)
        want = lightning.recurrent_lightning_attention_update(*_cpu(q, k, v, s, pool), slots.cpu(), True, cinter,
                                                              None, None, parents.cpu())
        assert_close(o.cpu(), want, torch.bfloat16)
        assert_close(inter.cpu(), cinter)

    pool0 = pool.clone()
    check(ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, inter, None, None, parents), parents)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.recurrent_lightning_attention_update(q, k, v, s, pool, slots, True, inter, None, None, parents)
    parents.copy_(ref_tree.random_parents(B, nodes, gen))
    graph.replay()
    torch.cuda.synchronize()
    check(out, parents)
    assert torch.equal(pool, pool0)
    run_opcheck(ops.recurrent_lightning_attention_update, (q, k, v, s, pool, slots, True, inter),
                dict(parent_indices=parents))


@pytest.mark.gpu
def test_gpu_opcheck():
    dims = (4, 128, 128)
    args = chunk_inputs([70, 0, 5], dims, torch.bfloat16, torch.float32, (), DEV, GPU_SLOTS)
    run_opcheck(ops.chunk_lightning_attention, (*args, True))
    q, k, v, s, pool, slots = recurrent_inputs(3, 2, dims, torch.bfloat16, (1,), DEV, GPU_SLOTS)
    run_opcheck(ops.recurrent_lightning_attention_update, (q, k, v, s, pool, slots, False, None))
