"""Per-token reference of the Mamba2 SSM recurrence (one request, one token, one head at a time).

Per head ``h`` with ``A[h] < 0`` and group ``g = h // (H // G)``::

    dt = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, dt_min, dt_max)
    S  = S * exp(dt * A[h]) + dt * outer(x, B[g])       # S: [P, N]
    y  = S @ C[g] + D[h] * x
    y  = y * silu(z)                                     # when z is given

All math in fp32. State pools are read as fp32 and written back cast to their dtype.
"""

from __future__ import annotations

import math

import torch


def _dt(raw: float, bias: float, softplus: bool, dt_min: float, dt_max: float) -> float:
    v = raw + bias
    if softplus:
        v = v if v > 20.0 else math.log1p(math.exp(v))  # torch's softplus (threshold 20)
    return min(max(v, dt_min), dt_max)


def _token_step(S, x_t, dt_t, A, B_t, C_t, D, z_t, dt_bias, dt_softplus, dt_min, dt_max):
    """One token for every head. S: [H, P, N] fp32 (updated in place); returns y_t [H, P] fp32."""
    H = S.shape[0]
    G = B_t.shape[0]
    y = torch.zeros(H, S.shape[1], dtype=torch.float32)
    for h in range(H):
        g = h // (H // G)
        bias = float(dt_bias[h]) if dt_bias is not None else 0.0
        d = _dt(float(dt_t[h]), bias, dt_softplus, dt_min, dt_max)
        xh = x_t[h].float()
        S[h] = S[h] * math.exp(d * float(A[h])) + d * torch.outer(xh, B_t[g].float())
        y[h] = S[h] @ C_t[g].float()
        if D is not None:
            y[h] = y[h] + float(D[h]) * xh
        if z_t is not None:
            zh = z_t[h].float()
            y[h] = y[h] * (zh * torch.sigmoid(zh))
    return y


def ssd_scan_reference(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max,
    ssm_states, cu_seqlens, state_indices, has_initial_state,
):
    """Varlen prefill, token by token. Arguments as ``hybrid_compile::ssd_chunk_scan``.

    Returns ``(y, new_ssm_states, history)``:
        y: ``[T, H, P]`` fp32 (zero for padding requests).
        new_ssm_states: a copy of ``ssm_states`` with each non-padding, non-empty request's
            final state written to its slot (cast to the pool dtype).
        history: per request, ``[len_b + 1, H, P, N]`` fp32, ``history[b][t]`` = state after
            ``t`` of its tokens (``[0]`` = initial state); None for padding requests.
    """
    T, H, P = x.shape
    N = B.shape[2]
    y = torch.zeros(T, H, P, dtype=torch.float32)
    new_states = ssm_states.clone()
    history = []
    cu = [int(v) for v in cu_seqlens]
    for b in range(len(cu) - 1):
        slot = int(state_indices[b])
        if slot < 0:
            history.append(None)
            continue
        if bool(has_initial_state[b]):
            S = ssm_states[slot].float().clone()
        else:
            S = torch.zeros(H, P, N, dtype=torch.float32)
        hist = [S.clone()]
        for t in range(cu[b], cu[b + 1]):
            y[t] = _token_step(
                S, x[t], dt[t], A, B[t], C[t], D, None if z is None else z[t], dt_bias, dt_softplus, dt_min, dt_max
            )
            hist.append(S.clone())
        history.append(torch.stack(hist))
        if cu[b + 1] > cu[b]:
            new_states[slot] = S.to(new_states.dtype)
    return y, new_states, history


def selective_state_update_reference(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max,
    ssm_states, state_indices, disable_state_update, intermediate_states,
):
    """Decode / verify, token by token. Arguments as ``hybrid_compile::selective_state_update``.

    Returns ``(y, new_ssm_states, new_intermediate_states)``: ``y`` ``[B, L, H, P]`` fp32 and
    copies of the two buffers with the op's writes applied (``new_intermediate_states`` is
    None when ``intermediate_states`` is None).
    """
    batch, steps, H, P = x.shape
    y = torch.zeros(batch, steps, H, P, dtype=torch.float32)
    new_states = ssm_states.clone()
    new_inter = intermediate_states.clone() if intermediate_states is not None else None
    for b in range(batch):
        slot = int(state_indices[b])
        if slot < 0:
            continue
        S = ssm_states[slot].float().clone()
        for t in range(steps):
            y[b, t] = _token_step(
                S, x[b, t], dt[b, t], A, B[b, t], C[b, t], D, None if z is None else z[b, t],
                dt_bias, dt_softplus, dt_min, dt_max,
            )
            if new_inter is not None:
                new_inter[b, t] = S.to(new_inter.dtype)
        if not disable_state_update:
            new_states[slot] = S.to(new_states.dtype)
    return y, new_states, new_inter
