"""FP8 KV cache (``kv_cache_dtype="fp8"``) in the attention kernel ops.

Oracle: the same op over a float cache holding the *dequantized* FP8 cache (for the attention
ops), or the format's own quantization of the written K/V (for ``store_kv_cache``). The plain-torch
ops equal it to fp32 noise; the Triton kernels (interpreter on CPU, tiny shapes) equal the plain
ops; every op passes opcheck with the FP8 arguments.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops.fp8_cache import FP8_DTYPE, dequantize_vectors, quantize_vectors
from hybrid_compile.ops.triton import attention as tri
from test_fp8_state_ops import run_opcheck
from test_triton_attention import dec_args, decode_batch, ext_args, extend_batch

INTERPRETER_ONLY = True
ops = torch.ops.hybrid_compile


def fp8_cache(b):
    """Quantize the batch's float cache in place of it; return the dequantized float copy."""
    kq, ks = quantize_vectors(b["k_cache"], -1)
    vq, vs = quantize_vectors(b["v_cache"], -1)
    b.update(k_cache=kq, v_cache=vq)
    return dequantize_vectors(kq, ks, -1), dequantize_vectors(vq, vs, -1), ks, vs


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16])
def test_store_quantizes_each_token_head(src_dtype):
    torch.manual_seed(0)
    slots_n, hkv, d, dv, t = 12, 2, 16, 8, 5
    k = (torch.randn(t, hkv, d) * torch.logspace(-2, 1, t)[:, None, None]).to(src_dtype)
    v = torch.randn(t, hkv, dv).to(src_dtype)
    slots = torch.tensor([3, -1, 7, 0, 11], dtype=torch.int32)
    for store in (ops.store_kv_cache, tri.store_kv_cache_triton):
        kc, vc = torch.zeros(slots_n, hkv, d, dtype=FP8_DTYPE), torch.zeros(slots_n, hkv, dv, dtype=FP8_DTYPE)
        ks, vs = torch.zeros(slots_n, hkv), torch.zeros(slots_n, hkv)
        store(kc, vc, slots, k, v, ks, vs)
        real = [0, 2, 3, 4]
        dst = slots[real].long()
        for cache, scale, x in ((kc, ks, k), (vc, vs, v)):
            want_q, want_s = quantize_vectors(x[real], -1)
            torch.testing.assert_close(scale[dst], want_s, rtol=1e-6, atol=0)
            assert torch.equal(cache[dst].view(torch.uint8), want_q.view(torch.uint8))
            others = [i for i in range(slots_n) if i not in dst.tolist()]
            assert not cache[others].view(torch.uint8).any() and not scale[others].any()
    kc, vc = torch.zeros(slots_n, hkv, d, dtype=FP8_DTYPE), torch.zeros(slots_n, hkv, dv, dtype=FP8_DTYPE)
    run_opcheck(ops.store_kv_cache, (kc, vc, slots, k, v), dict(k_scale=torch.zeros(slots_n, hkv),
                                                                v_scale=torch.zeros(slots_n, hkv)))


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (5, 30.0)])
def test_extend_over_fp8_cache(window, softcap):
    torch.manual_seed(1)
    b = extend_batch([3, 9, 1], pad_rows=2)
    kd, vd, ks, vs = fp8_cache(b)
    args = ext_args(b, window=window, softcap=softcap)
    ref_args = (args[0], kd, vd) + args[3:]
    o_ref, lse_ref = ops.paged_attention_extend(*ref_args)
    o, lse = ops.paged_attention_extend(*args, ks, vs)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_ref, atol=1e-6, rtol=1e-6)
    o_t, lse_t = tri.paged_attention_extend_triton(*args, ks, vs)
    torch.testing.assert_close(o_t, o_ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(lse_t, lse_ref, atol=2e-4, rtol=2e-4)
    run_opcheck(ops.paged_attention_extend, args, dict(k_scale=ks, v_scale=vs))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_decode_over_fp8_cache(q_dtype):
    torch.manual_seed(2)
    b = decode_batch([1, 40, 0, 17], q_dtype=q_dtype)
    kd, vd, ks, vs = fp8_cache(b)
    args = dec_args(b)
    ref_args = (args[0], kd, vd) + args[3:]
    o_ref, lse_ref = ops.paged_attention_decode(*ref_args)
    o, lse = ops.paged_attention_decode(*args, ks, vs)
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    tol = 2e-4 if q_dtype == torch.float32 else 3e-3  # fp16 dots over exact e4m3 values
    for splits in (1, 4):
        o_t, lse_t = tri.paged_attention_decode_triton(*args, ks, vs, num_splits=splits)
        torch.testing.assert_close(o_t.float(), o_ref.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lse_t, lse_ref, atol=tol, rtol=tol)
    run_opcheck(ops.paged_attention_decode, args, dict(k_scale=ks, v_scale=vs))


def test_fp8_cache_needs_its_scales():
    b = decode_batch([3])
    fp8_cache(b)
    with pytest.raises(ValueError, match="needs `k_scale`"):
        ops.paged_attention_decode(*dec_args(b))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_fp8_cache_at_real_head_dims(d):
    """store + extend + decode on the GPU at head dim 128 / 256 (bf16 queries) against the plain ops."""
    torch.manual_seed(3)
    b = extend_batch([300, 7], prefix_lens=[40, 0], hq=16, hkv=2, d=d, dv=d, q_dtype=torch.bfloat16)
    kd, vd, ks, vs = fp8_cache(b)
    args = ext_args(b)
    o_ref, _ = ops.paged_attention_extend(*args, ks, vs)
    dev = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    o, _ = ops.paged_attention_extend(*dev, ks.cuda(), vs.cuda())
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    db = decode_batch([1, 500, 33], hq=16, hkv=2, d=d, dv=d, q_dtype=torch.bfloat16)
    kd, vd, ks, vs = fp8_cache(db)
    args = dec_args(db)
    o_ref, _ = ops.paged_attention_decode(*args, ks, vs)
    dev = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    o, _ = ops.paged_attention_decode(*dev, ks.cuda(), vs.cuda())
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    t, hkv = 64, 2
    k, v = torch.randn(t, hkv, d, dtype=torch.bfloat16), torch.randn(t, hkv, d, dtype=torch.bfloat16)
    slots = torch.randperm(100)[:t].to(torch.int32)
    caches = [torch.zeros(100, hkv, d, dtype=FP8_DTYPE) for _ in range(2)] + [torch.zeros(100, hkv) for _ in range(2)]
    ops.store_kv_cache(caches[0], caches[1], slots, k, v, caches[2], caches[3])
    gpu = [c.cuda() for c in caches]
    ops.store_kv_cache(gpu[0], gpu[1], slots.cuda(), k.cuda(), v.cuda(), gpu[2], gpu[3])
    for a, c in zip(gpu, caches):
        assert torch.equal(a.cpu().view(torch.uint8) if a.dtype == FP8_DTYPE else a.cpu(),
                           c.view(torch.uint8) if c.dtype == FP8_DTYPE else c)
