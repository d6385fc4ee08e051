"""Paged attention over a token-level KV pool (CSR format: ``kv_indptr`` / ``kv_indices`` list each
request's KV slots).

One attention layer's pool is a pair ``k_cache: [num_slots, Hkv, D]``,
``v_cache: [num_slots, Hkv, Dv]`` (fp32/bf16/fp16, may differ from the activation dtype;
every op computes in fp32). An FP8 KV cache (``kv_cache_dtype="fp8"``) is float8_e4m3fn with
fp32 scales ``k_scale / v_scale [num_slots, Hkv]`` beside it, one per token and head
(:mod:`.fp8_cache`): ``store_kv_cache`` quantizes, the attention ops dequantize what they read. A *slot* is one token: with page size 1 a KV index is a slot;
larger pages reuse the same token-level indices (``slot = page * page_size + offset``).

The KV tokens of request ``b`` are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, listed in
position order (position 0 first). Prefix sharing means the same slot may appear in several
requests. ``kv_indices`` may be longer than ``kv_indptr[-1]`` (a preallocated buffer): the tail
is ignored.

Ops:

- ``store_kv_cache``          write the new tokens' K/V into their slots (slot -1 skipped).
- ``paged_attention_extend``  prefill / extend: the new tokens' K/V are already in the pool;
                              causal masking by absolute position, sliding window, logit
                              softcap, GQA. Returns the output and the log-sum-exp.
- ``paged_attention_decode``  one query per request over all its KV tokens.
- ``merge_attention_states``  combine two partial attentions over disjoint key sets through
                              their log-sum-exps (cascade / split-KV "merge_state").

Masking follows transformers' ``masking_utils``: position ``p`` sees key position ``k`` iff
``k <= p`` (``causal_mask_function``) and, with ``sliding_window = W > 0``,
``k > p - W`` (``sliding_window_overlay``), i.e. the window is ``(p - W, p]``: the current
token plus the ``W - 1`` before it. (FlashAttention's ``window_size=(W - 1, 0)`` is the same
thing; HF passes ``sliding_window - 1`` to it.)

Log-sum-exps are in natural log, fp32, of the scaled (and capped) logits; a row that sees no
key has output 0 and lse ``-inf``.
"""

from __future__ import annotations

import math

import torch

from typing import Optional
from .registration import kernel_op

from .fp8_cache import FP8_DTYPE, KV_SCALE_DIM, check_scales, dequantize_vectors, is_fp8, read_rows, write_rows
from ._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_slot_indices,
    check_tensor,
    check_unique_slots,
    should_check_values,
)

# Upper bound on the number of fp32 logits materialised at once by the plain-torch paths
# (extend: per query block; decode: per group of requests). 2**24 floats = 64 MiB.
_LOGITS_BUDGET = 1 << 24
#: New tokens per request a ``tree_mask`` can describe (one int64 of ancestor bits per token).
MAX_TREE_TOKENS = 64


# --------------------------------------------------------------------------------------------
# shared checks
# --------------------------------------------------------------------------------------------


#: KV pool dtypes: float, or e4m3 with per-(token, head) fp32 scales.
KV_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


def _check_pool(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale=None, v_scale=None) -> None:
    check_tensor(op, "k_cache", k_cache, ndim=3, dtypes=KV_DTYPES)
    check_tensor(op, "v_cache", v_cache, ndim=3, dtypes=KV_DTYPES)
    check_scales(op, k_cache, k_scale, "k_scale", KV_SCALE_DIM, "k_cache")
    check_scales(op, v_cache, v_scale, "v_scale", KV_SCALE_DIM, "v_cache")
    if k_cache.shape[0] != v_cache.shape[0] or k_cache.shape[1] != v_cache.shape[1]:
        raise ValueError(
            f"{op}: `k_cache` {tuple(k_cache.shape)} and `v_cache` {tuple(v_cache.shape)} must agree on "
            f"[num_slots, Hkv]"
        )


