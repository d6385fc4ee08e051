"""Gated DeltaNet (Qwen3-Next linear attention) kernel ops; with a per-channel gate also Kimi Delta
Attention (Kimi-Linear).

Math (transformers' ``torch_recurrent_gated_delta_rule``), per value head ``h`` with an fp32
state ``S [K, V]`` and, per token ``t``::

    q_t, k_t  <- l2norm(q_t), l2norm(k_t)        (optional; x * rsqrt(sum(x^2) + 1e-6))
    q_t       <- q_t * scale                      (default scale = K ** -0.5)
    S         <- S * exp(g_t)                   (g_t per head; or per key channel, Kimi Delta
                                                  Attention: row k of S by exp(g_t[k]))
    delta     <- (v_t - k_t^T S) * beta_t
    S         <- S + k_t (outer) delta
    o_t       <- q_t^T S

Grouped heads: ``Hv`` is a multiple of ``Hk``; q/k head ``i`` serves the consecutive value
heads ``i*r .. i*r+r-1`` with ``r = Hv // Hk`` (``repeat_interleave``, as in transformers).

Gating (``Qwen3NextGatedDeltaNet.forward``): ``g = -exp(A_log) * softplus(a + dt_bias)``,
``beta = sigmoid(b)``, all in fp32.

Ops:

- ``gdn_gating``                              g / beta from the projections.
- ``chunk_gated_delta_rule``                  varlen prefill/extend, chunked (WY / UT form).
- ``fused_sigmoid_gating_delta_rule_update``  decode: one token per request, gating fused.
- ``fused_recurrent_gated_delta_rule_update`` speculative verify: L tokens per request,
                                              optional per-step state buffer.

State pool: ``ssm_states [num_slots, Hv, K, V]`` (fp32/bf16/fp16; read and computed in fp32,
cast on write; or float8_e4m3fn with ``ssm_scales [num_slots, Hv, V]``, dequantized on read and
quantized on write, :mod:`.fp8_cache`). Slot index -1 marks a padding row: no state read or write, zero outputs.

The CPU implementations below are plain torch and also serve the CUDA dispatch until Triton
kernels are registered for "cuda" on the same ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._validation import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_slot_indices,
    check_tensor,
    check_tree_parents,
    check_unique_slots,
    check_varlen_requests,
    check_varlen_values,
    tree_start_states,
)
from ._varlen import chunk_row_offsets, max_chunk_rows
from .fp8_cache import FP8_DTYPE, GDN_STATE_SCALE_DIM, check_scales, is_fp8, read_rows, round_trip, write_rows
from .registration import kernel_op

#: Chunk length of the chunked scan; chunk boundaries (and so ``chunk_states`` rows) are
#: aligned to each request's first new token. The prefix cache relies on this value.
GDN_CHUNK_SIZE = 64

_L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------
# shared math helpers (fp32)
# ----------------------------------------------------------------------------------------------


def _resolve_scale(scale: float, head_k_dim: int) -> float:
    return float(scale) if scale > 0 else float(head_k_dim) ** -0.5


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _L2NORM_EPS)


def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool, scale: float):
    """fp32 q/k (heads on dim -2) expanded to the value heads, normalised and scaled."""
    q = q.float()
    k = k.float()
    if use_qk_l2norm:
        q = _l2norm(q)
        k = _l2norm(k)
    q = q * _resolve_scale(scale, q.shape[-1])
    rep = num_v_heads // k.shape[-2]
    if rep != 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k


def _gating(A_log, a, b, dt_bias, softplus_beta: float, softplus_threshold: float):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); fp32, broadcasting over heads."""
    x = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def _recurrent_step(state, q_t, k_t, v_t, g_t, beta_t):
    """One delta-rule step for a batch of rows. state [N, H, K, V]; q_t/k_t [N, H, K];
    v_t [N, H, V]; g_t [N, H] or [N, H, K]; beta_t [N, H] (all fp32). Returns (o_t [N, H, V], new state)."""
    state = state * (torch.exp(g_t)[..., None, None] if g_t.dim() == 2 else torch.exp(g_t)[..., None])
    kv_mem = torch.einsum("nhk,nhkv->nhv", k_t, state)
    delta = (v_t - kv_mem) * beta_t[..., None]
    state = state + k_t[..., :, None] * delta[..., None, :]
    o_t = torch.einsum("nhk,nhkv->nhv", q_t, state)
    return o_t, state


