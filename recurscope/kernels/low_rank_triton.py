"""The fused recurrent Triton forward of the decay-plus-low-rank form (kernels.low_rank), forward only:

    S_t = (Diag(exp g_t) - b_t a_t^T) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T,     o_t = scale * S_t^T q_t

One program per (batch*head, V tile) keeps its slice of the state in fp32 registers, as kernels.triton_recurrent
does for `recurrence`; the erase reads a_t^T S_{t-1} before the decay, so no decay is ever divided out.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from recurscope.kernels.triton_recurrent import (NUM_STAGES, _check_device, add_writes, capture_tile, decay_tile,
                                                 initial_tile, launch_outputs, read_out, state_tile, tile_config)


@triton.jit(do_not_specialize=["T"])
def low_rank_fwd_kernel(
    q_ptr, k_ptr, x_ptr, g_ptr, a_ptr, b_ptr, ws_ptr, u_ptr, y_ptr, h0_ptr, cap_slot_ptr,
    o_ptr, ht_ptr, states_ptr,
    scale, T, P,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    CHANNEL_DECAY: tl.constexpr, HAS_WRITE_SCALE: tl.constexpr, HAS_EXTRA_WRITE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, HAS_CAPTURE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H

    offs_k, offs_v, mask_k, mask_v, mask_kv, offs_kv = state_tile(i_v, K, V, BK, BV)

    row0 = i_b.to(tl.int64) * T * H + i_h      # row of (b, t=0, h) in the flattened (B*T*H) layout
    p_q = q_ptr + row0 * K + offs_k
    p_k = k_ptr + row0 * K + offs_k
    p_a = a_ptr + row0 * K + offs_k
    p_b = b_ptr + row0 * K + offs_k
    p_x = x_ptr + row0 * V + offs_v
    p_o = o_ptr + row0 * V + offs_v
    if CHANNEL_DECAY:
        p_g = g_ptr + row0 * K + offs_k
    else:
        p_g = g_ptr + row0
    # Disabled features' pointers are formed but never read (their flags are constexpr).
    p_ws = ws_ptr + row0
    p_u = u_ptr + row0 * K + offs_k
    p_y = y_ptr + row0 * V + offs_v
    state_base = i_bh.to(tl.int64) * K * V

    S = initial_tile(h0_ptr, state_base, offs_kv, mask_kv, BK, BV, HAS_INITIAL_STATE)

    for t in range(0, T):
        a_t = tl.load(p_a, mask=mask_k, other=0.0).to(tl.float32)
        b_t = tl.load(p_b, mask=mask_k, other=0.0).to(tl.float32)
        aS = tl.sum(a_t[:, None] * S, axis=0)                 # a_t^T S_{t-1}: read before the decay
        S = decay_tile(S, p_g, mask_k, CHANNEL_DECAY)
        S = S - b_t[:, None] * aS[None, :]
        k_t = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        S = add_writes(S, k_t, p_x, p_ws, p_u, p_y, mask_k, mask_v, HAS_WRITE_SCALE, HAS_EXTRA_WRITE)
        read_out(S, p_q, p_o, scale, mask_k, mask_v)
        if HAS_CAPTURE:
            capture_tile(S, cap_slot_ptr + t, states_ptr, i_b.to(tl.int64), P, H, i_h, K, V, offs_kv, mask_kv)

        p_q += H * K
        p_k += H * K
        p_a += H * K
        p_b += H * K
        p_x += H * V
        p_o += H * V
        if CHANNEL_DECAY:
            p_g += H * K
        else:
            p_g += H
        if HAS_WRITE_SCALE:
            p_ws += H
        if HAS_EXTRA_WRITE:
            p_u += H * K
            p_y += H * V

    if STORE_FINAL_STATE:
        tl.store(ht_ptr + state_base + offs_kv, S, mask=mask_kv)


def low_rank_triton(
    q, k, x, g, a, b, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, output_final_state: bool = True,
):
    """Returns (o in q's dtype, final_state, states) with the states in float32; forward only (no autograd)."""
    _check_device(q)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, x, g, a, b)):
        raise RuntimeError("the triton backend of kernels.recurrence_low_rank is forward-only; use backend='chunked' "
                           "for gradients")
    B, T, H, K = q.shape
    V = x.shape[-1]
    device = q.device
    u, y = (None, None) if extra_write is None else extra_write
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    q, k, x, g, a, b, write_scale, u, y, initial_state = map(c, (q, k, x, g, a, b, write_scale, u, y, initial_state))
    o, final_state, states, cap_slot, P = launch_outputs(B, T, H, K, V, B, q.dtype, device, capture,
                                                         output_final_state)
    pick = lambda t: o if t is None else t  # noqa: E731   (never dereferenced: the flags are constexpr)
    BK, BV, num_warps = tile_config(K, V)
    low_rank_fwd_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, x, g, a, b, pick(write_scale), pick(u), pick(y), pick(initial_state), pick(cap_slot),
        o, pick(final_state), pick(states),
        float(scale), T, P,
        H=H, K=K, V=V, BK=BK, BV=BV,
        CHANNEL_DECAY=g.dim() == 4, HAS_WRITE_SCALE=write_scale is not None, HAS_EXTRA_WRITE=u is not None,
        HAS_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=output_final_state, HAS_CAPTURE=P > 0,
        num_warps=num_warps, num_stages=NUM_STAGES,
    )
    return o, final_state, states
