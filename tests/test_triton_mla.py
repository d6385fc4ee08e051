"""Triton paged attention over a compressed MLA cache (hybrid_compile/ops/triton/attention.py with a
split head dim): one KV head whose K row is ``[latent, rope key]`` and whose V is a view of the
latent (``AttentionLayerSpec(v_from_k=True)``), q/k head dims above 256 computed as two dots
(512 + 64 in Kimi-Linear-48B / DeepSeek), against the plain-torch ops and the per-query reference.

CPU: the launchers under Triton's interpreter on tiny token counts (the head dims are the real
ones: the split only happens above 256). GPU (``@pytest.mark.gpu``): the registered CUDA ops at
Kimi-Linear-48B's MLA shapes (32 heads, 576 / 512) against the torch ops on CPU copies.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile  # noqa: F401  (registers the ops)
import hybrid_compile.ops.attention as attn
from hybrid_compile.ops.reference.attention import paged_attention_decode_ref, paged_attention_extend_ref
from hybrid_compile.ops.triton import attention as tri
from op_testing import assert_close, cu_seqlens_of

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def mla_batch(q_lens, prefix_lens, hq, rank, rope, dtype=torch.float32, device="cpu"):
    """q ``[T, hq, rank + rope]``; compressed pool ``k_cache [S, 1, rank + rope]`` with
    ``v_cache = k_cache[..., :rank]`` (a view, as the KV pool hands it out); paged indices."""
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    nnz = sum(kv_lens)
    num_slots = nnz + 5
    k_cache = torch.randn(num_slots, 1, rank + rope).to(device=device, dtype=dtype)
    return dict(
        q=torch.randn(sum(q_lens), hq, rank + rope).to(device=device, dtype=dtype),
        k_cache=k_cache,
        v_cache=k_cache[..., :rank],
        qo_indptr=cu_seqlens_of(q_lens, device=device),
        kv_indptr=cu_seqlens_of(kv_lens, device=device),
        kv_indices=torch.randperm(num_slots)[:nnz].to(torch.int32).to(device),
        scale=(rank // 2 + rope) ** -0.5,
    )


def _extend(fn, b):
    return fn(b["q"], b["k_cache"], b["v_cache"], b["qo_indptr"], b["kv_indptr"], b["kv_indices"], b["scale"], True,
              -1, 0.0)


def _decode(fn, b):
    return fn(b["q"], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], b["scale"], -1, 0.0)


@pytest.mark.parametrize("rank,rope", [(256, 16), (512, 64)])
def test_extend_split_head_dim_matches_op_and_ref(rank, rope):
    b = mla_batch([3, 1], [2, 5], hq=2, rank=rank, rope=rope)
    o, lse = _extend(tri.paged_attention_extend_triton, b)
    want_o, want_lse = _extend(attn.paged_attention_extend, b)
    ref_o, _ = _extend(paged_attention_extend_ref, b)
    assert o.shape == (4, 2, rank)
    assert_close(o, want_o)
    assert_close(lse, want_lse)
    assert_close(o, ref_o)


@pytest.mark.parametrize("rank,rope", [(256, 16), (512, 64)])
def test_decode_split_head_dim_matches_op_and_ref(rank, rope):
    b = mla_batch([1, 1], [6, 20], hq=4, rank=rank, rope=rope)
    for splits in (1, 2):
        o, lse = tri.paged_attention_decode_triton(b["q"], b["k_cache"], b["v_cache"], b["kv_indptr"],
                                                   b["kv_indices"], b["scale"], num_splits=splits)
        want_o, want_lse = _decode(attn.paged_attention_decode, b)
        assert_close(o, want_o, msg=f"{splits} splits")
        assert_close(lse, want_lse)
        assert_close(o, _decode(paged_attention_decode_ref, b)[0])


def test_unsupported_head_dims_raise_naming_them():
    b = mla_batch([1], [2], hq=2, rank=1024, rope=64)
    with pytest.raises(ValueError, match="got q/k 1088, v 1024"):
        _extend(tri.paged_attention_extend_triton, b)
    with pytest.raises(ValueError, match="got q/k 1088, v 1024"):
        _decode(tri.paged_attention_decode_triton, b)


# ----------------------------------------------------------------------------------------------
# gpu: Kimi-Linear-48B MLA shapes
# ----------------------------------------------------------------------------------------------

DEV = "cuda"  # the gpu tests' device (a module constant so their logic can be dry-run elsewhere)
KIMI_MLA = dict(hq=32, rank=512, rope=64)


def _cpu(b):
    k = b["k_cache"].cpu()
    return dict(b, q=b["q"].cpu(), k_cache=k, v_cache=k[..., : KIMI_MLA["rank"]], qo_indptr=b["qo_indptr"].cpu(),
                kv_indptr=b["kv_indptr"].cpu(), kv_indices=b["kv_indices"].cpu())


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_mla_extend_and_decode_match_torch_ops():
    b = mla_batch([300, 1, 64, 129], [0, 700, 5, 1000], dtype=torch.bfloat16, device=DEV, **KIMI_MLA)
    o, lse = _extend(ops.paged_attention_extend, b)
    want_o, want_lse = _extend(attn.paged_attention_extend, _cpu(b))
    assert_close(o.cpu(), want_o, torch.bfloat16)
    assert_close(lse.cpu(), want_lse, torch.bfloat16)
    d = mla_batch([1] * 16, [5, 300, 2000, 17] * 4, dtype=torch.bfloat16, device=DEV, **KIMI_MLA)
    o, lse = _decode(ops.paged_attention_decode, d)
    want_o, want_lse = _decode(attn.paged_attention_decode, _cpu(d))
    assert_close(o.cpu(), want_o, torch.bfloat16)
    assert_close(lse.cpu(), want_lse, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_mla_decode_in_cuda_graph():
    d = mla_batch([1] * 8, [50, 3, 900, 64] * 2, dtype=torch.bfloat16, device=DEV, **KIMI_MLA)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _decode(ops.paged_attention_decode, d)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _decode(ops.paged_attention_decode, d)
    d["q"].copy_(torch.randn_like(d["q"]))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out.cpu(), _decode(attn.paged_attention_decode, _cpu(d))[0], torch.bfloat16)