def _check_heads(op: str, num_k_heads: int, num_v_heads: int) -> None:
    if num_k_heads == 0 or num_v_heads % num_k_heads != 0:
        raise ValueError(
            f"{op}: the number of value heads ({num_v_heads}) must be a multiple of the number of "
            f"query/key heads ({num_k_heads})"
        )


def _check_pool(op: str, ssm_states: torch.Tensor, hv: int, kd: int, vd: int,
                ssm_scales: Optional[torch.Tensor] = None) -> None:
    check_tensor(op, "ssm_states", ssm_states, ndim=4, dtypes=STATE_DTYPES)
    if tuple(ssm_states.shape[1:]) != (hv, kd, vd):
        raise ValueError(
            f"{op}: `ssm_states` has shape {tuple(ssm_states.shape)}, expected [num_slots, {hv}, {kd}, {vd}] "
            f"(num_v_heads, head_k_dim, head_v_dim)"
        )
    check_scales(op, ssm_states, ssm_scales, "ssm_scales", GDN_STATE_SCALE_DIM)


def _check_gate(op: str, g: torch.Tensor, lead: tuple, hv: int, kd: int) -> None:
    """``g`` is ``[*lead, Hv]`` (one log-decay per head, Gated DeltaNet) or ``[*lead, Hv, K]``
    (one per head and key channel, Kimi Delta Attention)."""
    shape = (*lead, hv) if g.dim() == len(lead) + 1 else (*lead, hv, kd)
    check_tensor(op, "g", g, dtypes=FLOAT_DTYPES, shape=shape)


#: State pool dtypes: float, or e4m3 with one fp32 scale per (slot, head, value column) over K
#: (``ssm_scales [num_slots, Hv, V]``, :mod:`.fp8_cache`).
STATE_DTYPES = FLOAT_DTYPES + (FP8_DTYPE,)


# ----------------------------------------------------------------------------------------------
# gdn_gating
# ----------------------------------------------------------------------------------------------


def _check_gdn_gating(A_log, a, b, dt_bias):
    op = "gdn_gating"
    check_tensor(op, "a", a, ndim=2, dtypes=FLOAT_DTYPES)
    t, hv = a.shape
    check_tensor(op, "b", b, dtypes=FLOAT_DTYPES, shape=(t, hv))
    check_tensor(op, "A_log", A_log, dtypes=FLOAT_DTYPES, shape=(hv,))
    check_tensor(op, "dt_bias", dt_bias, dtypes=FLOAT_DTYPES, shape=(hv,))
    check_same_device(op, A_log=A_log, a=a, b=b, dt_bias=dt_bias)


