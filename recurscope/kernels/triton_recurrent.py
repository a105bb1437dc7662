"""The fused recurrent Triton kernel: one program per (batch*head, V tile) keeps its slice of the state in fp32
registers and walks the time loop, with every patch feature behind a constexpr flag. Its backward recomputes the call
in the chunked form (plain torch, on the same device) and differentiates that.

    S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T
    o_t = scale * S_t^T q_t

Columns of S (the V dimension) evolve independently, so V is split into tiles and K is kept whole per program.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

# At most this many fp32 state entries per program, 16 per thread (see tile_config): K = 256 stays in registers.
MAX_TILE_ELEMENTS = 2048
STATE_ENTRIES_PER_THREAD = 16
# The loads of a step do not feed a dot, so software pipelining has nothing to overlap; one stage keeps it lean.
NUM_STAGES = 1


# ---- the pieces both fused forwards share (this kernel and kernels.low_rank_triton's), inlined by triton.jit ----
@triton.jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The program's tile of a (K, V) state, K whole and V tile i_v: (offs_k, offs_v, mask_k, mask_v, mask_kv,
    offs_kv), offs_kv the tile's flat offsets in the row-major (K, V) state."""
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    return offs_k, offs_v, mask_k, mask_v, mask_k[:, None] & mask_v[None, :], offs_k[:, None] * V + offs_v[None, :]


@triton.jit
def initial_tile(h0_ptr, state_base, offs_kv, mask_kv, BK: tl.constexpr, BV: tl.constexpr,
                 HAS_INITIAL_STATE: tl.constexpr):
    """The state tile in fp32 before step 0: zeros, plus the initial state when there is one."""
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INITIAL_STATE:
        S += tl.load(h0_ptr + state_base + offs_kv, mask=mask_kv, other=0.0).to(tl.float32)
    return S


@triton.jit
def decay_tile(S, p_g, mask_k, CHANNEL_DECAY: tl.constexpr):
    """Diag(exp g_t) S: g per channel (CHANNEL_DECAY) or one value per head."""
    if CHANNEL_DECAY:
        g_t = tl.load(p_g, mask=mask_k, other=0.0).to(tl.float32)
        S = S * tl.exp(g_t)[:, None]
    else:
        g_t = tl.load(p_g).to(tl.float32)
        S = S * tl.exp(g_t)
    return S


@triton.jit
def add_writes(S, k_t, p_x, p_ws, p_u, p_y, mask_k, mask_v, HAS_WRITE_SCALE: tl.constexpr,
               HAS_EXTRA_WRITE: tl.constexpr):
    """S + write_scale_t k_t x_t^T (+ u_t y_t^T): the step's writes, k_t already loaded."""
    x_t = tl.load(p_x, mask=mask_v, other=0.0).to(tl.float32)
    if HAS_WRITE_SCALE:
        x_t = x_t * tl.load(p_ws).to(tl.float32)
    S = S + k_t[:, None] * x_t[None, :]
    if HAS_EXTRA_WRITE:
        u_t = tl.load(p_u, mask=mask_k, other=0.0).to(tl.float32)
        y_t = tl.load(p_y, mask=mask_v, other=0.0).to(tl.float32)
        S = S + u_t[:, None] * y_t[None, :]
    return S


@triton.jit
def read_out(S, p_q, p_o, scale, mask_k, mask_v):
    """Stores o_t = scale * S^T q_t (this tile's V entries) in o's dtype."""
    q_t = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
    o_t = tl.sum(S * q_t[:, None], axis=0) * scale
    tl.store(p_o, o_t.to(p_o.dtype.element_ty), mask=mask_v)


@triton.jit
def capture_tile(S, slot_ptr, states_ptr, row, P, H: tl.constexpr, i_h, K: tl.constexpr, V: tl.constexpr,
                 offs_kv, mask_kv):
    """Stores the tile into states (rows, P, H, K, V) at slot_ptr's slot when it is one (>= 0; -1: no capture)."""
    slot = tl.load(slot_ptr)
    if slot >= 0:
        cap_base = ((row * P + slot) * H + i_h) * K * V
        tl.store(states_ptr + cap_base + offs_kv, S, mask=mask_kv)