def _check_heads(op: str, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{op}: number of query heads {hq} must be a multiple of the number of kv heads {hkv}")
    if q.shape[2] != k_cache.shape[2]:
        raise ValueError(f"{op}: `q` head dim {q.shape[2]} does not match `k_cache` head dim {k_cache.shape[2]}")


def _check_scalars(op: str, sliding_window: int, logit_softcap: float) -> None:
    if not (logit_softcap >= 0.0) or math.isinf(logit_softcap):
        raise ValueError(f"{op}: `logit_softcap` must be a finite value >= 0 (0 = off), got {logit_softcap}")


def _check_indptr(op: str, name: str, indptr: torch.Tensor, limit: int, what: str) -> None:
    """indptr[0] == 0, non-decreasing, indptr[-1] <= limit (value checks: CPU or debug only)."""
    if not should_check_values(indptr):
        return
    if indptr.numel() == 0:
        raise ValueError(f"{op}: `{name}` must have at least one entry (batch + 1)")
    first, last = int(indptr[0]), int(indptr[-1])
    if first != 0:
        raise ValueError(f"{op}: `{name}` must start at 0, got {first}")
    if indptr.numel() > 1 and bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"{op}: `{name}` must be non-decreasing, got {indptr.tolist()}")
    if last > limit:
        raise ValueError(f"{op}: `{name}` ends at {last}, beyond the {limit} {what}")


def _check_kv_indices(op: str, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_slots: int) -> None:
    check_tensor(op, "kv_indices", kv_indices, ndim=1, dtypes=INDEX_DTYPES)
    _check_indptr(op, "kv_indptr", kv_indptr, kv_indices.shape[0], "entries of `kv_indices`")
    if should_check_values(kv_indptr, kv_indices) and kv_indptr.numel():
        used = kv_indices[: int(kv_indptr[-1])]
        check_slot_indices(op, "kv_indices", used, num_slots, allow_pad=False)


# --------------------------------------------------------------------------------------------
# store_kv_cache
# --------------------------------------------------------------------------------------------


def _check_store(k_cache, v_cache, slots, k, v, k_scale=None, v_scale=None):
    op = "store_kv_cache"
    _check_pool(op, k_cache, v_cache, k_scale, v_scale)
    check_tensor(op, "slots", slots, ndim=1, dtypes=INDEX_DTYPES)
    t = slots.shape[0]
    check_tensor(op, "k", k, dtypes=FLOAT_DTYPES, shape=(t, k_cache.shape[1], k_cache.shape[2]))
    check_tensor(op, "v", v, dtypes=FLOAT_DTYPES, shape=(t, v_cache.shape[1], v_cache.shape[2]))
    check_same_device(op, k_cache=k_cache, v_cache=v_cache, slots=slots, k=k, v=v)
    check_slot_indices(op, "slots", slots, k_cache.shape[0])
    check_unique_slots(op, "slots", slots)


@kernel_op("hybrid_compile::store_kv_cache", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def store_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor],
) -> None:
    """Write the K/V of T new tokens into the pool: ``k_cache[slots[t]] = k[t]``, ``v_cache[slots[t]] = v[t]``.

    Args:
        k_cache: ``[num_slots, Hkv, D]`` fp32/bf16/fp16. **Mutated.**
        v_cache: ``[num_slots, Hkv, Dv]`` fp32/bf16/fp16. **Mutated.**
        slots: ``[T]`` int32/int64 destination slot of each token; -1 = padding token (skipped:
            nothing is written). Non-padding slots must be distinct.
        k: ``[T, Hkv, D]``, v: ``[T, Hkv, Dv]``, fp32/bf16/fp16, cast to the pool dtype. May be
            non-contiguous views (e.g. HF's ``key_states[0].transpose(0, 1)``).
        k_scale, v_scale: ``[num_slots, Hkv]`` fp32 scales of an FP8 ``k_cache`` / ``v_cache``
            (module docstring), **mutated**: each token's heads are quantized with their own scale.
    """
    _check_store(k_cache, v_cache, slots, k, v, k_scale, v_scale)
    if slots.numel() == 0:
        return
    idx = slots.to(torch.int64)
    keep = idx >= 0
    if not bool(keep.all()):
        idx, k, v = idx[keep], k[keep], v[keep]
    write_rows(k_cache, k_scale, idx, k, KV_SCALE_DIM)
    write_rows(v_cache, v_scale, idx, v, KV_SCALE_DIM)


@store_kv_cache.register_fake
def _(k_cache, v_cache, slots, k, v, k_scale=None, v_scale=None):
    _check_store(k_cache, v_cache, slots, k, v, k_scale, v_scale)


# --------------------------------------------------------------------------------------------
# core: one block of queries of one request against a contiguous range of its keys
# --------------------------------------------------------------------------------------------