@kernel_op("hybrid_compile::gdn_gating", mutates_args=())
def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay and write strength of the gated delta rule.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, computed in fp32.
    ``softplus(x) = log(1 + exp(softplus_beta * x)) / softplus_beta``, and the identity where
    ``softplus_beta * x > softplus_threshold`` (exactly ``torch.nn.functional.softplus``).

    Args:
        A_log: ``[Hv]`` log of the per-head decay rate, any float dtype.
        a: ``[T, Hv]`` decay projection, any float dtype (may be a strided view).
        b: ``[T, Hv]`` beta projection, any float dtype.
        dt_bias: ``[Hv]`` time-step bias, any float dtype.
        softplus_beta, softplus_threshold: softplus parameters (transformers uses 1.0, 20.0).

    Returns:
        ``(g, beta)``, both ``[T, Hv]`` fp32, fresh contiguous tensors. Nothing is mutated.
    """
    _check_gdn_gating(A_log, a, b, dt_bias)
    g, beta = _gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    return g.contiguous(), beta.contiguous()


@gdn_gating.register_fake
def _(A_log, a, b, dt_bias, softplus_beta=1.0, softplus_threshold=20.0):
    _check_gdn_gating(A_log, a, b, dt_bias)
    return a.new_empty(a.shape, dtype=torch.float32), a.new_empty(a.shape, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# chunk_gated_delta_rule (varlen prefill / extend)
# ----------------------------------------------------------------------------------------------


def _check_chunk(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales=None):
    op = "chunk_gated_delta_rule"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    t, hk, kd = q.shape
    check_tensor(op, "k", k, dtypes=FLOAT_DTYPES, shape=(t, hk, kd))
    check_tensor(op, "v", v, ndim=3, dtypes=FLOAT_DTYPES)
    if v.shape[0] != t:
        raise ValueError(f"{op}: `v` has {v.shape[0]} tokens, `q` has {t}")
    hv, vd = v.shape[1], v.shape[2]
    _check_heads(op, hk, hv)
    _check_gate(op, g, (t,), hv, kd)
    check_tensor(op, "beta", beta, dtypes=FLOAT_DTYPES, shape=(t, hv))
    _check_pool(op, ssm_states, hv, kd, vd, ssm_scales)
    check_varlen_requests(op, cu_seqlens, state_indices, has_initial_state)
    check_same_device(
        op, q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, cu_seqlens=cu_seqlens,
        state_indices=state_indices, has_initial_state=has_initial_state,
    )
    check_varlen_values(op, cu_seqlens, t, state_indices, ssm_states.shape[0])


@kernel_op("hybrid_compile::chunk_gated_delta_rule", mutates_args=("ssm_states", "ssm_scales"))
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float,
    output_chunk_states: bool,
    ssm_scales: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over a packed batch of variable-length requests (prefill / extend).

    Computed chunk-wise (chunks of ``GDN_CHUNK_SIZE`` tokens aligned to each request's first
    token, WY/UT-transform form as in transformers' ``torch_chunk_gated_delta_rule``); the
    result equals the per-token recurrence (module docstring).

    Args:
        q, k: ``[T, Hk, K]`` queries / keys, float (may be strided views of one projection).
        v: ``[T, Hv, V]`` values, float; ``Hv`` a multiple of ``Hk``.
        g: ``[T, Hv]`` log-decay (<= 0), float (normally fp32 from ``gdn_gating``), or ``[T, Hv, K]``
            one log-decay per key channel (Kimi Delta Attention: row ``k`` of the state decays by
            ``exp(g[t, h, k])``).
        beta: ``[T, Hv]`` write strength, float.
        ssm_states: ``[num_slots, Hv, K, V]`` fp32/bf16/fp16 state pool. **Mutated**: the final
            state of request ``b`` is written to slot ``state_indices[b]`` (cast to the pool
            dtype). A zero-length request leaves its slot untouched.
        cu_seqlens: ``[B + 1]`` int32/int64 request boundaries in the packed token dim.
        state_indices: ``[B]`` int32/int64 slot of each request; -1 = padding request (no state
            read or write, zero output, zero ``chunk_states`` rows).
        has_initial_state: ``[B]`` bool; True starts from the slot's state, False from zeros.
        use_qk_l2norm: L2-normalise q and k per head (``x * rsqrt(sum(x^2) + 1e-6)``) first.
        scale: query scale; ``scale <= 0`` means the default ``K ** -0.5``.
        output_chunk_states: also return the state at the start of every chunk.
        ssm_scales: ``[num_slots, Hv, V]`` fp32 when ``ssm_states`` is float8_e4m3fn (one scale per
            value column over K, :mod:`.fp8_cache`): the state is dequantized on read and
            re-quantized on write. **Mutated** with the slot. None for a float pool.

    Returns:
        ``(o, chunk_states)``. ``o``: ``[T, Hv, V]`` in ``v.dtype``. ``chunk_states``: when
        requested, fp32 ``[max_chunk_rows(T, B, GDN_CHUNK_SIZE), Hv, K, V]`` laid out as
        ``_varlen.py`` describes (row ``chunk_row_offsets[b] + j`` = state of request ``b``
        after ``j * GDN_CHUNK_SIZE`` tokens, i.e. before its chunk ``j``; unused rows zero);
        otherwise an empty ``[0, Hv, K, V]`` fp32 tensor.
    """
    _check_chunk(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales)
    T, hk, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    C = GDN_CHUNK_SIZE
    dev = v.device
    batch = state_indices.shape[0]
    o = torch.zeros(T, hv, vd, dtype=v.dtype, device=dev)
    n_rows = max_chunk_rows(T, batch, C) if output_chunk_states else 0
    chunk_states = torch.zeros(n_rows, hv, kd, vd, dtype=torch.float32, device=dev)

    cu = [int(x) for x in cu_seqlens.tolist()]
    slots = [int(x) for x in state_indices.tolist()]
    row_off = chunk_row_offsets(cu_seqlens, C).tolist()
    # Active requests: a real slot and at least one token.
    act = [i for i in range(batch) if slots[i] >= 0 and cu[i + 1] > cu[i]]
    if not act:
        return o, chunk_states

    # ---- chunk table over the active requests --------------------------------------------
    n_chunks = [(cu[i + 1] - cu[i] + C - 1) // C for i in act]
    first_chunk = []  # index of each active request's first chunk in the chunk table
    starts, lens = [], []
    for i, n in zip(act, n_chunks):
        first_chunk.append(len(starts))
        for j in range(n):
            s = cu[i] + j * C
            starts.append(s)
            lens.append(min(C, cu[i + 1] - s))
    N = len(starts)
    pos = torch.arange(C, device=dev)
    starts_t = torch.tensor(starts, dtype=torch.int64, device=dev)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    valid = pos[None, :] < lens_t[:, None]  # [N, C]
    tok = torch.where(valid, starts_t[:, None] + pos[None, :], torch.full_like(valid, T, dtype=torch.int64))

    def gather(x: torch.Tensor) -> torch.Tensor:
        # [T, ...] -> [N, C, ...], zero at the padded tail of each chunk (index T = zero row).
        xp = torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))], 0)
        return xp[tok]

    qf, kf = _prep_qk(q, k, hv, use_qk_l2norm, scale)  # [T, Hv, K] fp32
    qc = gather(qf).permute(0, 2, 1, 3)  # [N, H, C, K]
    kc = gather(kf).permute(0, 2, 1, 3)
    vc = gather(v.float()).permute(0, 2, 1, 3)  # [N, H, C, V]
    per_channel = g.dim() == 3  # Kimi Delta Attention: one decay per key channel
    # [N, H, C] (per head) or [N, H, C, K]; padded tail: g = 0 (no decay)
    gc = gather(g.float()).transpose(1, 2)
    bc = gather(beta.float()).permute(0, 2, 1)  # padded tail: beta = 0 (no write)

    # ---- intra-chunk part (all chunks at once) ---------------------------------------------
    # cum: log of the decay from the chunk start through position i; the per-head case gets a
    # trailing key dim of 1 so that both share the formulas below.
    cum = gc.cumsum(2) if per_channel else gc.cumsum(-1)[..., None]  # [N, H, C, K or 1]
    upper = torch.ones(C, C, dtype=torch.bool, device=dev).triu(1)
    k_beta = kc * bc[..., None]
    v_beta = vc * bc[..., None]
    if per_channel:
        ut, attn = _per_channel_products(k_beta, qc, kc, cum, upper)
    else:
        decay_ij = (cum[..., :, None, 0] - cum[..., None, :, 0]).masked_fill(upper, float("-inf")).exp()  # [N,H,C,C]
        ut = (k_beta @ kc.transpose(-1, -2)) * decay_ij
        attn = (qc @ kc.transpose(-1, -2)) * decay_ij  # [N,H,C,C], lower incl. diagonal
    # (I + strictly_lower(beta_i k_i.k_j decay_ij)) is unit lower triangular.
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)  # [N,H,C,V]
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp(), upper=False, unitriangular=True)
    q_dec = qc * cum.exp()
    last = cum[..., -1:, :]  # [N, H, 1, K or 1]; the padded tail adds nothing: the chunk's total
    k_dec = kc * (last - cum).exp()
    chunk_decay = last.transpose(-1, -2).exp()  # [N, H, K or 1, 1]: rows of the state

    # ---- inter-chunk scan: loop over chunk position, batched over requests ------------------
    act_t = torch.tensor(act, dtype=torch.int64, device=dev)
    slot_t = state_indices.to(torch.int64)[act_t]
    init = has_initial_state[act_t]
    state = read_rows(ssm_states, ssm_scales, slot_t, GDN_STATE_SCALE_DIM)
    state = torch.where(init[:, None, None, None], state, torch.zeros_like(state))  # [A, H, K, V]
    before = torch.empty(N, hv, kd, vd, dtype=torch.float32, device=dev)  # state before each chunk
    v_new = torch.empty_like(u)
    first_t = torch.tensor(first_chunk, dtype=torch.int64, device=dev)
    nch_t = torch.tensor(n_chunks, dtype=torch.int64, device=dev)
    for j in range(max(n_chunks)):
        live = [a for a in range(len(act)) if n_chunks[a] > j]
        if len(live) == len(act):
            rows = None
            ids = first_t + j
            s = state
        else:
            rows = torch.tensor(live, dtype=torch.int64, device=dev)
            ids = first_t[rows] + j
            s = state[rows]
        before[ids] = s
        vn = u[ids] - w[ids] @ s
        v_new[ids] = vn
        s = s * chunk_decay[ids] + k_dec[ids].transpose(-1, -2) @ vn
        if rows is None:
            state = s
        else:
            state[rows] = s

    out = q_dec @ before + attn @ v_new  # [N, H, C, V]
    out = out.permute(0, 2, 1, 3)[valid]  # [num valid tokens, H, V], in chunk-table order
    o.index_copy_(0, tok[valid], out.to(v.dtype))
    write_rows(ssm_states, ssm_scales, slot_t, state, GDN_STATE_SCALE_DIM)

    if output_chunk_states:
        offs = torch.tensor([row_off[i] for i in act], dtype=torch.int64, device=dev)
        # chunk-table row of (request a, chunk j) is first_chunk[a] + j -> row_off + j
        rel = torch.arange(N, device=dev) - torch.repeat_interleave(first_t, nch_t)
        dst = torch.repeat_interleave(offs, nch_t) + rel
        chunk_states.index_copy_(0, dst, before)
    return o, chunk_states