@triton.jit(do_not_specialize=["T"])
def recurrent_fwd_kernel(
    q_ptr, k_ptr, x_ptr, g_ptr, a_ptr, ws_ptr, u_ptr, y_ptr, h0_ptr, cap_slot_ptr, cu_ptr,
    o_ptr, ht_ptr, states_ptr,
    scale, T, P,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    CHANNEL_DECAY: tl.constexpr, HAS_ERASE: tl.constexpr, HAS_WRITE_SCALE: tl.constexpr,
    HAS_EXTRA_WRITE: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    HAS_CAPTURE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H          # the batch row, or the sequence of a packed batch (IS_VARLEN, B = 1)
    i_h = i_bh % H
    i_hk = i_h // (H // HK)  # the key head of q and k (grouped value heads: H = n HK)

    offs_k, offs_v, mask_k, mask_v, mask_kv, offs_kv = state_tile(i_v, K, V, BK, BV)

    # int64 bases: B*T*H*K can pass 2**31 on long sequences.
    if IS_VARLEN:
        bos = tl.load(cu_ptr + i_b).to(tl.int64)
        steps = tl.load(cu_ptr + i_b + 1).to(tl.int64) - bos
        t0 = bos                                  # the packed position of the sequence's first step
        i_c = 0                                   # captures live in the one batch row
    else:
        bos = i_b.to(tl.int64) * T
        steps = T
        t0 = 0
        i_c = i_b
    row0 = bos * H + i_h     # row of (b, t=0, h) in the flattened (B*T*H) layout
    rowk0 = bos * HK + i_hk  # the same for q and k, with their HK heads
    p_q = q_ptr + rowk0 * K + offs_k
    p_k = k_ptr + rowk0 * K + offs_k
    p_x = x_ptr + row0 * V + offs_v
    p_o = o_ptr + row0 * V + offs_v
    if CHANNEL_DECAY:
        p_g = g_ptr + row0 * K + offs_k
    else:
        p_g = g_ptr + row0
    if HAS_ERASE:
        p_a = a_ptr + row0 * K + offs_k
    # Disabled features' pointers are formed but never read (their flags are constexpr).
    p_ws = ws_ptr + row0
    p_u = u_ptr + row0 * K + offs_k
    p_y = y_ptr + row0 * V + offs_v
    state_base = i_bh.to(tl.int64) * K * V  # (B, H, K, V) offset of this (b, h)

    S = initial_tile(h0_ptr, state_base, offs_kv, mask_kv, BK, BV, HAS_INITIAL_STATE)

    for t in range(0, steps):
        # Padded K rows stay zero: k, u and the initial state load 0 there, so the decay value is irrelevant.
        S = decay_tile(S, p_g, mask_k, CHANNEL_DECAY)
        k_t = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        if HAS_ERASE:
            a_t = tl.load(p_a, mask=mask_k, other=0.0).to(tl.float32)
            # (I - k a^T) S = S - k (a^T S): a rank-one update, never the K x K matrix.
            aS = tl.sum(a_t[:, None] * S, axis=0)
            S = S - k_t[:, None] * aS[None, :]
        S = add_writes(S, k_t, p_x, p_ws, p_u, p_y, mask_k, mask_v, HAS_WRITE_SCALE, HAS_EXTRA_WRITE)
        read_out(S, p_q, p_o, scale, mask_k, mask_v)
        if HAS_CAPTURE:   # states is (B, P, H, K, V)
            capture_tile(S, cap_slot_ptr + t0 + t, states_ptr, i_c, P, H, i_h, K, V, offs_kv, mask_kv)

        p_q += HK * K
        p_k += HK * K
        p_x += H * V
        p_o += H * V
        if CHANNEL_DECAY:
            p_g += H * K
        else:
            p_g += H
        if HAS_ERASE:
            p_a += H * K
        if HAS_WRITE_SCALE:
            p_ws += H
        if HAS_EXTRA_WRITE:
            p_u += H * K
            p_y += H * V

    if STORE_FINAL_STATE:
        tl.store(ht_ptr + state_base + offs_kv, S, mask=mask_kv)


def tile_config(K: int, V: int) -> tuple[int, int, int]:
    """(BK, BV, num_warps): BK covers K, BV = the largest power of two with BK*BV <= 2048 (capped at V's),
    and one warp per 512 state entries (1 to 4 warps), i.e. at most 16 fp32 state registers per thread.

    Measured on sm_90 (heaviest variant, see tests/kernels/test_triton_aot.py): no spills, about 120 registers
    at K = V = 256; 4096-entry tiles with 4 warps needed 190-240 registers once capture was on."""
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(1, MAX_TILE_ELEMENTS // BK))
    num_warps = max(1, min(4, (BK * BV) // (32 * STATE_ENTRIES_PER_THREAD)))
    return BK, BV, num_warps


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"recurrence_triton needs CUDA tensors (got q on {q.device}), or TRITON_INTERPRET=1 set before "
            "kernels.triton_recurrent is imported; use backend='chunked' on a CPU"
        )


def launch_outputs(B: int, T: int, H: int, K: int, V: int, rows: int, dtype, device, capture, output_final_state):
    """The fused forwards' outputs, allocated: o (B, T, H, V) in `dtype`, the final states (rows, H, K, V) and the
    captured states (B, P, H, K, V) in float32 (None when not asked for), the position -> slot table of the
    captures (T,) (-1 where nothing is captured: one scalar load per step in the kernel; None without captures),
    and P."""
    o = torch.empty(B, T, H, V, dtype=dtype, device=device)
    final_state = torch.empty(rows, H, K, V, dtype=torch.float32, device=device) if output_final_state else None
    P = len(capture) if capture else 0
    states = torch.empty(B, P, H, K, V, dtype=torch.float32, device=device) if P else None
    cap_slot = None
    if P:
        cap_slot = torch.full((T,), -1, dtype=torch.int32, device=device)
        cap_slot[torch.as_tensor(capture, dtype=torch.long, device=device)] = torch.arange(
            P, dtype=torch.int32, device=device)
    return o, final_state, states, cap_slot, P


def _launch(q, k, x, g, a, write_scale, u, y, initial_state, capture, scale, output_final_state, cu_seqlens=None):
    B, T, HK, K = q.shape
    H, V = x.shape[2], x.shape[-1]
    rows = B if cu_seqlens is None else len(cu_seqlens) - 1     # one program row per batch row or sequence
    device = q.device
    c = lambda t: None if t is None else t.contiguous()  # noqa: E731
    q, k, x, g, a, write_scale, u, y, initial_state = map(c, (q, k, x, g, a, write_scale, u, y, initial_state))
    o, final_state, states, cap_slot, P = launch_outputs(B, T, H, K, V, rows, q.dtype, device, capture,
                                                         output_final_state)
    # Disabled features get a stand-in pointer that the kernel never dereferences (their flags are constexpr).
    dummy = o
    pick = lambda t: dummy if t is None else t  # noqa: E731
    BK, BV, num_warps = tile_config(K, V)
    cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens, dtype=torch.int64, device=device)
    grid = (triton.cdiv(V, BV), rows * H)
    if rows * H == 0:
        return o, final_state, states
    recurrent_fwd_kernel[grid](
        q, k, x, g, pick(a), pick(write_scale), pick(u), pick(y), pick(initial_state), pick(cap_slot), pick(cu),
        o, pick(final_state), pick(states),
        float(scale), T, P,
        H=H, HK=HK, K=K, V=V, BK=BK, BV=BV,
        CHANNEL_DECAY=g.dim() == 4, HAS_ERASE=a is not None, HAS_WRITE_SCALE=write_scale is not None,
        HAS_EXTRA_WRITE=u is not None, HAS_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, HAS_CAPTURE=P > 0, IS_VARLEN=cu is not None,
        num_warps=num_warps, num_stages=NUM_STAGES,
    )
    return o, final_state, states


class _Recurrence(torch.autograd.Function):
    """The kernel forward; the backward recomputes the call in the chunked form (kernels.chunked, plain torch, which
    runs on the caller's device) under autograd and differentiates that: exact to float rounding, at the cost of one
    more forward. The kernel keeps nothing for the backward but the inputs."""

    @staticmethod
    def forward(ctx, q, k, x, g, a, write_scale, u, y, initial_state, capture, scale, output_final_state, cu_seqlens):
        ctx.save_for_backward(q, k, x, g, a, write_scale, u, y, initial_state)
        ctx.capture, ctx.scale, ctx.output_final_state = capture, scale, output_final_state
        ctx.cu_seqlens = cu_seqlens
        return _launch(q, k, x, g, a, write_scale, u, y, initial_state, capture, scale, output_final_state,
                       cu_seqlens)

    @staticmethod
    def backward(ctx, d_o, d_final, d_states):
        from recurscope.kernels._validate import compute_dtype
        from recurscope.kernels.chunked import recurrence_chunked

        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[:9]
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(bool(n)) for t, n in zip(saved, needs)]
            q, k, x, g, a, write_scale, u, y, initial_state = leaves
            outs = recurrence_chunked(
                q, k, x, g, a, scale=ctx.scale, initial_state=initial_state, write_scale=write_scale,
                extra_write=None if u is None else (u, y), capture=ctx.capture, dtype=compute_dtype(q),
                final_state=ctx.output_final_state, cu_seqlens=ctx.cu_seqlens)
            pairs = [(t, d) for t, d in zip(outs, (d_o, d_final, d_states)) if t is not None and d is not None]
            wrt = [t for t in leaves if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad([t for t, _ in pairs], wrt, [d for _, d in pairs], allow_unused=True)
                       if pairs and wrt else [None] * len(wrt))
        grads = [next(got) if t is not None and t.requires_grad else None for t in leaves]
        return (*grads, None, None, None, None)


def recurrence_triton(
    q, k, x, g, a=None, *, output_final_state: bool = True, scale: float, initial_state=None,
    write_scale=None, extra_write=None, capture: Optional[list[int]] = None, cu_seqlens: Optional[list[int]] = None,
):
    """Returns (o, final_state, states): o in q's dtype, final_state (B, H, K, V) and states (B, P, H, K, V) in
    float32 (None when not asked for). q and k may hold H_k heads where x has H = n H_k (each program reads its key
    head); cu_seqlens (B = 1) runs one program row per packed sequence, final states (n, H, K, V). a and u have H
    heads. Inputs are assumed validated (kernels.recurrence does that)."""
    _check_device(q)
    u, y = (None, None) if extra_write is None else extra_write
    capture = list(capture) if capture else None
    cu = None if cu_seqlens is None else [int(b) for b in cu_seqlens]
    return _Recurrence.apply(
        q, k, x, g, a, write_scale, u, y, initial_state, capture, scale, output_final_state, cu)
