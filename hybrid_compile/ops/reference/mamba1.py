"""Per-token reference of the Mamba1 selective scan (one request, one token at a time).

Per channel ``d`` (``A [D_inner, N] < 0``), with group ``g = d // (D_inner / G)`` of the token's
``B``, ``C`` ``[G, N]``::

    dt   = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
    S[d] = S[d] * exp(dt[d] * A[d]) + dt[d] * x[d] * B[g]
    y[d] = S[d] . C[g] + D[d] * x[d]
    y[d] = y[d] * silu(z[d])                              # when z is given

All math in fp32. State pools are read as fp32 and written back cast to their dtype.
"""

from __future__ import annotations

import torch


def _softplus(v: torch.Tensor) -> torch.Tensor:
    """torch's softplus (threshold 20), spelled out."""
    return torch.where(v > 20.0, v, torch.log1p(torch.exp(torch.clamp(v, max=20.0))))


def _token_step(S, x_t, dt_t, A, B_t, C_t, D, z_t, dt_bias, dt_softplus):
    """One token. S: [D_inner, N] fp32 (updated in place); returns y_t [D_inner] fp32."""
    d = dt_t.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        d = _softplus(d)
    x = x_t.float()
    D_inner, G = S.shape[0], B_t.shape[0]
    y = torch.zeros(D_inner, dtype=torch.float32)
    for c in range(D_inner):
        g = c // (D_inner // G)
        S[c] = S[c] * torch.exp(d[c] * A[c].float()) + (d[c] * x[c]) * B_t[g].float()
        y[c] = S[c] @ C_t[g].float()
    if D is not None:
        y = y + D.float() * x
    if z_t is not None:
        zf = z_t.float()
        y = y * (zf * torch.sigmoid(zf))
    return y


def mamba1_scan_reference(x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, cu_seqlens, state_indices,
                          has_initial_state):
    """Varlen prefill, token by token. Arguments as ``hybrid_compile::mamba1_selective_scan`` (``A`` negated).

    Returns ``(y, new_ssm_states, history)``: ``y`` ``[T, D_inner]`` fp32 (zero for padding requests);
    a copy of ``ssm_states`` with each running request's final state written to its slot; per request
    ``[len_b + 1, D_inner, N]`` fp32 states after ``t`` of its tokens (None for padding requests).
    """
    T, D_inner = x.shape
    N = B.shape[2]
    y = torch.zeros(T, D_inner, dtype=torch.float32)
    new_states = ssm_states.clone()
    history = []
    cu = [int(v) for v in cu_seqlens]
    for b in range(len(cu) - 1):
        slot = int(state_indices[b])
        if slot < 0:
            history.append(None)
            continue
        S = ssm_states[slot].float().clone() if bool(has_initial_state[b]) else torch.zeros(D_inner, N)
        hist = [S.clone()]
        for t in range(cu[b], cu[b + 1]):
            y[t] = _token_step(S, x[t], dt[t], A, B[t], C[t], D, None if z is None else z[t], dt_bias, dt_softplus)
            hist.append(S.clone())
        history.append(torch.stack(hist))
        if cu[b + 1] > cu[b]:
            new_states[slot] = S.to(new_states.dtype)
    return y, new_states, history


def mamba1_state_update_reference(x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_states, state_indices,
                                  disable_state_update, intermediate_states, parent_indices=None):
    """Decode / verify, token by token. Arguments as ``hybrid_compile::mamba1_state_update`` (``A`` negated).
    With ``parent_indices`` (a draft tree) token ``t`` starts from the state stored after token
    ``parent_indices[b, t]`` (as written to ``intermediate_states``), or the slot's state for -1.

    Returns ``(y, new_ssm_states, new_intermediate_states)`` (the last None without intermediates).
    """
    batch, steps, D_inner = x.shape
    y = torch.zeros(batch, steps, D_inner, dtype=torch.float32)
    new_states = ssm_states.clone()
    new_inter = intermediate_states.clone() if intermediate_states is not None else None
    for b in range(batch):
        slot = int(state_indices[b])
        if slot < 0:
            continue
        S = ssm_states[slot].float().clone()
        for t in range(steps):
            if parent_indices is not None:
                par = int(parent_indices[b, t])
                S = (ssm_states[slot] if par < 0 else new_inter[b, par]).float().clone()
            y[b, t] = _token_step(S, x[b, t], dt[b, t], A, B[b, t], C[b, t], D, None if z is None else z[b, t],
                                  dt_bias, dt_softplus)
            if new_inter is not None:
                new_inter[b, t] = S.to(new_inter.dtype)
        if not disable_state_update:
            new_states[slot] = S.to(new_states.dtype)
    return y, new_states, new_inter