def _attend(
    qf: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    logit_softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention, batched over a leading dim.

    qf: [N, L, Hkv, G, D] fp32; kf: [N, S, Hkv, D]; vf: [N, S, Hkv, Dv]; visible: [N, L, S] bool.
    Returns o [N, L, Hkv*G, Dv] fp32 and lse [N, L, Hkv*G] fp32 (0 / -inf where nothing is visible).
    """
    n, l, hkv, g, _ = qf.shape
    logits = torch.einsum("nlhgd,nshd->nhgls", qf, kf) * scale
    if logit_softcap > 0.0:
        logits = torch.tanh(logits / logit_softcap) * logit_softcap
    logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [N, Hkv, G, L]; -inf for a row with no visible key
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(logits - lse_safe.unsqueeze(-1))  # exp(-inf) = 0 on masked entries
    o = torch.einsum("nhgls,nshd->nlhgd", p, vf)
    return o.reshape(n, l, hkv * g, vf.shape[-1]), lse.permute(0, 3, 1, 2).reshape(n, l, hkv * g)


# --------------------------------------------------------------------------------------------
# paged_attention_extend
# --------------------------------------------------------------------------------------------


def _check_extend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sliding_window, logit_softcap,
                  k_scale=None, v_scale=None, causal=True, tree_mask=None):
    op = "paged_attention_extend"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _check_pool(op, k_cache, v_cache, k_scale, v_scale)
    _check_heads(op, q, k_cache)
    check_tensor(op, "qo_indptr", qo_indptr, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "kv_indptr", kv_indptr, ndim=1, dtypes=INDEX_DTYPES, shape=(qo_indptr.shape[0],))
    if qo_indptr.shape[0] == 0:
        raise ValueError(f"{op}: `qo_indptr` must have batch + 1 >= 1 entries")
    _check_scalars(op, sliding_window, logit_softcap)
    check_same_device(
        op, q=q, k_cache=k_cache, v_cache=v_cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices
    )
    _check_indptr(op, "qo_indptr", qo_indptr, q.shape[0], "query tokens")
    _check_kv_indices(op, kv_indptr, kv_indices, k_cache.shape[0])
    if should_check_values(qo_indptr, kv_indptr) and qo_indptr.numel() > 1:
        q_lens = qo_indptr[1:] - qo_indptr[:-1]
        kv_lens = kv_indptr[1:] - kv_indptr[:-1]
        bad = (q_lens.to(torch.int64) > kv_lens.to(torch.int64)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"{op}: request(s) {bad} have more query tokens than kv tokens (q_len {q_lens[bad].tolist()} > "
                f"kv_len {kv_lens[bad].tolist()}); the new tokens' K/V must be stored in the pool and listed in "
                f"`kv_indices` before calling extend"
            )
    if tree_mask is not None:
        check_tensor(op, "tree_mask", tree_mask, ndim=1, dtypes=(torch.int64,), shape=(q.shape[0],))
        if not causal:
            raise ValueError(f"{op}: `tree_mask` (a draft tree) needs causal=True")
        if should_check_values(qo_indptr) and qo_indptr.numel() > 1:
            longest = int((qo_indptr[1:] - qo_indptr[:-1]).max())
            if longest > MAX_TREE_TOKENS:
                raise ValueError(f"{op}: `tree_mask` holds one bit per new token: at most {MAX_TREE_TOKENS} new tokens "
                                 f"per request, got {longest}")


def tree_depths(tree_mask: torch.Tensor) -> torch.Tensor:
    """Depth of each draft-tree token from its ``tree_mask`` row (its root path's bit count - 1)."""
    bits = (tree_mask[:, None] >> torch.arange(MAX_TREE_TOKENS, device=tree_mask.device)) & 1
    return bits.sum(-1) - 1


@kernel_op("hybrid_compile::paged_attention_extend", mutates_args=())
def paged_attention_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int = -1,
    logit_softcap: float = 0.0,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    tree_mask: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill / extend attention of packed new tokens over each request's paged KV.

    Request ``b`` has ``q_len = qo_indptr[b+1] - qo_indptr[b]`` new tokens (rows of ``q``) and
    ``kv_len = kv_indptr[b+1] - kv_indptr[b]`` kv tokens (cached prefix + the new tokens, whose
    K/V must already be in the pool, see ``store_kv_cache``), ``kv_len >= q_len`` (checked on
    CPU / in debug mode). Query ``j`` sits at absolute position ``p = kv_len - q_len + j``. It sees
    kv position ``k`` iff ``k <= p`` (when ``causal``) and ``k > p - sliding_window`` (when
    ``sliding_window > 0``): HF ``masking_utils`` semantics, window ``(p - W, p]``. Logits are
    ``scale * q.k``, then ``logit_softcap * tanh(logits / logit_softcap)`` when ``logit_softcap > 0``.
    GQA: query head ``h`` uses kv head ``h // (Hq // Hkv)``.

    Args:
        q: ``[T, Hq, D]`` fp32/bf16/fp16 (may be a non-contiguous view).
        k_cache: ``[num_slots, Hkv, D]``; v_cache: ``[num_slots, Hkv, Dv]``; fp32/bf16/fp16. Read only.
        qo_indptr: ``[B + 1]`` int32/int64, starts at 0, non-decreasing, ``qo_indptr[-1] <= T``;
            rows ``>= qo_indptr[-1]`` are padding (output 0, lse -inf).
        kv_indptr: ``[B + 1]`` int32/int64 into ``kv_indices``.
        kv_indices: ``[>= kv_indptr[-1]]`` int32/int64 slot of each kv token, in position order.
        scale: softmax scale (usually ``D ** -0.5``).
        causal: mask future positions (see above). Non-causal: every query sees all kv tokens
            (within the window if any).
        sliding_window: ``W > 0`` limits attention to the last ``W`` positions; ``<= 0`` = off.
        logit_softcap: ``> 0`` caps the logits (Gemma-2 style); 0 = off.
        k_scale, v_scale: ``[num_slots, Hkv]`` fp32 scales of an FP8 KV cache; None for a float one.
        tree_mask: optional ``[T]`` int64: a speculative draft TREE. Bit ``i`` of row ``j``'s mask
            says whether query ``j`` of its request sees that request's new token ``i`` (its
            ancestors and itself); every query still sees the whole cached prefix
            (``kv_len - q_len`` tokens). At most 64 new tokens per request; causal. A tree token's
            position is ``kv_len - q_len`` plus its depth (its mask's bit count - 1), not its
            row: a sliding window counts back from there, over the prefix's positions and its
            ancestors' (the positions the accepted path's tokens take).

    Returns:
        ``o``: ``[T, Hq, Dv]`` in ``q.dtype``; ``lse``: ``[T, Hq]`` fp32 natural-log log-sum-exp of
        the (scaled, capped) visible logits. Both fresh tensors.
    """
    _check_extend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sliding_window, logit_softcap,
                  k_scale, v_scale, causal, tree_mask)
    t, hq, _ = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    g = hq // hkv
    o = torch.zeros(t, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=q.device)
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    kv_indices = kv_indices.to(torch.int64)
    for b in range(len(qo) - 1):
        q0, q_len = qo[b], qo[b + 1] - qo[b]
        k0, kv_len = kvp[b], kvp[b + 1] - kvp[b]
        if q_len == 0:
            continue
        first_pos = kv_len - q_len
        # a tree with a window: each new token at first_pos + its depth (window positions only)
        tree_pos = (None if tree_mask is None or sliding_window <= 0
                    else first_pos + tree_depths(tree_mask[q0 : q0 + q_len]))
        # query block size keeping the logits of one block within budget
        block = max(1, _LOGITS_BUDGET // max(1, hq * kv_len))
        for j0 in range(0, q_len, block):
            j1 = min(q_len, j0 + block)
            p0, p1 = first_pos + j0, first_pos + j1 - 1  # first/last absolute query position
            # contiguous key range any query of the block can see (a tree's tokens: from first_pos on)
            lo = max(0, (p0 if tree_pos is None else first_pos) - sliding_window + 1) if sliding_window > 0 else 0
            hi = p1 + 1 if causal else kv_len
            hi = min(hi, kv_len)
            lo = min(lo, hi)
            idx = kv_indices[k0 + lo : k0 + hi]
            kf = read_rows(k_cache, k_scale, idx, KV_SCALE_DIM)
            vf = read_rows(v_cache, v_scale, idx, KV_SCALE_DIM)
            qpos = torch.arange(p0, p1 + 1, device=q.device)
            kpos = torch.arange(lo, hi, device=q.device)
            visible = torch.ones(j1 - j0, hi - lo, dtype=torch.bool, device=q.device)
            if causal:
                visible &= kpos[None, :] <= qpos[:, None]
            if sliding_window > 0 and tree_pos is None:
                visible &= kpos[None, :] > qpos[:, None] - sliding_window
            elif sliding_window > 0:
                wq = tree_pos[j0:j1]
                wk = torch.where(kpos >= first_pos, tree_pos[(kpos - first_pos).clamp(0, q_len - 1)], kpos)
                visible &= wk[None, :] > wq[:, None] - sliding_window
            if tree_mask is not None:  # new tokens: only the query's ancestors (its mask bits)
                rel = kpos - first_pos
                bits = tree_mask[q0 + j0 : q0 + j1, None] >> rel.clamp(0, MAX_TREE_TOKENS - 1)[None, :]
                visible &= (rel[None, :] < 0) | (bits & 1).bool()
            qf = q[q0 + j0 : q0 + j1].float().reshape(j1 - j0, hkv, g, -1)
            ob, lb = _attend(qf[None], kf[None], vf[None], visible[None], scale, logit_softcap)
            o[q0 + j0 : q0 + j1] = ob[0].to(q.dtype)
            lse[q0 + j0 : q0 + j1] = lb[0]
    return o, lse


@paged_attention_extend.register_fake
def _(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale, causal=True, sliding_window=-1, logit_softcap=0.0,
      k_scale=None, v_scale=None, tree_mask=None):
    _check_extend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sliding_window, logit_softcap,
                  k_scale, v_scale, causal, tree_mask)
    t, hq, _ = q.shape
    return q.new_empty(t, hq, v_cache.shape[2]), q.new_empty(t, hq, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# paged_attention_decode
# --------------------------------------------------------------------------------------------


def _check_decode(q, k_cache, v_cache, kv_indptr, kv_indices, sliding_window, logit_softcap, k_scale=None,
                  v_scale=None):
    op = "paged_attention_decode"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    _check_pool(op, k_cache, v_cache, k_scale, v_scale)
    _check_heads(op, q, k_cache)
    check_tensor(op, "kv_indptr", kv_indptr, ndim=1, dtypes=INDEX_DTYPES, shape=(q.shape[0] + 1,))
    _check_scalars(op, sliding_window, logit_softcap)
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, kv_indptr=kv_indptr, kv_indices=kv_indices)
    _check_kv_indices(op, kv_indptr, kv_indices, k_cache.shape[0])


@kernel_op("hybrid_compile::paged_attention_decode", mutates_args=())
def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    logit_softcap: float = 0.0,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention: one query per request over all of its kv tokens.

    Row ``b``'s query is at position ``kv_len - 1`` (its own K/V already stored and listed last), so
    it sees every kv token, or with ``sliding_window = W > 0`` the last ``W`` of them. Logits,
    softcap and GQA as in :func:`paged_attention_extend`; this equals the last row of an extend.

    Args:
        q: ``[B, Hq, D]`` fp32/bf16/fp16 (may be a non-contiguous view).
        k_cache: ``[num_slots, Hkv, D]``; v_cache: ``[num_slots, Hkv, Dv]``; fp32/bf16/fp16. Read only.
        kv_indptr: ``[B + 1]`` int32/int64 into ``kv_indices``. A row with ``kv_len == 0`` is a
            padding row (CUDA-graph batch padding): output 0, lse -inf.
        kv_indices: ``[>= kv_indptr[-1]]`` int32/int64 slots, in position order.
        scale, sliding_window, logit_softcap, k_scale, v_scale: as in :func:`paged_attention_extend`.

    Returns:
        ``o``: ``[B, Hq, Dv]`` in ``q.dtype``; ``lse``: ``[B, Hq]`` fp32 (natural log).
    """
    _check_decode(q, k_cache, v_cache, kv_indptr, kv_indices, sliding_window, logit_softcap, k_scale, v_scale)
    bsz, hq, d = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    g = hq // hkv
    o = torch.zeros(bsz, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((bsz, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if bsz == 0:
        return o, lse
    kv_indices = kv_indices.to(torch.int64)
    starts = kv_indptr[:-1].to(torch.int64)
    lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    if sliding_window > 0:  # only the last W tokens are visible: shift the start
        skip = (lens - sliding_window).clamp(min=0)
        starts, lens = starts + skip, lens - skip
    lens_list = lens.tolist()
    # padded batches of consecutive requests, each within the logits/gather budget
    per_token = hq + hkv * (d + dv)
    b0 = 0
    while b0 < bsz:
        b1, s_max = b0, 0
        while b1 < bsz:
            s_new = max(s_max, lens_list[b1])
            if b1 > b0 and (b1 - b0 + 1) * s_new * per_token > _LOGITS_BUDGET:
                break
            s_max, b1 = s_new, b1 + 1
        if s_max > 0:
            pos = torch.arange(s_max, device=q.device)
            visible = pos[None, :] < lens[b0:b1, None]  # [n, S]
            gather = (starts[b0:b1, None] + pos[None, :]).clamp(max=kv_indices.numel() - 1)
            slots = torch.where(visible, kv_indices[gather], 0)  # masked entries read slot 0, ignored
            kf = k_cache[slots].float()  # [n, S, Hkv, D]
            vf = v_cache[slots].float()
            if is_fp8(k_cache):
                kf = dequantize_vectors(k_cache[slots], k_scale[slots], KV_SCALE_DIM)
            if is_fp8(v_cache):
                vf = dequantize_vectors(v_cache[slots], v_scale[slots], KV_SCALE_DIM)
            qf = q[b0:b1].float().reshape(b1 - b0, 1, hkv, g, d)
            ob, lb = _attend(qf, kf, vf, visible[:, None, :], scale, logit_softcap)
            o[b0:b1] = ob[:, 0].to(q.dtype)
            lse[b0:b1] = lb[:, 0]
        b0 = b1
    return o, lse


@paged_attention_decode.register_fake
def _(q, k_cache, v_cache, kv_indptr, kv_indices, scale, sliding_window=-1, logit_softcap=0.0, k_scale=None,
      v_scale=None):
    _check_decode(q, k_cache, v_cache, kv_indptr, kv_indices, sliding_window, logit_softcap, k_scale, v_scale)
    bsz, hq, _ = q.shape
    return q.new_empty(bsz, hq, v_cache.shape[2]), q.new_empty(bsz, hq, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# merge_attention_states
# --------------------------------------------------------------------------------------------


def _check_merge(o_a, lse_a, o_b, lse_b):
    op = "merge_attention_states"
    check_tensor(op, "o_a", o_a, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "o_b", o_b, dtypes=(o_a.dtype,), shape=tuple(o_a.shape))
    check_tensor(op, "lse_a", lse_a, dtypes=(torch.float32,), shape=tuple(o_a.shape[:2]))
    check_tensor(op, "lse_b", lse_b, dtypes=(torch.float32,), shape=tuple(o_a.shape[:2]))
    check_same_device(op, o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)


@kernel_op("hybrid_compile::merge_attention_states", mutates_args=())
def merge_attention_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets (cascade / split-KV ``merge_state``).

    With ``m = max(lse_a, lse_b)``, ``w_x = exp(lse_x - m)``:
    ``o = (w_a * o_a + w_b * o_b) / (w_a + w_b)``, ``lse = m + log(w_a + w_b)``.
    A side with lse ``-inf`` (no visible key) contributes nothing; if both are ``-inf`` the row
    is 0 with lse ``-inf`` (never NaN).

    Args:
        o_a, o_b: ``[T, H, Dv]`` same dtype (fp32/bf16/fp16), as returned by the attention ops.
        lse_a, lse_b: ``[T, H]`` fp32 natural-log log-sum-exps.

    Returns:
        ``o``: ``[T, H, Dv]`` in ``o_a.dtype``; ``lse``: ``[T, H]`` fp32. Fresh tensors.
    """
    _check_merge(o_a, lse_a, o_b, lse_b)
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w_a = torch.exp(lse_a - m_safe)  # exp(-inf) = 0 for an empty side
    w_b = torch.exp(lse_b - m_safe)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total.clamp(min=torch.finfo(torch.float32).tiny), torch.zeros_like(total))
    o = (o_a.float() * (w_a * inv).unsqueeze(-1) + o_b.float() * (w_b * inv).unsqueeze(-1)).to(o_a.dtype)
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    return o, lse


@merge_attention_states.register_fake
def _(o_a, lse_a, o_b, lse_b):
    _check_merge(o_a, lse_a, o_b, lse_b)
    return torch.empty_like(o_a), torch.empty_like(lse_a)
