"""The "decay plus low-rank" recurrence (RWKV-7, fla's DPLR form): the erase reads the state before the decay.

    S_t = (Diag(exp g_t) - b_t a_t^T) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T
    o_t = scale * S_t^T q_t

The decay and the erase add here, where `recurrence` composes them as (I - k a^T) Diag(exp g). Rewriting this form
as that one needs a' = Diag(exp g)^-1 a, which overflows once g < -88 (float32); this module never divides by a
decay. Its chunked path writes the erase as a third write, b_t r_t^T with r_t = -S_{t-1}^T a_t, solves one unit lower
triangular system per chunk for the r_t, and forms every decay factor as exp of a sum of log-decays over the steps
in between (a segment sum), never as exp(G_t) / exp(G_s), so every factor is <= 1 and none cancels.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from recurscope.kernels import scratch
from recurscope.kernels._validate import _check_finite, _check_float, _expect, compute_dtype, validate
from recurscope.kernels.chunked import _chunk_major, _into_chunk_major, _unit_lower_inverse

DEFAULT_CHUNK = 32      # the lifted route's chunk (experiments.bench.low_rank)
SEGMENT_CHUNK = 4       # the segment-sum route's: its (C, C, K) decay factors cost C K per step
LOW_RANK_BACKENDS = ("auto", "reference", "chunked", "triton")


class LowRankOutput(NamedTuple):          # the fields of kernels.RecurrenceOutput
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    states: Optional[torch.Tensor]


def recurrence_low_rank(
    q, k, x, g, a, b, *, scale=None, initial_state=None, write_scale=None, extra_write=None, capture=None,
    output_final_state: bool = True, backend: str = "auto", check_finite: bool = True,
    chunk_size: Optional[int] = None,
):
    """Runs S_t = (Diag(exp g_t) - b_t a_t^T) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T, o_t = scale S_t^T q_t.

    q, k, a, b: (B, T, H, K); x: (B, T, H, V); g: (B, T, H) or (B, T, H, K), log-decays (any value <= 0, -1e4
    included). The patch arguments and the return value are `recurrence`'s (a RecurrenceOutput-shaped triple:
    o, final_state, states). Backends: "reference" (the step loop), "chunked" (PyTorch, differentiable) and "triton"
    (kernels.low_rank_triton, fused recurrent, forward only; CUDA tensors, or TRITON_INTERPRET=1). "auto" is
    "chunked" on every device: the Triton kernel has been run only in Triton's interpreter so far, so it is chosen
    by name; RECURSCOPE_BACKEND="reference" overrides "auto". fla's RWKV-7 ops map onto it as a = -fla_a, b = fla_b (fla reads alpha^T S and writes along beta).
    """
    if backend not in LOW_RANK_BACKENDS:
        raise ValueError(f"backend must be one of {LOW_RANK_BACKENDS} for recurrence_low_rank, got {backend!r}")
    if a is None or b is None:
        raise ValueError("recurrence_low_rank needs both a (the read direction) and b (the erase direction); "
                         "without an erase use kernels.recurrence")
    dims, positions = validate(q, k, x, g, a, initial_state, write_scale, extra_write, capture,
                               check_finite=check_finite)
    if dims.H_q != dims.H_k:
        raise ValueError(f"q has {dims.H_q} heads and k {dims.H_k}: recurrence_low_rank takes q with k's heads (query "
                         "groups, several queries per state, run through kernels.recurrence only)")
    _check_float("b", b)
    _expect("b", b, (dims.B, dims.T, dims.H, dims.K), "(B, T, H, K) like a")
    if b.device != q.device:
        raise ValueError(f"b is on {b.device} but q is on {q.device}; put every input on one device")
    if check_finite:
        _check_finite("b", b)
    if backend == "auto":
        backend = "reference" if os.environ.get("RECURSCOPE_BACKEND", "").strip() == "reference" else "chunked"
    scale = dims.K ** -0.5 if scale is None else float(scale)
    kw = dict(scale=scale, initial_state=initial_state, write_scale=write_scale, extra_write=extra_write,
              capture=positions, dtype=compute_dtype(q))
    if backend == "reference":
        o, S, states = low_rank_reference(q, k, x, g, a, b, **kw)
    elif backend == "triton":
        from recurscope.kernels.low_rank_triton import low_rank_triton

        kw.pop("dtype")
        o, S, states = low_rank_triton(q, k, x, g, a, b, output_final_state=output_final_state, **kw)
    else:
        o, S, states = low_rank_chunked(q, k, x, g, a, b, final_state=output_final_state, chunk_size=chunk_size, **kw)
    return LowRankOutput(o, S if output_final_state else None, states)


def low_rank_reference(
    q, k, x, g, a, b, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float64,
):
    """The step loop, one line per term; differentiable. Returns (o in q's dtype, final_state, states) in `dtype`."""
    B, T, H, K = q.shape
    V = x.shape[-1]
    out_dtype = q.dtype
    f = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    q, k, x, g, a, b, write_scale = map(f, (q, k, x, g, a, b, write_scale))
    u, y = (None, None) if extra_write is None else map(f, extra_write)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dtype)
    want = set(capture or [])
    outs, captured = [], []
    for t in range(T):
        decay = g[:, t].exp()
        decay = decay[..., None, None] if decay.dim() == 2 else decay[..., None]
        read = torch.einsum("bhk,bhkv->bhv", a[:, t], S)                # a_t^T S_{t-1}, before the decay
        S = decay * S - b[:, t, ..., :, None] * read[..., None, :]
        xt = x[:, t] if write_scale is None else write_scale[:, t, :, None] * x[:, t]
        S = S + k[:, t, ..., :, None] * xt[..., None, :]
        if u is not None:
            S = S + u[:, t, ..., :, None] * y[:, t, ..., None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
        if t in want:
            captured.append(S)
    states = torch.stack(captured, dim=1) if captured else None
    return torch.stack(outs, dim=1).to(out_dtype), S, states


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """g (..., C, K) -> (..., C, C, K) with [t, s] = sum of g over s < j <= t for s <= t and -inf above the diagonal.
    Summing the steps in between (not subtracting two cumulative sums) keeps a short gap exact after a strong decay."""
    C = g.shape[-2]
    rows = g.unsqueeze(-2).expand(*g.shape[:-1], C, g.shape[-1])           # [t, s] = g_t
    below = torch.ones(C, C, dtype=torch.bool, device=g.device).tril(-1)  # s < t
    seg = rows.masked_fill(~below[..., None], 0.0).cumsum(dim=-3)         # [t, s] = sum_{s < j <= t} g_j
    return seg.masked_fill(~torch.ones(C, C, dtype=torch.bool, device=g.device).tril()[..., None], float("-inf"))


def _scores(left: torch.Tensor, right: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """[t, s] = sum_k left_t[k] right_s[k] decay[t, s, k]; a per-head decay has K = 1 in `decay`."""
    if decay.shape[-1] == 1:
        return (left @ right.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...tk,...sk,...tsk->...ts", left, right, decay)


def low_rank_chunked(
    q, k, x, g, a, b, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float32, final_state: bool = True,
    chunk_size: Optional[int] = None,
):
    """The chunked form in PyTorch, differentiable by autograd; returns (o, final_state, states) like the reference.

    Two routes, chosen by the decays alone (so that a patch never moves a call from one to the other):
    - lifted (_low_rank_lifted), when every chunk's cumulative log decay stays within the dtype's range (|G_t| <=
      60 nats in float32, 600 in float64; RWKV-7's log w > -0.607 spans at most 19.4 nats in a chunk of 32): every
      pairwise term is one product of lifted vectors, batched over the chunks;
    - segment sums (_low_rank_segments), past that range (log decays down to -1e4, -inf): each decay factor is the
      exp of the sum of g over the steps in between, materialised per channel, exact for any decay but C K work
      per step, so it runs short chunks (SEGMENT_CHUNK)."""
    B, T, H, K = q.shape
    C = DEFAULT_CHUNK if chunk_size is None else int(chunk_size)
    if C <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    N = -(-T // C)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (q, k, x, g, a, b, initial_state, write_scale, *(extra_write or ())))
    with scratch.lease(q.device, enabled=not grad) as new:
        return _low_rank_routes(q, k, x, g, a, b, scale, initial_state, write_scale, extra_write, capture, dtype,
                                final_state, chunk_size, grad, new, B, T, H, N, C)


def _low_rank_routes(q, k, x, g, a, b, scale, initial_state, write_scale, extra_write, capture, dtype, final_state,
                     chunk_size, grad, new, B, T, H, N, C):
    """The decay factors, then the route they allow; new(*shape, dtype=) gives a temporary that must not outlive the
    call (the scratch pool without a graph)."""
    gc = _chunk_major(g, B, T, H, N, C, dtype, None, new)        # (N, BH, C[, K]), zero (no decay) past T
    gc = gc[..., None] if gc.dim() == 3 else gc
    # e^{G_t} as a running product of the steps' factors: its relative error grows with the steps (C ulp at most),
    # not with |G_t| as e^{cumsum g} in float32 does (float32's spacing at G = 20 nats is 1.9e-6).
    e_G = torch.cumprod(gc.exp(), -2)
    lo, hi = torch.stack(torch.aminmax(e_G.detach())).tolist()
    limit = math.exp(-(60.0 if dtype == torch.float32 else 600.0))
    if limit <= lo and hi <= 1.0 / limit:                        # False for nan
        # the lift e^{-G}: without a graph one reciprocal; with one a running product of e^{-g}, since the
        # reciprocal's backward divides by e^{2G}, which underflows long before e^{G} does
        lift = torch.cumprod((-gc).exp(), -2) if grad else torch.reciprocal(e_G)
        return _low_rank_lifted(q, k, x, a, b, e_G, lift, scale, initial_state, write_scale, extra_write, capture,
                                dtype, final_state, grad, new, B, T, H, N, C)
    return _low_rank_segments(q, k, x, g, a, b, scale=scale, initial_state=initial_state, write_scale=write_scale,
                              extra_write=extra_write, capture=capture, dtype=dtype, final_state=final_state,
                              chunk_size=SEGMENT_CHUNK if chunk_size is None else chunk_size)


def _low_rank_lifted(q, k, x, a, b, e_G, lift, scale, initial_state, write_scale, extra_write, capture, dtype,
                     final_state, grad, new, B, T, H, N, C):
    """The chunk-start pivot: with G_t the log decay from the chunk's start to step t (inclusive) and r_t the erase's
    residual -S_{t-1}^T a_t, a chunk starting from S_0 solves

        (I + A_ab) R = -(a e^{G_{t-1}}) S_0 - A_ak X - A_au Y,    A_ly = mask(l e^{G_{t-1}} (y e^{-G})^T)  (s < t)
        O = (q e^G) S_0 + A_qb R + A_qk X + A_qu Y,              A_qy = mask(q e^G (y e^{-G})^T)          (s <= t)
        S_C = e^{G_C} S_0 + (b e^{G_C - G})^T R + (k e^{G_C - G})^T X + (u e^{G_C - G})^T Y

    Each term of a lifted product is l_t y_s e^{G_t - G_s} <= |l_t y_s| on and below the diagonal (the larger ones
    sit above it, masked), so it keeps its relative precision while e^{-G} stays finite. All pairwise terms are one
    product of [a e^{G_{t-1}}; q e^G] against [b; k; u] e^{-G} per chunk. With P = L^-1 (A_ak X + A_au Y) and
    M = L^-1 a e^{G_{t-1}} batched over the chunks, R = -(P + M S_0), and the sequential part per chunk is two
    (C, K) x (K, V) products and the state update; the outputs' state terms (q e^G - A_qb M) S_0 are one batched
    product after the loop. e_G = e^{G} and lift = e^{-G}, chunk-major (N, BH, C, K or 1)."""
    K, V = q.shape[-1], x.shape[-1]
    BH = B * H
    device = q.device
    cm = lambda t: _chunk_major(t, B, T, H, N, C, dtype, None, new)  # noqa: E731  (N, BH, C, D)
    e_prev = torch.cat([torch.ones_like(e_G[..., :1, :]), e_G[..., :-1, :]], -2)  # e^{G_{t-1}}
    decay_C, lift_C = e_G[..., -1:, :], lift[..., -1:, :]                  # e^{G_C}, e^{-G_C}: (N, BH, 1, K|1)
    key_in = [b, k] + ([] if extra_write is None else [extra_write[0]])
    val_in = [x] + ([] if extra_write is None else [extra_write[1]])
    n_keys = len(key_in)
    ws = None if write_scale is None else cm(write_scale)[..., None]
    if grad:
        rows = torch.cat([cm(a) * e_prev, cm(q) * e_G], -2)                 # [a e^{G_{t-1}}; q e^G]: (N, BH, 2C, K)
        cols = torch.cat([cm(t) * lift for t in key_in], -2)              # [b; k; u] e^{-G}: (N, BH, n C, K)
        vals = [cm(t) for t in val_in]
        vals[0] = vals[0] if ws is None else vals[0] * ws
        XY = torch.cat(vals, -2) if extra_write is not None else vals[0]  # [X; Y]: (N, BH, (n-1) C, V)
        mm = torch.matmul
    else:
        # each operand formed from the caller's tensor in one pass (layout change and factor together), into
        # buffers of the scratch pool; RXY's first C rows of each chunk take the residuals R in the state pass
        into = lambda t, f, out: _into_chunk_major(t, f, B, T, H, N, C, out)  # noqa: E731
        rows = new(N, BH, 2 * C, K, dtype=dtype)
        into(a, e_prev, rows[:, :, :C])
        into(q, e_G, rows[:, :, C:])
        cols = new(N, BH, n_keys * C, K, dtype=dtype)
        for j, t in enumerate(key_in):
            into(t, lift, cols[:, :, j * C:(j + 1) * C])
        RXY = new(N, BH, n_keys * C, V, dtype=dtype)
        for j, (t, f) in enumerate(zip(val_in, (ws, None))):
            into(t, f, RXY[:, :, (j + 1) * C:(j + 2) * C])
        XY = RXY[:, :, C:]

        def mm(l, r):
            return torch.matmul(l, r, out=new(*l.shape[:-1], r.shape[-1], dtype=dtype))
    mask = _lifted_mask(C, n_keys, dtype, device)
    A = mm(rows, cols.transpose(-1, -2))                                   # (N, BH, 2C, n C)
    A = A * mask if grad else A.mul_(mask)
    L_inv = _lower_inverse(A[..., :C, :C])
    AX = mm(A[..., C:], XY)                                                # [A_ak X + A_au Y; A_qk X + A_qu Y]
    P = mm(L_inv, AX[..., :C, :])                                          # L^-1 (A_ak X + A_au Y)
    M = mm(L_inv, rows[..., :C, :])                                        # L^-1 a e^{G_{t-1}}
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    O0 = torch.baddbmm(flat(AX[..., C:, :]), flat(A[..., C:, :C]), flat(P), alpha=-1.0)
    Q_state = torch.baddbmm(flat(rows[..., C:, :]), flat(A[..., C:, :C]), flat(M), alpha=-1.0)  # q e^G - A_qb M
    to_end = cols * decay_C if grad else cols.mul_(decay_C)                # [b; k; u] e^{G_C - G}
    want = {p // C for p in capture or []}
    if grad:
        S0, S_final = _low_rank_state_pass(P, M, to_end, XY, decay_C.transpose(-1, -2), initial_state, final_state,
                                           BH, K, V, dtype, device)
        O = torch.baddbmm(O0, Q_state, flat(S0))
        starts = {n: S0[n] for n in want}
        R = {n: -torch.baddbmm(P[n], M[n], S0[n]) for n in want}
    else:
        O = O0.view(N, BH, C, V)
        starts, S_final = _low_rank_state_pass_in_place(P, M, to_end, RXY, decay_C.transpose(-1, -2), O,
                                                        Q_state.view(N, BH, C, K), initial_state, final_state, want,
                                                        BH, K, V, dtype, device)
        R = {n: RXY[n][:, :C] for n in want}
    o = (O.view(N, B, H, C, V).permute(1, 0, 3, 2, 4) * scale).reshape(B, N * C, H, V)[:, :T]
    states = None
    if capture:
        caps = []
        for p in capture:
            n, i = divmod(p, C)
            # to_end_s e^{G_p} e^{-G_C} = y_s e^{G_p - G_s}, for s <= p
            w = (e_G[n][:, i] * lift_C[n][:, 0])[:, None]                  # (BH, 1, K|1)
            St = e_G[n][:, i][..., None] * starts[n]
            for j, val in enumerate([R[n]] + list(XY[n].split(C, -2))):
                key = to_end[n][:, j * C: j * C + i + 1] * w
                St = torch.baddbmm(St, key.transpose(-1, -2), val[:, : i + 1])
            caps.append(St)
        states = torch.stack(caps, 1).view(B, H, len(capture), K, V).transpose(1, 2)
    final = None if S_final is None else S_final.view(B, H, K, V)
    return o.to(q.dtype), final, states


def _lower_inverse(A):
    """(I + strict lower part of A)^-1: chunked's blocked inverse when C halves evenly down to 16, else one solve."""
    C = A.shape[-1]
    halves = C
    while halves > 16 and halves % 2 == 0:
        halves //= 2
    if halves <= 16:
        return _unit_lower_inverse(A)
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand_as(A)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)


def _lifted_mask(C, n_keys, dtype, device):
    """(2C, n C): the a rows read the keys of earlier steps (s < t), the q rows those of steps up to their own."""
    strict = torch.ones(C, C, dtype=dtype, device=device).tril(-1)
    return torch.cat([strict.repeat(1, n_keys), (strict + torch.eye(C, dtype=dtype, device=device)).repeat(1, n_keys)])


def _low_rank_state_pass(P, M, to_end, XY, decay, initial_state, final_state, BH, K, V, dtype, device):
    """With autograd, the chunk start states, sequentially: R_n = -(P_n + M_n S), S <- e^{G_C} S + E_n^T [R_n; X_n;
    Y_n] with E = [b; k; u] e^{G_C - G} (one product over the n C rows). Returns (the N start states (N, BH, K, V),
    the final state or None). Reads each tensor from one unbind (autograd then stacks the chunks' gradients once,
    where a select per chunk would fill a whole-tensor gradient each)."""
    N = P.shape[0]
    P_n, M_n, ET_n, dec_n, XY_n = (t.unbind(0) for t in (P, M, to_end.transpose(-1, -2), decay, XY))
    S = (torch.zeros(BH, K, V, dtype=dtype, device=device) if initial_state is None
         else initial_state.to(dtype).reshape(BH, K, V))
    starts = []
    for n in range(N):
        starts.append(S)
        if n == N - 1 and not final_state:
            break
        R_n = torch.baddbmm(P_n[n], M_n[n], S, beta=-1.0, alpha=-1.0)
        S = torch.baddbmm(dec_n[n] * S, ET_n[n], torch.cat([R_n, XY_n[n]], -2))
    return torch.stack(starts), (S if final_state else None)


def _low_rank_state_pass_in_place(P, M, to_end, RXY, decay, O, Q_state, initial_state, final_state, want,
                                  BH, K, V, dtype, device):
    """Without autograd: per chunk R_n = -(P_n + M_n S) into R's rows of RXY ([R; X; Y] per chunk), the output's state
    term Q_state_n S into O, then S <- e^{G_C} S + E_n^T [R_n; X_n; Y_n] in place, so that the state stays in cache
    (storing every chunk's start state for one batched state-term product ran slower). Returns (start states of the
    chunks in want, the final state or None)."""
    N, _, C, _ = P.shape
    P_n, M_n, ET_n, dec_n, RXY_n, O_n, Q_n = (
        t.unbind(0) for t in (P, M, to_end.transpose(-1, -2), decay, RXY, O, Q_state))
    S = (torch.zeros(BH, K, V, dtype=dtype, device=device) if initial_state is None
         else initial_state.to(dtype).reshape(BH, K, V).clone())
    starts = {}
    for n in range(N):
        if n in want:
            starts[n] = S.clone()
        # into R's rows through a temporary: a baddbmm into the strided rows runs matrix by matrix
        RXY_n[n][:, :C].copy_(torch.baddbmm(P_n[n], M_n[n], S, beta=-1.0, alpha=-1.0))
        O_n[n].baddbmm_(Q_n[n], S)
        if n == N - 1 and not final_state:
            return starts, None
        S.mul_(dec_n[n]).baddbmm_(ET_n[n], RXY_n[n])
    return starts, S


def _low_rank_segments(
    q, k, x, g, a, b, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float32, final_state: bool = True,
    chunk_size: int = 4,
):
    """The segment-sum route, for decays past the lifted route's range; returns (o, final_state, states).

    Inside a chunk with start state S_0 and r_t = -S_{t-1}^T a_t:
        S_t = D_t S_{t-1} + b_t r_t^T + k_t x_t^T (+ u_t y_t^T)
        (I + A_ab) R = -(a e^{G_{t-1}}) S_0 - A_ak X - A_au Y,   A_ly[t, s] = sum_k l_t y_s e^{G_{t-1} - G_s}  (s < t)
    where G_{t-1} - G_s is the segment sum of g over s < j < t."""
    B, T, H, K = q.shape
    V = x.shape[-1]
    C = int(chunk_size)
    N = -(-T // C)
    pad = N * C - T

    def prep(t):                             # (B, T, H, d) -> (B, H, N, C, d) in the compute dtype, zero-padded
        t = t.to(dtype)
        if t.dim() == 3:
            t = t[..., None]
        t = t.transpose(1, 2)
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(B, H, N, C, t.shape[-1])

    xs = x if write_scale is None else write_scale[..., None].to(x.dtype) * x
    Q, Kk, X, A, Bv, Gl = map(prep, (q, k, xs, a, b, g))           # Gl: (B, H, N, C, K or 1)
    writes = [(Kk, X)] + ([] if extra_write is None else [tuple(map(prep, extra_write))])

    seg = _segment_sums(Gl)                                       # [t, s]: log decay over s < j <= t
    incl = seg.exp()                                              # e^{G_t - G_s}, s <= t, zero above
    # e^{G_{t-1} - G_s} for s < t: row t-1 of the segment sums, shifted down one row (zero on and above the diagonal)
    excl = torch.nn.functional.pad(incl[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
    cum = Gl.cumsum(dim=-2)                                       # G_t from the chunk start (a sum of g <= 0)
    from_start = cum.exp()                                        # e^{G_t}
    before = torch.nn.functional.pad(cum[..., :-1, :], (0, 0, 1, 0)).exp()  # e^{G_{t-1}}
    to_end = incl[..., -1, :, :]                                  # e^{G_C - G_s}, (B, H, N, C, K or 1)

    eye = torch.eye(C, dtype=dtype, device=q.device)
    L = eye + _scores(A, Bv, excl)                                # unit lower triangular
    rhs0 = -sum(_scores(A, key, excl) @ val for key, val in writes)
    R0 = torch.linalg.solve_triangular(L, rhs0, upper=False, unitriangular=True)
    M = torch.linalg.solve_triangular(L, A * before, upper=False, unitriangular=True)   # R = R0 - M S_0
    QB = _scores(Q, Bv, incl)
    O0 = QB @ R0 + sum(_scores(Q, key, incl) @ val for key, val in writes)
    Qs = Q * from_start
    ends = [(Bv * to_end).transpose(-1, -2)] + [(key * to_end).transpose(-1, -2) for key, _ in writes]
    decay_all = from_start[..., -1, :, None]                      # e^{G_C}, (B, H, N, K or 1, 1)

    by_chunk: dict[int, list[int]] = {}
    for p in capture or []:
        by_chunk.setdefault(p // C, []).append(p % C)

    S = (q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None
         else initial_state.to(dtype).expand(B, H, K, V))
    # One unbind per tensor, not an index per chunk: autograd then stacks the chunks' gradients once, where N
    # separate selects would each fill and add a gradient the size of the whole tensor (quadratic in T).
    R0s, Ms, O0s, QBs, Qss, decays = (t.unbind(2) for t in (R0, M, O0, QB, Qs, decay_all))
    ends_by_chunk = [e.unbind(2) for e in ends]
    vals_by_chunk = [val.unbind(2) for _, val in writes]
    outs, captured = [], []
    for n in range(N):
        Mn_S = Ms[n] @ S
        Rn = R0s[n] - Mn_S
        outs.append(O0s[n] - QBs[n] @ Mn_S + Qss[n] @ S)
        for c in by_chunk.get(n, []):                             # S_c = e^{G_c} S_0 + sum_{s<=c} e^{G_c-G_s} (...)
            d = incl[:, :, n, c, : c + 1]                         # (B, H, c+1, K or 1)
            St = from_start[:, :, n, c, :, None] * S + (Bv[:, :, n, : c + 1] * d).transpose(-1, -2) @ Rn[..., : c + 1, :]
            for key, val in writes:
                St = St + (key[:, :, n, : c + 1] * d).transpose(-1, -2) @ val[:, :, n, : c + 1]
            captured.append(St)
        if n < N - 1 or final_state:
            S = decays[n] * S + ends_by_chunk[0][n] @ Rn
            for vals, end in zip(vals_by_chunk, ends_by_chunk[1:]):
                S = S + end[n] @ vals[n]
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2) * scale
    states = torch.stack(captured, dim=1) if captured else None
    return o.to(q.dtype), (S if final_state else None), states
