"""The step-loop recurrence: one line per term of the equation, float32 or float64. This is the ground truth.

    S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T
    o_t = scale * S_t^T q_t

With query groups (q with H_q = m H heads, everything else with the H state heads), query head h m + j reads
state h: o_t[h m + j] = scale * S_t[h]^T q_t[h m + j].
"""
from __future__ import annotations

from typing import Optional

import torch


def recurrence_reference(
    q, k, x, g, a=None, *, scale: float, initial_state=None, write_scale=None,
    extra_write=None, capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float32,
):
    """Returns (o, final_state, states) with o in q's dtype, states in `dtype`. Inputs are assumed validated."""
    B, T, Hq, K = q.shape
    H, V = x.shape[2], x.shape[-1]
    m = Hq // H                                                 # queries per state (1 unless query groups)
    out_dtype = q.dtype
    f = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    q, k, x, g, a, write_scale = map(f, (q, k, x, g, a, write_scale))
    u, y = (None, None) if extra_write is None else map(f, extra_write)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype).clone()
    want = set(capture or [])
    o = q.new_empty(B, T, Hq, V)
    captured = []
    for t in range(T):
        decay = g[:, t].exp()                                   # (B, H) or (B, H, K)
        decay = decay[..., None, None] if decay.dim() == 2 else decay[..., None]
        S = decay * S                                           # Diag(exp g_t) S_{t-1}
        kt = k[:, t]
        if a is not None:                                       # (I - k a^T) S = S - k (a^T S)
            S = S - kt[..., :, None] * torch.einsum("bhk,bhkv->bhv", a[:, t], S)[..., None, :]
        xt = x[:, t] if write_scale is None else write_scale[:, t, :, None] * x[:, t]
        S = S + kt[..., :, None] * xt[..., None, :]
        if u is not None:
            S = S + u[:, t][..., :, None] * y[:, t][..., None, :]
        o[:, t] = scale * torch.einsum("bhkv,bhjk->bhjv", S, q[:, t].unflatten(1, (H, m))).flatten(1, 2)
        if t in want:
            captured.append(S)
    states = torch.stack(captured, dim=1) if captured else None
    return o.to(out_dtype), S, states