@chunk_gated_delta_rule.register_fake
def _(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state, use_qk_l2norm, scale,
      output_chunk_states, ssm_scales=None):
    _check_chunk(q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state, ssm_scales)
    T = q.shape[0]
    hv, vd = v.shape[1], v.shape[2]
    kd = q.shape[2]
    batch = state_indices.shape[0]
    n_rows = max_chunk_rows(T, batch, GDN_CHUNK_SIZE) if output_chunk_states else 0
    o = v.new_empty((T, hv, vd))
    chunk_states = v.new_empty((n_rows, hv, kd, vd), dtype=torch.float32)
    return o, chunk_states


def _per_channel_products(k_beta, qc, kc, cum, upper, max_elements=1 << 24):
    """``(ut, attn)`` ``[N, H, C, C]`` of the chunked scan with a per-channel decay:
    ``sum_k k_beta_ik k_jk exp(cum_ik - cum_jk)`` and the same with ``q``, for ``j <= i`` (0 above).

    The decay differs per key channel, so it sits inside the sum over K: a ``[n, H, C, C, K]``
    tensor, formed as differences (``exp(cum_i - cum_j) <= 1``; ``exp(cum_i) * exp(-cum_j)`` would
    overflow) for a slice of ``n`` chunks at a time (at most ``max_elements`` values)."""
    N, H, C, K = kc.shape
    ut = kc.new_empty(N, H, C, C)
    attn = kc.new_empty(N, H, C, C)
    step = max(1, max_elements // max(1, H * C * C * K))
    for a in range(0, N, step):
        b = min(N, a + step)
        c = cum[a:b]
        decay = (c[..., :, None, :] - c[..., None, :, :]).masked_fill(upper[..., None], float("-inf")).exp()
        kd = kc[a:b, :, None, :, :] * decay  # [n, H, C(i), C(j), K]
        ut[a:b] = (k_beta[a:b, :, :, None, :] * kd).sum(-1)
        attn[a:b] = (qc[a:b, :, :, None, :] * kd).sum(-1)
    return ut, attn


# ----------------------------------------------------------------------------------------------
# shared by the decode and verify ops
# ----------------------------------------------------------------------------------------------


def _gather_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _valid_rows(state_indices: torch.Tensor):
    """(rows, slots): rows = None when every row is real, else the int64 indices of real rows."""
    idx = state_indices.to(torch.int64)
    keep = idx >= 0
    if bool(keep.all()):
        return None, idx
    rows = keep.nonzero().flatten()
    return rows, idx[rows]


# ----------------------------------------------------------------------------------------------
# fused_sigmoid_gating_delta_rule_update (decode)
# ----------------------------------------------------------------------------------------------


def _check_decode(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, ssm_scales=None):
    op = "fused_sigmoid_gating_delta_rule_update"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    bs, hk, kd = q.shape
    check_tensor(op, "k", k, dtypes=FLOAT_DTYPES, shape=(bs, hk, kd))
    check_tensor(op, "v", v, ndim=3, dtypes=FLOAT_DTYPES)
    if v.shape[0] != bs:
        raise ValueError(f"{op}: `v` has batch {v.shape[0]}, `q` has {bs}")
    hv, vd = v.shape[1], v.shape[2]
    _check_heads(op, hk, hv)
    check_tensor(op, "a", a, dtypes=FLOAT_DTYPES, shape=(bs, hv))
    check_tensor(op, "b", b, dtypes=FLOAT_DTYPES, shape=(bs, hv))
    check_tensor(op, "A_log", A_log, dtypes=FLOAT_DTYPES, shape=(hv,))
    check_tensor(op, "dt_bias", dt_bias, dtypes=FLOAT_DTYPES, shape=(hv,))
    _check_pool(op, ssm_states, hv, kd, vd, ssm_scales)
    check_tensor(op, "state_indices", state_indices, dtypes=INDEX_DTYPES, shape=(bs,))
    check_same_device(
        op, A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=ssm_states,
        state_indices=state_indices,
    )
    check_slot_indices(op, "state_indices", state_indices, ssm_states.shape[0])
    check_unique_slots(op, "state_indices", state_indices)


@kernel_op(
    "hybrid_compile::fused_sigmoid_gating_delta_rule_update", mutates_args=("ssm_states", "ssm_scales")
)
def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float,
    softplus_beta: float,
    softplus_threshold: float,
    ssm_scales: Optional[torch.Tensor],
) -> torch.Tensor:
    """Decode step: gating (as ``gdn_gating``) fused with one delta-rule step per request.

    Args:
        A_log, dt_bias: ``[Hv]`` gating parameters, float.
        q, k: ``[B, Hk, K]`` float (one token per request; may be strided views).
        v: ``[B, Hv, V]`` float.
        a, b: ``[B, Hv]`` raw gating projections, float.
        ssm_states: ``[num_slots, Hv, K, V]`` fp32/bf16/fp16 pool. **Mutated**: slot
            ``state_indices[b]`` is read, advanced one token and written back in place.
        state_indices: ``[B]`` int32/int64; -1 = padding row (no read/write, zero output).
        use_qk_l2norm: L2-normalise q and k first (eps 1e-6).
        scale: query scale; ``scale <= 0`` means ``K ** -0.5``.
        softplus_beta, softplus_threshold: as in ``gdn_gating``.
        ssm_scales: ``[num_slots, Hv, V]`` fp32 scales of an FP8 pool (as in
            ``chunk_gated_delta_rule``), **mutated** with the slot; None for a float pool.

    Returns:
        ``o``: ``[B, Hv, V]`` in ``v.dtype``.
    """
    _check_decode(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, ssm_scales)
    bs, hv, vd = v.shape
    o = torch.zeros(bs, hv, vd, dtype=v.dtype, device=v.device)
    if bs == 0:
        return o
    rows, slots = _valid_rows(state_indices)
    if slots.numel() == 0:
        return o
    g, beta = _gating(A_log, _gather_rows(a, rows), _gather_rows(b, rows), dt_bias, softplus_beta, softplus_threshold)
    qf, kf = _prep_qk(_gather_rows(q, rows), _gather_rows(k, rows), hv, use_qk_l2norm, scale)
    state = read_rows(ssm_states, ssm_scales, slots, GDN_STATE_SCALE_DIM)
    out, state = _recurrent_step(state, qf, kf, _gather_rows(v, rows).float(), g, beta)
    write_rows(ssm_states, ssm_scales, slots, state, GDN_STATE_SCALE_DIM)
    if rows is None:
        o.copy_(out)
    else:
        o.index_copy_(0, rows, out.to(v.dtype))
    return o


@fused_sigmoid_gating_delta_rule_update.register_fake
def _(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, use_qk_l2norm, scale, softplus_beta,
      softplus_threshold, ssm_scales=None):
    _check_decode(A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, ssm_scales)
    return v.new_empty(v.shape)


# ----------------------------------------------------------------------------------------------
# fused_recurrent_gated_delta_rule_update (speculative verify)
# ----------------------------------------------------------------------------------------------


def _check_verify(q, k, v, g, beta, ssm_states, state_indices, intermediate_states, ssm_scales=None,
                  intermediate_scales=None, disable_state_update=True, parent_indices=None, A_log=None, dt_bias=None):
    op = "fused_recurrent_gated_delta_rule_update"
    if (A_log is None) != (dt_bias is None):
        raise ValueError(f"{op}: `A_log` and `dt_bias` (the gating of raw `g` / `beta` projections) come together")
    if A_log is not None:
        hv = v.shape[2] if v.dim() == 4 else -1
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            check_tensor(op, name, t, dtypes=FLOAT_DTYPES, shape=(hv,))
        if g.dim() != 3:
            raise ValueError(f"{op}: with `A_log` / `dt_bias`, `g` is the raw decay projection [B, L, Hv] "
                             f"(a per-channel gate is not gated here), got {tuple(g.shape)}")
    check_tensor(op, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    bs, steps, hk, kd = q.shape
    check_tensor(op, "k", k, dtypes=FLOAT_DTYPES, shape=(bs, steps, hk, kd))
    check_tensor(op, "v", v, ndim=4, dtypes=FLOAT_DTYPES)
    if v.shape[0] != bs or v.shape[1] != steps:
        raise ValueError(f"{op}: `v` has shape {tuple(v.shape)}, expected [{bs}, {steps}, Hv, V] like `q`")
    hv, vd = v.shape[2], v.shape[3]
    _check_heads(op, hk, hv)
    _check_gate(op, g, (bs, steps), hv, kd)
    check_tensor(op, "beta", beta, dtypes=FLOAT_DTYPES, shape=(bs, steps, hv))
    _check_pool(op, ssm_states, hv, kd, vd, ssm_scales)
    check_tensor(op, "state_indices", state_indices, dtypes=INDEX_DTYPES, shape=(bs,))
    if intermediate_states is None and intermediate_scales is not None:
        raise ValueError(f"{op}: `intermediate_scales` without `intermediate_states`")
    if intermediate_states is not None:
        check_tensor(op, "intermediate_states", intermediate_states, ndim=5, dtypes=STATE_DTYPES)
        check_scales(op, intermediate_states, intermediate_scales, "intermediate_scales", GDN_STATE_SCALE_DIM,
                     "intermediate_states")
        s = intermediate_states.shape
        if s[0] < bs or s[1] < steps or tuple(s[2:]) != (hv, kd, vd):
            raise ValueError(
                f"{op}: `intermediate_states` has shape {tuple(s)}, expected "
                f"[>= {bs}, >= {steps}, {hv}, {kd}, {vd}] (batch rows, steps, Hv, K, V)"
            )
    check_same_device(
        op, q=q, k=k, v=v, g=g, beta=beta, ssm_states=ssm_states, state_indices=state_indices,
        intermediate_states=intermediate_states,
    )
    check_slot_indices(op, "state_indices", state_indices, ssm_states.shape[0])
    check_unique_slots(op, "state_indices", state_indices)
    check_tree_parents(op, parent_indices, bs, steps, has_intermediate=intermediate_states is not None,
                       disable_state_update=disable_state_update,
                       fp8=is_fp8(ssm_states) or (intermediate_states is not None and is_fp8(intermediate_states)))


@kernel_op(
    "hybrid_compile::fused_recurrent_gated_delta_rule_update",
    mutates_args=("ssm_states", "intermediate_states", "ssm_scales", "intermediate_scales"),
)
def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    use_qk_l2norm: bool,
    scale: float,
    disable_state_update: bool,
    intermediate_states: Optional[torch.Tensor],
    ssm_scales: Optional[torch.Tensor],
    intermediate_scales: Optional[torch.Tensor],
    parent_indices: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Speculative verify: ``L`` delta-rule steps per request from its slot's state.

    Args:
        q, k: ``[B, L, Hk, K]`` float.
        v: ``[B, L, Hv, V]`` float.
        g: ``[B, L, Hv]`` float (from ``gdn_gating``) or ``[B, L, Hv, K]`` (per key channel, as in
            ``chunk_gated_delta_rule``).
        beta: ``[B, L, Hv]`` float.
        ssm_states: ``[num_slots, Hv, K, V]`` fp32/bf16/fp16 pool; slot ``state_indices[b]`` is
            the starting state. **Mutated** (final state written back) unless
            ``disable_state_update``.
        state_indices: ``[B]`` int32/int64; -1 = padding row (nothing read or written, zero
            output).
        use_qk_l2norm: L2-normalise q and k first (eps 1e-6).
        scale: query scale; ``scale <= 0`` means ``K ** -0.5``.
        disable_state_update: leave ``ssm_states`` untouched (the accepted prefix is committed
            later from ``intermediate_states`` by ``commit_speculative_state``).
        intermediate_states: optional ``[>= B, >= L, Hv, K, V]`` float buffer, indexed by BATCH
            ROW (not slot). **Mutated**: ``intermediate_states[b, t]`` = state after step ``t``
            (cast to the buffer's dtype), for real rows and ``t < L`` only.
        ssm_scales, intermediate_scales: fp32 scales (``[num_slots, Hv, V]``, ``[>= B, >= L, Hv,
            V]``) of an FP8 ``ssm_states`` / ``intermediate_states`` (as in
            ``chunk_gated_delta_rule``), **mutated** with them; None for float buffers. With an FP8
            pool the state is rounded to the FP8 format between steps, as ``L`` decode steps would
            store it.
        parent_indices: optional ``[B, L]`` int32/int64: a draft TREE (top-k > 1 drafts). Node
            ``t`` starts from the state stored after node ``parent_indices[b, t]`` (its row of
            ``intermediate_states``, as stored), or the slot's state for ``-1``;
            ``-1 <= parent < t``. Needs ``intermediate_states``, ``disable_state_update`` and
            float buffers. None: a chain (``parent = t - 1``).
        A_log, dt_bias: optional ``[Hv]`` (both or neither): ``g`` and ``beta`` are then the raw
            projections ``a`` / ``b`` ``[B, L, Hv]`` and the op gates them itself, as
            :func:`gdn_gating` (softplus 1.0 / 20.0) and the decode op do (the CUDA kernel in its
            loop: no separate gating kernel).

    Returns:
        ``o``: ``[B, L, Hv, V]`` in ``v.dtype``.
    """
    _check_verify(q, k, v, g, beta, ssm_states, state_indices, intermediate_states, ssm_scales,
                  intermediate_scales, disable_state_update, parent_indices, A_log, dt_bias)
    if A_log is not None:
        hv = v.shape[2]
        g, beta = (t.reshape(g.shape) for t in _gating(A_log, g.reshape(-1, hv), beta.reshape(-1, hv), dt_bias,
                                                          1.0, 20.0))
    bs, steps, hv, vd = v.shape
    o = torch.zeros(bs, steps, hv, vd, dtype=v.dtype, device=v.device)
    if bs == 0 or steps == 0:
        return o
    rows, slots = _valid_rows(state_indices)
    if slots.numel() == 0:
        return o
    qf, kf = _prep_qk(_gather_rows(q, rows), _gather_rows(k, rows), hv, use_qk_l2norm, scale)
    vf = _gather_rows(v, rows).float()
    gf = _gather_rows(g, rows).float()
    bf = _gather_rows(beta, rows).float()
    state = read_rows(ssm_states, ssm_scales, slots, GDN_STATE_SCALE_DIM)
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    inter_rows = torch.arange(bs, device=v.device) if rows is None else rows
    initial, history = state, []  # (a tree: the states after each node, as stored)
    parents = None if parent_indices is None else _gather_rows(parent_indices, rows)
    for t in range(steps):
        if parents is not None:
            state = tree_start_states(initial, history, parents[:, t])
        out[:, t], state = _recurrent_step(state, qf[:, t], kf[:, t], vf[:, t], gf[:, t], bf[:, t])
        if parents is not None:
            history.append(state.to(intermediate_states.dtype).float())
        if intermediate_states is not None:
            write_rows(intermediate_states[:, t], None if intermediate_scales is None else intermediate_scales[:, t],
                       inter_rows, state, GDN_STATE_SCALE_DIM)
        if is_fp8(ssm_states) and t < steps - 1:  # as a decode step would store it (fp8_cache.round_trip)
            state = round_trip(state, GDN_STATE_SCALE_DIM)
    if not disable_state_update:
        write_rows(ssm_states, ssm_scales, slots, state, GDN_STATE_SCALE_DIM)
    if rows is None:
        o.copy_(out)
    else:
        o.index_copy_(0, rows, out.to(v.dtype))
    return o


@fused_recurrent_gated_delta_rule_update.register_fake
def _(q, k, v, g, beta, ssm_states, state_indices, use_qk_l2norm, scale, disable_state_update,
      intermediate_states, ssm_scales=None, intermediate_scales=None, parent_indices=None, A_log=None, dt_bias=None):
    _check_verify(q, k, v, g, beta, ssm_states, state_indices, intermediate_states, ssm_scales,
                  intermediate_scales, disable_state_update, parent_indices, A_log, dt_bias)
    return v.new_empty(v.shape)
