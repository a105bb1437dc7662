"""The chunked (WY/UT-transform) form of the recurrence in PyTorch: the fast, differentiable path on a CPU.

Within a chunk of C steps starting from S_0, write r_t for the residual that step t adds along k_t:

    S_t = D_t S_{t-1} + k_t r_t^T + u_t y_t^T,   r_t = x_t - (D_t S_{t-1})^T a_t

Unrolling with the cumulative log decay G_t gives a unit lower-triangular system for all r_t of a chunk,
    (I + A_ak) R = X - (a * e^G) S_0 - A_au Y,    A_xy[t, s] = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]},
whose inverse L^-1 is formed for all chunks at once. The sequential part is then, per chunk, R = L^-1 (rhs -
(a e^G) S_0) (with autograd R = R0 - M S_0, R0 and M batched), the output O = A_qk R + (q e^G) S_0 and
S_C = e^{G_C} S_0 + (k e^{G_C - G})^T R.
Decay factors are only ever formed as e^{G_t - G_s} with t >= s (or through a pivot that keeps each factor
bounded), so strong decays never overflow.

The call runs in named stages, in the order of fla's chunk path (fla/ops/common):
    0. decay sums        _decay_sums: G_t, the in-chunk cumulative log decay (float64 when float32 would lose
                         precision: a chunk spanning more than PRECISE_SPAN nats, a hard reset)
    1. pairwise products _lifted_operands / _pivoted_operands: the chunk-major operands and A_qk, A_ak, A_qu, A_au
                         (_pairwise_lifted, _pairwise_channel, _pairwise_scalar)
    2. triangular solve  _unit_lower_inverse: L^-1 = (I + A_ak)^-1 for every chunk at once
    3. WY / erase        _wy_stage: the right side X - A_au Y and, with autograd, R0 = L^-1 rhs and M = L^-1 a e^G
    4. state pass        _state_pass_graph / _state_pass_erase / _state_pass_no_erase: the residuals R, the chunk
                         start states and the final states, sequence by sequence; the output's state term
                         (q e^G) S_0 is added as each start state is known
    5. output pass       _output_pass: the within-chunk term A_qk R, then the layout, scale and cast
    6. captures          _capture_states: S after each captured step, from its chunk's start state and residuals
Packed variable-length batches (cu_seqlens) are laid out so that each sequence starts a chunk (_varlen); the state
pass then restarts at each sequence's first chunk. Grouped value heads (q and k with H_k heads, everything else
with H = n H_k) are broadcast by the layout pass that every operand goes through anyway: no copy of q or k.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from recurscope.kernels import scratch

SUB = 16  # sub-chunk for the per-channel decay pivots
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
# Past this many nats of decay inside one chunk, float32 sums lose the absolute precision that e^{G_t - G_s} needs
# (float32's spacing at 8 is 9.5e-7): the sums are taken in float64 instead (docs/kernels.md, "Stable decays").
PRECISE_SPAN = 8.0
# Log decays below this are clamped: e^-1e4 is 0 in float64 as in float32, and -inf (a hard reset) would turn the
# differences of the sums into inf - inf.
LOG_DECAY_FLOOR = 1.0e4


def default_chunk_size(erase: bool) -> int:
    """Steps per chunk when the caller names none. A chunk's pairwise terms cost O(C (K + V)) per step and the
    sequential products O(K V) whatever C is, so a shorter chunk does less work; with an erase vector (the inverse
    and its product) 32 steps ran 0.85-0.93x the time of 64 on one CPU thread at K = V = 128, without one (GLA) 64
    ran faster (docs/performance.md)."""
    return 32 if erase else 64


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: pairwise products
# ---------------------------------------------------------------------------------------------------------------

def _pairwise_scalar(xs, ym, G):
    """For each x in xs: A[t, s] = (x_t . y_s) e^{G_t - G_s} for s <= t, zero above; G is (..., C), float32 or
    float64 (the difference is taken in G's dtype, the factor cast to x's)."""
    C = G.shape[-1]
    above = torch.ones(C, C, dtype=torch.bool, device=G.device).triu(1)
    dec = (G[..., :, None] - G[..., None, :]).masked_fill_(above, float("-inf")).exp_().to(ym.dtype)
    y_T = ym.transpose(-1, -2)
    return [(x @ y_T).mul_(dec) for x in xs]              # one product per row set: no concatenated copy


def _pairwise_lifted(rows, cols, C, new=None):
    """A[t, s] = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]} for s <= t, zero above, as one full product of lifted
    vectors pivoted at the chunk's start: rows (..., R, K) holds x_t e^{G_t} (R a multiple of C: several row sets
    stacked, each of C rows) and cols (..., C, K) holds y_s e^{-G_s}. Valid while every |G_t| stays within the dtype's
    range (the caller checks): then every factor is a normal float, each term keeps its relative precision, and the
    large products sit above the diagonal, where they are masked. Each entry reads only steps s <= t, so a later step
    never changes an earlier output, not even by rounding. Returns (..., R, C), allocated by new(*shape, dtype=) when
    given."""
    out = None if new is None else new(*rows.shape[:-1], C, dtype=rows.dtype)
    A = torch.matmul(rows, cols.transpose(-1, -2), out=out)
    A.view(*A.shape[:-2], -1, C, C).tril_()      # on a contiguous batch 8x faster than masked_fill_ with a mask
    return A


def _pairwise_channel(xs, ym, G, max_span):
    """For each x in xs: A[t, s] = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]} for s <= t, zero above; G is (..., C, K).

    Each block of SUB rows is measured from a pivot p just before it: x_t e^{G_t - G_p} <= 1, and
    y_s e^{G_p - G_s} <= 1 for earlier s. Inside the row block y_s e^{G_p - G_s} grows at most by the
    decay spanned by the block, which `max_span` keeps within the dtype's range; otherwise the diagonal
    blocks are recomputed from the materialised pairwise decays. The y side is shared by every x. G may be float64
    (precise sums): each difference is taken in G's dtype and the factor cast to x's.
    """
    C = G.shape[-2]
    n = len(xs)
    X = torch.stack(xs, -3)                               # (..., n, C, K)
    out = X.new_empty(*X.shape[:-2], C, C)                # every entry on or below the diagonal is written
    G0 = F.pad(G, (0, 0, 1, 0))                           # G0[..., i] = cumulative decay before position i
    span = float((G0[..., 0:C:SUB, :] - G0[..., SUB::SUB, :]).detach().max()) if C >= SUB else 0.0
    for i in range(0, C, SUB):
        rows = slice(i, i + SUB)
        pivot = G0[..., i:i + 1, :]
        xq = X[..., rows, :] * (G[..., rows, :] - pivot).exp().to(X.dtype)[..., None, :, :]
        lift = pivot - G[..., : i + SUB, :]
        if span > max_span:
            # Clamped so that a block spanning more decay than max_span stays finite (also in the backward pass);
            # only those blocks' diagonal entries can be affected, and they are recomputed exactly below.
            lift = lift.clamp(max=max_span)
        yk = ym[..., : i + SUB, :] * lift.exp().to(ym.dtype)
        prod = xq.flatten(-3, -2) @ yk.transpose(-1, -2)  # (..., n*SUB, i+SUB)
        out[..., rows, : i + SUB] = prod.unflatten(-2, (n, -1))
    if span > max_span:
        out = _exact_diagonal_blocks(out, X, ym[..., None, :, :], G[..., None, :, :])
    return list(out.tril_().unbind(-3))                 # above the diagonal: never written, or not wanted


def _exact_diagonal_blocks(out, xm, ym, G):
    """Recomputes the SUB x SUB diagonal blocks with the pairwise decay materialised (the safe slow path)."""
    C, K = G.shape[-2:]
    n = C // SUB
    split = lambda t: t.reshape(*t.shape[:-2], n, SUB, K)  # noqa: E731
    Gb = split(G)
    diff = Gb[..., :, None, :] - Gb[..., None, :, :]
    keep = torch.ones(SUB, SUB, dtype=torch.bool, device=G.device).tril()
    dec = diff.masked_fill(~keep[..., None], float("-inf")).exp().to(xm.dtype)
    blocks = torch.einsum("...tk,...sk,...tsk->...ts", split(xm), split(ym), dec)
    out = out.clone()
    for j in range(n):
        out[..., j * SUB:(j + 1) * SUB, j * SUB:(j + 1) * SUB] = blocks[..., j, :, :]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: triangular solve
# ---------------------------------------------------------------------------------------------------------------

def _unit_lower_inverse(A, new=None):
    """(I + strict lower part of A)^-1 for a batch of (C, C) blocks; A's diagonal and upper triangle are never read.

    Blocked: the two diagonal halves are inverted together (one batch, recursively down to SUB), then the
    off-diagonal block is -X22 A21 X11. Batched products run much faster than LAPACK's per-matrix triangular solve.
    new(*shape, dtype=) is given only without autograd: then each level is written into one buffer from it, and the
    solves write into theirs (docs/performance.md: the allocating solve ran 2.5x slower)."""
    C = A.shape[-1]
    if C <= SUB:
        eye = torch.eye(C, dtype=A.dtype, device=A.device).expand_as(A)
        out = None if new is None else new(*A.shape, dtype=A.dtype)
        return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True, out=out)
    h = C // 2
    halves = [A[..., :h, :h], A[..., h:, h:]]
    stacked = torch.stack(halves) if new is None else torch.stack(halves, out=new(2, *A.shape[:-2], h, h,
                                                                                   dtype=A.dtype))
    X11, X22 = _unit_lower_inverse(stacked, new)
    X21 = X22 @ (A[..., h:, :h] @ X11)
    if new is None:
        return torch.cat([torch.cat([X11, torch.zeros_like(X11)], -1), torch.cat([-X21, X22], -1)], -2)
    out = new(*A.shape, dtype=A.dtype)
    out[..., :h, :h] = X11
    out[..., :h, h:] = 0.0
    torch.neg(X21, out=out[..., h:, :h])
    out[..., h:, h:] = X22
    return out


# ---------------------------------------------------------------------------------------------------------------
# Layout: (B, T, H, D) in the caller's order -> chunk-major (N, B*H, C, D)
# ---------------------------------------------------------------------------------------------------------------

def _grouped(dst, src):
    """dst (..., H, D) and src (..., H_s, D) with H = n H_s: views that broadcast each source head over its n value
    heads (consecutive value heads share a key head, as fla and transformers group them), so that a layout pass
    reads q and k once per key head and never copies them per value head."""
    H, Hs = dst.shape[-2], src.shape[-2]
    if Hs == H:
        return dst, src
    # expanded, not only broadcastable: an out= operation sizes its result by its inputs (a scalar factor included)
    return dst.unflatten(-2, (Hs, H // Hs)), src.unsqueeze(-2).expand(*src.shape[:-1], H // Hs, src.shape[-1])


def _chunk_major(t, B, T, H, N, C, dtype, scale=None, new=None):
    """(B, T, H_s, D) -> (N, B*H, C, D), zero-padded to N*C steps: one contiguous copy (cast and scale included),
    so that each step of the sequential loop reads one block. A per-head tensor (B, T, H) becomes (N, B*H, C). With
    grouped heads (H_s < H) each source head fills its H / H_s value heads in the same pass.
    new(*shape, dtype=) allocates the buffer (torch.empty when None)."""
    squeeze = t.dim() == 3
    if squeeze:
        t = t[..., None]
    D = t.shape[-1]
    grad = torch.is_grad_enabled() and t.requires_grad
    if grad or new is None:
        out = (torch.zeros if N * C > T else torch.empty)(N, B, H, C, D, dtype=dtype, device=t.device)
    else:
        out = new(N, B, H, C, D, dtype=dtype)
    dst, src = out.permute(1, 0, 3, 2, 4), t              # (B, N, C, H, D) view of the chunk-major buffer
    if t.shape[2] != H:                                   # grouped heads
        dst, src = _grouped(dst, t)
    # Without a graph the scale is applied in the copy itself (out= records none), when no cast would round first.
    fused = scale is not None and not grad and t.dtype == dtype
    put = (lambda d, s: torch.mul(s, scale, out=d)) if fused else (lambda d, s: d.copy_(s))
    full = T // C
    if full:
        put(dst[:, :full], src[:, : full * C].reshape(B, full, C, *src.shape[2:]))
    if T > full * C:
        put(dst[:, full, : T - full * C], src[:, full * C:])
        if not grad and new is not None:
            dst[:, full, T - full * C:].zero_()
    out = out.view(N, B * H, C, D)
    if scale is not None and not fused:
        out = out * scale if grad else out.mul_(scale)
    return out[..., 0] if squeeze else out


def _into_chunk_major(t, factor, B, T, H, N, C, out, op=torch.mul):
    """out = op(t, factor) with t (B, T, H_s, D) in the caller's layout and factor and out chunk-major, (N, B*H, C, ·):
    the layout change and the scaling in one pass over t (a copy when factor is None); grouped heads broadcast.
    Rows past T are zeroed."""
    D = t.shape[-1]
    dst = out.view(N, B, H, C, D).permute(1, 0, 3, 2, 4)                          # (B, N, C, H, D)
    fac = None if factor is None else factor.view(N, B, H, C, -1).permute(1, 0, 3, 2, 4)
    src, rows = t, (H, D)
    if t.shape[2] != H:                                                              # grouped heads
        dst, src = _grouped(dst, t)
        fac = None if fac is None else fac.unflatten(-2, (t.shape[2], -1))
        rows = src.shape[2:]
    full = T // C
    for lo, n, steps in ((0, slice(0, full), full * C), (full * C, full, T - full * C)):
        if not steps:
            continue
        s = src[:, lo:lo + steps]
        if isinstance(n, slice):
            s, d, f = s.reshape(B, full, C, *rows), dst[:, n], None if fac is None else fac[:, n]
        else:
            d, f = dst[:, n, :steps], None if fac is None else fac[:, n, :steps]
            dst[:, n, steps:].zero_()
        if f is None:
            d.copy_(s)
        else:
            op(s, f, out=d)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Stage 0: decay sums
# ---------------------------------------------------------------------------------------------------------------

def _log2_decay_sums(g, B, T, H, N, C, dtype, new):
    """G_t = log2(e) * (sum of g_s over the steps s <= t of t's chunk), chunk-major (N, B*H, C, K), from g (B, T, H, K):
    the chunk-major copy (scaled as it is copied, zero past T) summed along the chunk's steps in place. C - 1
    contiguous row additions ran about 3x faster than cumsum over a non-last dimension; summing while copying (one
    sweep over g) saved 0.3-1.1 ms of 4-5 at T = 8192 but cost more per row operation: 1.2-1.35x slower at T <= 2048
    (docs/performance.md). new(*shape, dtype=) allocates the result."""
    G = _chunk_major(g, B, T, H, N, C, dtype, LOG2E, new)
    for i in range(1, C):
        G[..., i, :] += G[..., i - 1, :]
    return G


def _span(G) -> float:
    """max |G| over every chunk (inf or nan when G holds them): one host read."""
    lo, hi = torch.stack(torch.aminmax(G.detach())).tolist()
    return max(-lo, hi)


def _decay_sums(g, B, T, H, N, C, dtype, grad, new):
    """Stage 0: G_t, the log decay from the chunk's start to step t, chunk-major (N, B*H, C[, K]).

    Returns (G, base2, span): base2 when G is in log2 units (a per-channel decay without autograd: torch's exp2 ran
    about 3x faster than exp on this project's CPU); span = max |G_t| in nats. In float32 a sum past PRECISE_SPAN
    nats (or one holding -inf, a hard reset) has lost the absolute precision that e^{G_t - G_s} needs: each partial
    sum is rounded at its own magnitude, so after a reset of -1000 the steps that follow carry errors of 6e-5 nats.
    Such calls take the sums in float64 instead, with log decays clamped at -LOG_DECAY_FLOOR; every factor is then
    formed from float64 differences and cast (the float32 results stay within 1e-6 of float64, tests/kernels/
    test_stable_decays.py)."""
    channel = g.dim() == 4
    base2 = channel and not grad
    if base2:
        G = _log2_decay_sums(g, B, T, H, N, C, dtype, new)
    else:
        G = _chunk_major(g, B, T, H, N, C, dtype, None, None if grad else new).cumsum(-2 if channel else -1)
    span = _span(G) * (LN2 if base2 else 1.0)
    limit = PRECISE_SPAN if dtype == torch.float32 else math.inf
    if not span <= limit:                                 # past the limit, inf or nan
        G = _chunk_major(g, B, T, H, N, C, torch.float64, None, None if grad else new)
        G = (G.clamp(min=-LOG_DECAY_FLOOR) if grad else G.clamp_(min=-LOG_DECAY_FLOOR)).cumsum(-2 if channel else -1)
        base2, span = False, _span(G)
    return G, base2, span


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: the operands and their pairwise products, by one of two routes
# ---------------------------------------------------------------------------------------------------------------

class _Operands(NamedTuple):
    """Everything the later stages read, chunk-major (N, B*H, C, ·); None where a call has none."""
    qg: torch.Tensor                  # q_t e^{G_t} (the output's state term), times scale unless out_scale != 1
    ag: Optional[torch.Tensor]        # a_t e^{G_t} (the erase's state term)
    kd: torch.Tensor                  # k_s e^{G_C - G_s}
    ud: Optional[torch.Tensor]        # u_s e^{G_C - G_s}
    xc: torch.Tensor                  # the (write-scaled) x
    yc: Optional[torch.Tensor]        # the extra write's y
    A_qk: torch.Tensor                # pairwise terms, lower triangles, (N, B*H, C, C)
    A_ak: Optional[torch.Tensor]
    A_qu: Optional[torch.Tensor]
    A_au: Optional[torch.Tensor]
    decay_C: torch.Tensor             # e^{G_C}: (N, B*H, K, 1), or (N, B*H, 1, 1) for a per-head decay
    UY: Optional[torch.Tensor]        # (u e^{G_C - G})^T y per chunk, (N, B*H, K, V)
    out_scale: float                  # applied by the output pass (1.0 when q already carries the scale)
    cap_keys: torch.Tensor            # the keys and extra keys the captures weight (kd or k), and the factors
    cap_extra: Optional[torch.Tensor]
    cap_factors: Callable             # (n, i) -> (f_p, w): see _capture_states


def _lifted_operands(q, k, x, a, write_scale, extra_write, G, base2, channel, scale, B, T, H, N, C, dtype, new):
    """Every operand of a no-graph call whose decays allow the chunk-start pivot (|G_t| <= max_span), each formed
    from the caller's tensor in one pass that fuses the layout change with its decay factor. The row vectors carry
    e^{G_t} and the column vectors e^{-G_s} (k_lift = k e^{-G}), so a pairwise term is one full product, masked
    (_pairwise_lifted); and k e^{G_C - G_s} = k_lift e^{G_C} is k_lift scaled in place once the products have read
    it. With an erase vector, a e^{G} and q e^{G} are the two row halves of one buffer: each pairwise term is then one
    product. A per-channel G arrives in base 2 when base2 (the caller summed g log2 e), otherwise in natural units
    (float64 when the sums were precise). The output scale is left to the output pass. new(*shape, dtype=)
    allocates every buffer."""
    K, V = q.shape[-1], x.shape[-1]
    BH = B * H
    if channel:
        G_last = G[..., -1:, :].clone()
        if base2:
            gam = G.exp2_()                      # G is this call's own and not read again
            decay_row = G_last.exp2_()           # (N, BH, 1, K)
        else:
            gam, decay_row = G.exp().to(dtype), G_last.exp().to(dtype)
    else:
        gam = G.exp()
        gam = (gam if gam.dtype == dtype else gam.to(dtype))[..., None]       # (N, BH, C, 1)
        decay_row = gam[..., -1:, :]             # (N, BH, 1, 1)
    block = lambda rows, D=K: new(N, BH, rows, D, dtype=dtype)  # noqa: E731
    into = lambda t, f, out, op=torch.mul: _into_chunk_major(t, f, B, T, H, N, C, out, op)  # noqa: E731
    if a is not None:
        rows = block(2 * C)                      # [a e^G; q e^G], one row block each
        ag = into(a, gam, rows[:, :, :C])
        qg = into(q, gam, rows[:, :, C:])
    else:
        rows = qg = into(q, gam, block(C))
        ag = None

    def pairwise(cols):
        """The lifted column vectors cols (N, BH, C, K) against every row vector: (A_q·, A_a·)."""
        A = _pairwise_lifted(rows, cols, C, new)                               # (N, BH, 2C or C, C)
        return (A[:, :, C:], A[:, :, :C]) if a is not None else (A, None)

    k_lift = into(k, gam, block(C), torch.div)                                 # k_s e^{-G_s}
    A_qk, A_ak = pairwise(k_lift)
    kd = k_lift.mul_(decay_row)
    A_qu = A_au = ud = yc = UY = None
    if extra_write is not None:
        u_lift = into(extra_write[0], gam, block(C), torch.div)
        A_qu, A_au = pairwise(u_lift)
        ud = u_lift.mul_(decay_row)
        yc = into(extra_write[1], None, block(C, V))
        UY = torch.matmul(ud.transpose(-1, -2), yc, out=new(N, BH, K, V, dtype=dtype))
    ws = None if write_scale is None else _chunk_major(write_scale, B, T, H, N, C, dtype, None, new)[..., None]
    xc = into(x, ws, block(C, V))

    def factors(n, i):
        # kd_s e^{G_p} / e^{G_C} = k_s e^{G_p - G_s}, each factor within the dtype's range on this route
        gam_p = gam[n][:, i]                                                   # (BH, K) or (BH, 1)
        return gam_p[..., None], (gam_p / decay_row[n][:, 0])[:, None]

    return _Operands(qg, ag, kd, ud, xc, yc, A_qk, A_ak, A_qu, A_au, decay_row.transpose(-1, -2), UY, scale,
                     kd, ud, factors)


def _pivoted_operands(q, k, x, a, write_scale, extra_write, G, channel, scale, keep_inputs, grad,
                      B, T, H, N, C, dtype, new):
    """The general route (autograd, or decays past the chunk-start pivot's range): chunk-major copies, the pairwise
    terms pivoted at every SUB-step block (per-channel decay) or with e^{G_t - G_s} materialised (per-head decay),
    then the decay factors applied. keep_inputs: k and u are read again later (captures), so they are scaled out of
    place; otherwise, without autograd, the copies are this call's own and scaled in place."""
    K = q.shape[-1]
    prep = lambda t, s=None: _chunk_major(t, B, T, H, N, C, dtype, s, None if grad else new)  # noqa: E731
    max_span = 60.0 if dtype == torch.float32 else 600.0
    qc, kc, xc = prep(q, scale), prep(k), prep(x)         # the output scale rides on q
    if write_scale is not None:
        wc = prep(write_scale)[..., None]
        xc = xc * wc if grad else xc.mul_(wc)
    ac = None if a is None else prep(a)
    uc, yc = (None, None) if extra_write is None else (prep(extra_write[0]), prep(extra_write[1]))
    consume = not grad and not keep_inputs
    scaled = lambda t, f: None if t is None else (t.mul_(f) if consume else t * f)  # noqa: E731
    if channel:
        G_last = G[..., -1:, :]
        to_end = (G_last - G).exp().to(dtype)    # e^{G_C - G_s}
        gam = G.exp().to(dtype)                  # e^{G_t}, (N, BH, C, K); G itself is read again by the pivots
        decay_C = G_last.exp().to(dtype).transpose(-1, -2)  # (N, BH, K, 1)
        pair = lambda xs, ym: _pairwise_channel(xs, ym, G, max_span)  # noqa: E731
    else:
        G_last = G[..., -1:]
        gam = G.exp().to(dtype)[..., None]
        to_end = (G_last - G).exp().to(dtype)[..., None]
        decay_C = G_last.exp().to(dtype)[..., None]   # (N, BH, 1, 1)
        pair = lambda xs, ym: _pairwise_scalar(xs, ym, G)  # noqa: E731
    rows = [qc] if ac is None else [qc, ac]
    A_qk, *A_ak = pair(rows, kc)
    A_qu, *A_au = (None,) if uc is None else pair(rows, uc)
    qg = scaled(qc, gam)
    ag = scaled(ac, gam)
    kd = scaled(kc, to_end)
    ud = scaled(uc, to_end)
    UY = None if ud is None else ud.transpose(-1, -2) @ yc

    def factors(n, i):
        Gn = G[n]                                                    # (BH, C, K) or (BH, C)
        dec = (Gn[:, i:i + 1] - Gn[:, : i + 1]).exp().to(dtype)
        f_p = Gn[:, i].exp().to(dtype)
        return (f_p[..., None], dec) if channel else (f_p[:, None, None], dec[..., None])

    return _Operands(qg, ag, kd, ud, xc, yc, A_qk, A_ak[0] if A_ak else None, A_qu, A_au[0] if A_au else None,
                     decay_C, UY, 1.0, kc, uc, factors)


# ---------------------------------------------------------------------------------------------------------------
# Stage 3: the WY / erase stage
# ---------------------------------------------------------------------------------------------------------------

def _wy_stage(ops: _Operands, C, grad, new):
    """The chunk-local system's parts: (rhs, L_inv, R0, M). rhs = X - A_au Y (strictly lower: the extra write of
    step t enters after its erase); L_inv = (I + A_ak)^-1 (stage 2; None without an erase). With autograd,
    R = R0 - M S_0 with R0 = L^-1 rhs and M = L^-1 (a e^G) for all chunks at once; without, L^-1 is applied inside
    the state pass to one chunk's right side, which on a CPU costs less than the two batched products with their
    short inner dimension (docs/performance.md); then R0 = rhs and M = None."""
    rhs = ops.xc
    if ops.yc is not None and ops.ag is not None:         # an extra write with an erase
        strict = ~torch.eye(C, dtype=torch.bool, device=rhs.device)
        rhs = rhs - (ops.A_au * strict) @ ops.yc
    L_inv = None if ops.ag is None else _unit_lower_inverse(ops.A_ak, None if grad else new)
    if L_inv is not None and grad:
        return rhs, L_inv, L_inv @ rhs, L_inv @ ops.ag
    return rhs, L_inv, rhs, None


# ---------------------------------------------------------------------------------------------------------------
# Stage 4: the state pass
# ---------------------------------------------------------------------------------------------------------------

class _Segment(NamedTuple):
    """One sequence's chunks [first, stop) and its start state: (B*H, K, V), (H, K, V) when shared over the batch
    (stride 0 in B), or None for zero."""
    first: int
    stop: int
    init: Optional[torch.Tensor]


def _shared_state_product(P, S0, B, H):
    """P S0 for rows (B*H, C, K) that all start from one state per head, S0 (H, K, V): per head one
    (B*C, K) x (K, V) product instead of B small ones, and S0 is never copied per row. Returns (H, B, C, V)."""
    BH, C, K = P.shape
    Ph = P.view(B, H, C, K).transpose(0, 1).reshape(H, B * C, K)
    return torch.bmm(Ph, S0).view(H, B, C, -1)


def _state_pass_graph(ops, R0, M, segments, want, dtype):
    """With autograd: every product recorded, nothing a product saved changed afterwards (no in-place updates).
    Returns (R per chunk, the output's state terms per chunk, final state per segment, start states by chunk)."""
    BH, _, K = ops.qg.shape[1:]
    V = ops.xc.shape[-1]
    # One unbind per tensor, not a select per chunk: the backward of N selects of one tensor fills and adds N
    # gradients of the whole tensor's size (quadratic in the number of chunks; 59% fill_ and 11% add_ of a GDN
    # forward plus backward at T = 2048), where an unbind's backward stacks the N chunk gradients once.
    R0_n, qg_n, dec_n, kdT_n = (t.unbind(0) for t in (R0, ops.qg, ops.decay_C, ops.kd.transpose(-1, -2)))
    M_n = None if M is None else M.unbind(0)
    UY_n = None if ops.UY is None else ops.UY.unbind(0)
    Rs, terms, finals, starts = [], [], [], {}
    for seg in segments:
        S = ops.qg.new_zeros(BH, K, V, dtype=dtype) if seg.init is None else seg.init.to(dtype).reshape(BH, K, V)
        for n in range(seg.first, seg.stop):
            if n in want:
                starts[n] = S
            R_n = R0_n[n] if M_n is None else torch.baddbmm(R0_n[n], M_n[n], S, alpha=-1.0)
            Rs.append(R_n)
            terms.append(qg_n[n] @ S)
            S_next = dec_n[n] * S if UY_n is None else torch.addcmul(UY_n[n], dec_n[n], S)
            S = torch.baddbmm(S_next, kdT_n[n], R_n)
        finals.append(S)
    return torch.stack(Rs), torch.stack(terms), finals, starts


def _state_pass_erase(ops, rhs, L_inv, segments, shared, want, update_last, B, H, new):
    """Without autograd, with an erase: per chunk, its right side (this call's own) rid of its state term in place,
    R_n = L^-1 rhs_n, the output's state term (q e^G) S_0 into O, and the state updated in place. A segment's first
    chunk only reads its start state (its update is out of place), so the caller's state is never copied or written;
    a batch-expanded start state stays one state per head. Returns (R, O holding the state terms and A_qu Y, final
    state per segment (None where update_last is off), start states by chunk)."""
    N, BH, C, V = rhs.shape
    K = ops.qg.shape[-1]
    dtype = rhs.dtype
    O = new(N, BH, C, V, dtype=dtype)
    R = new(*rhs.shape, dtype=dtype)
    if ops.A_qu is not None:
        torch.matmul(ops.A_qu, ops.yc, out=O)
    written = ops.A_qu is not None       # O already holds a term, so the state term adds to it
    # Per-chunk views taken in one call each: indexing in the loop costs a Python-level call per use.
    rhs_n, ag_n, L_n, R_l, O_n, qg_n, kdT_n, dec_n, UY_n = (
        None if t is None else t.unbind(0)
        for t in (rhs, ops.ag, L_inv, R, O, ops.qg, ops.kd.transpose(-1, -2), ops.decay_C, ops.UY))
    finals, starts = [], {}
    for seg in segments:
        caller = seg.init is not None
        sh = caller and shared
        S = seg.init if caller else rhs.new_zeros(BH, K, V)
        for n in range(seg.first, seg.stop):
            first, last = n == seg.first, n == seg.stop - 1
            if n in want:
                if first and sh:
                    starts[n] = S.expand(B, H, K, V).reshape(BH, K, V)
                else:
                    # the caller's start state is never written; ours (zeros, later chunks) is updated in place
                    starts[n] = S if first and caller else S.clone()
            if first and sh:
                rhs_n[n].view(B, H, C, V).sub_(_shared_state_product(ag_n[n], S, B, H).transpose(0, 1))
            elif not (first and not caller):                    # a zero start takes nothing off
                rhs_n[n].baddbmm_(ag_n[n], S, alpha=-1.0)
            R_n = torch.bmm(L_n[n], rhs_n[n], out=R_l[n])
            if first and sh:
                term = _shared_state_product(qg_n[n], S, B, H).transpose(0, 1)
                O_n[n].view(B, H, C, V).add_(term) if written else O_n[n].view(B, H, C, V).copy_(term)
            elif first and not caller:                          # a zero start adds nothing
                if not written:
                    O_n[n].zero_()
            elif written:
                O_n[n].baddbmm_(qg_n[n], S)
            else:
                torch.bmm(qg_n[n], S, out=O_n[n])
            if last and not update_last:
                S = None
                break
            if first and caller:
                # Out of place: e^{G_C} S_0 as a new (BH, K, V) state (broadcast over rows when S_0 is shared).
                S = (dec_n[n].view(B, H, -1, 1) * S).view(BH, K, V) if sh else dec_n[n] * S
            else:
                S.mul_(dec_n[n])
            S.baddbmm_(kdT_n[n], R_n)
            if UY_n is not None:
                S.add_(UY_n[n])
        finals.append(S)
    return R, O, finals, starts


def _state_pass_no_erase(ops, O, segments, shared, want, update_last, B, H, new):
    """Without autograd and without an erase: the residuals are the inputs. Per chunk, the output's state term
    (q e^G) S into O, then S <- e^{G_C} S + K^T R (+ U^T Y) in place: the state stays in cache from one chunk to the
    next. (Forming every chunk's K^T R at once and scanning them, with one batched state-term product, streamed a
    (N, B*H, K, V) buffer through memory three times: that pass alone ran 1.7x slower at T = 8192, whole calls 5-9%,
    docs/performance.md.) A segment's
    first chunk only reads its start state (its update is out of place), so the caller's state is never copied or
    written; a batch-expanded start state stays one state per head. O must already hold A_qk R (+ A_qu Y).
    Returns (final state per segment (None where update_last is off), start states by chunk); the state terms are
    added into O."""
    R = ops.xc
    N, BH, C, V = R.shape
    K = ops.qg.shape[-1]
    O_n, qg_n, kdT_n, R_n, dec_n, UY_n = (
        None if t is None else t.unbind(0)
        for t in (O, ops.qg, ops.kd.transpose(-1, -2), R, ops.decay_C, ops.UY))
    finals, starts = [], {}
    for seg in segments:
        a, b, S = seg.first, seg.stop, seg.init
        caller = S is not None
        for n in range(a, b):
            first, last = n == a, n == b - 1
            sh = first and caller and shared
            if n in want:
                if S is None:
                    starts[n] = R.new_zeros(BH, K, V)
                elif sh:
                    starts[n] = S.expand(B, H, K, V).reshape(BH, K, V)
                else:
                    # the caller's start state is never written; ours is updated in place below
                    starts[n] = S if first else S.clone()
            if S is not None:
                if sh:
                    O_n[n].view(B, H, C, V).add_(_shared_state_product(qg_n[n], S, B, H).transpose(0, 1))
                else:
                    O_n[n].baddbmm_(qg_n[n], S)
            if last and not update_last:
                S = None
                break
            if S is None:                                       # a zero start: the chunk's writes alone
                S = torch.bmm(kdT_n[n], R_n[n])
            else:
                if first:
                    # Out of place: e^{G_C} S_0 as a new (BH, K, V) state (broadcast over rows when S_0 is shared).
                    S = (dec_n[n].view(B, H, -1, 1) * S).view(BH, K, V) if sh else dec_n[n] * S
                else:
                    S.mul_(dec_n[n])
                S.baddbmm_(kdT_n[n], R_n[n])
            if UY_n is not None:
                S.add_(UY_n[n])
        finals.append(S)
    return finals, starts


# ---------------------------------------------------------------------------------------------------------------
# Stage 5: the output pass; stage 6: captures
# ---------------------------------------------------------------------------------------------------------------

def _output_pass(O, ops, R, B, H, N, C, out_dtype, grad, add_within=True, unpack=None):
    """o = O + A_qk R (the within-chunk term, one batched product for every chunk; add_within=False when O holds it
    already), then the layout (B, N*C, H, V), the output scale and the cast, in one pass into a buffer of the
    caller's own when there is no graph (O may be scratch). unpack = (T, spans), packed sequences without a graph:
    the same pass writes each sequence's rows straight to its place in a (1, T, H, V) output."""
    V = O.shape[-1]
    if add_within:
        if grad:
            O = torch.baddbmm(O.flatten(0, 1), ops.A_qk.flatten(0, 1), R.flatten(0, 1)).view(N, B * H, C, V)
            if ops.A_qu is not None:
                O = O + ops.A_qu @ ops.yc
        else:
            O.view(N * B * H, C, V).baddbmm_(ops.A_qk.reshape(N * B * H, C, C), R.view(N * B * H, C, V))
    o = O.view(N, B, H, C, V).permute(1, 0, 3, 2, 4)
    if unpack is not None and not grad:
        T, spans = unpack
        dst = torch.empty(1, T, H, V, dtype=out_dtype, device=O.device)
        put = (lambda d, s: torch.mul(s, ops.out_scale, out=d)) if ops.out_scale != 1.0 else (lambda d, s: d.copy_(s))
        for lo, hi, row in spans:
            first, full = row // C, (hi - lo) // C
            if full:
                put(dst[:, lo:lo + full * C].view(1, full, C, H, V), o[:, first:first + full])
            if hi > lo + full * C:
                put(dst[:, lo + full * C:hi], o[:, first + full, : hi - lo - full * C])
        return dst
    if not grad:
        dst = torch.empty(B, N, C, H, V, dtype=out_dtype, device=O.device)
        o = torch.mul(o, ops.out_scale, out=dst) if ops.out_scale != 1.0 else dst.copy_(o)
    elif ops.out_scale != 1.0:
        o = o * ops.out_scale
    return o.reshape(B, N * C, H, V).to(out_dtype)


def _capture_states(capture, C, starts, chunk_R, kc, uc, yc, factors):
    """S after step p for each capture position p, from its chunk's start state and residuals:
    S_p = f_p S_0 + sum_{s <= p} (k_s w_s) r_s^T (+ the same sum over u_s y_s^T), with (f_p, w) = factors(n, i) for
    step i of chunk n: f_p = e^{G_p} as (BH, K or 1, 1) and w_s = e^{G_p - G_s} as (BH, i + 1 or 1, K or 1), in
    whatever form the caller's route holds them. Returns (BH, P, K, V)."""
    caps = []
    for p in capture:
        n, i = divmod(p, C)
        f_p, w = factors(n, i)
        st = torch.baddbmm(f_p * starts[n], (kc[n][:, : i + 1] * w).transpose(-1, -2), chunk_R[n][:, : i + 1])
        if uc is not None:
            st = torch.baddbmm(st, (uc[n][:, : i + 1] * w).transpose(-1, -2), yc[n][:, : i + 1])
        caps.append(st)
    return torch.stack(caps, dim=1)


# ---------------------------------------------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------------------------------------------

def recurrence_chunked(
    q, k, x, g, a=None, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float32, chunk_size: Optional[int] = None,
    final_state: bool = True, cu_seqlens: Optional[list[int]] = None,
):
    """Same contract as `recurrence_reference`; differentiable. Inputs are assumed validated.

    final_state=False returns None for the final state, and without autograd the last chunk's state update is
    skipped. An initial_state expanded along the batch (stride 0 in B, e.g. S[:1].expand(B, ...)) is read as one
    state per head, never copied per row: many rows continuing one prefix (the head scan) cost one product per head.
    q and k may have H_k heads where everything else has H = n H_k (grouped value heads). cu_seqlens (a list of
    n + 1 offsets into T, with B = 1) runs n packed sequences, each from its own initial state ((n, H, K, V)) to its
    own final state. Without autograd the large temporaries come from this thread's scratch pool (kernels.scratch);
    what is returned never does.
    """
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (q, k, x, g, a, initial_state, write_scale, *(extra_write or ())))
    with scratch.lease(q.device, enabled=not grad) as new:
        if cu_seqlens is not None:
            return _varlen(q, k, x, g, a, scale, initial_state, write_scale, extra_write, capture, dtype,
                           chunk_size, final_state, grad, new, cu_seqlens)
        return _recurrence_chunked(q, k, x, g, a, scale, initial_state, write_scale, extra_write, capture, dtype,
                                   chunk_size, final_state, grad, new)


def _chunk_length(chunk_size, erase, longest):
    if chunk_size is None:
        chunk_size = default_chunk_size(erase)
    if chunk_size % SUB or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive multiple of {SUB}, got {chunk_size}")
    return min(chunk_size, max(1, -(-longest // SUB)) * SUB)


def _recurrence_chunked(q, k, x, g, a, scale, initial_state, write_scale, extra_write, capture, dtype, chunk_size,
                        final_state, grad, new):
    """One sequence per batch row; new(*shape, dtype=) gives a temporary that must not outlive the call."""
    B, T = q.shape[:2]
    H, V = x.shape[2], x.shape[3]
    C = _chunk_length(chunk_size, a is not None, T)
    N = -(-T // C)
    shared = initial_state is not None and B > 1 and initial_state.stride(0) == 0
    if initial_state is None:
        init = None
    elif shared and not grad:
        init = initial_state[0].to(dtype)                          # (H, K, V), one per head
    else:
        init = initial_state.to(dtype).reshape(B * H, q.shape[-1], V)
    o, finals, states = _chunks(q, k, x, g, a, scale, write_scale, extra_write, capture, dtype, B, T, H, N, C,
                                [_Segment(0, N, init)], shared and not grad, final_state, grad, new)
    S = finals[0]
    return o[:, :T], (S.reshape(B, H, -1, V) if final_state and S is not None else None), states


def _chunks(q, k, x, g, a, scale, write_scale, extra_write, capture, dtype, B, T, H, N, C, segments, shared,
            final_state, grad, new, unpack=None):
    """The stages in order over (B, T, ·) inputs laid out in N chunks of C steps; segments say where each sequence
    starts and ends (in chunks) and its start state; capture positions count steps of the chunk-major layout.
    Returns (o (B, N*C, H, V) in q's dtype, final state per segment, states (B, P, H, K, V) or None)."""
    K, V = q.shape[-1], x.shape[-1]
    channel = g.dim() == 4
    G, base2, span = _decay_sums(g, B, T, H, N, C, dtype, grad, new)                         # stage 0
    max_span = 60.0 if dtype == torch.float32 else 600.0
    # Within [-max_span, max_span] the pairwise terms pivot at the chunk's start (past it they pivot at every SUB-step
    # block, exact for any decay). Only without autograd: the backward of y / e^{G} carries e^{-2G}, which overflows
    # long before e^{-G} does. Every no-graph call in range takes this route, patched or not, so that a patch never
    # moves an unpatched position, not even by rounding.
    if not grad and span <= max_span:                                                          # stage 1
        ops = _lifted_operands(q, k, x, a, write_scale, extra_write, G, base2, channel, scale,
                               B, T, H, N, C, dtype, new)
    else:
        if base2:
            G.mul_(LN2)                          # back to natural units for the sub-block pivots
        ops = _pivoted_operands(q, k, x, a, write_scale, extra_write, G, channel, scale, bool(capture), grad,
                                B, T, H, N, C, dtype, new)
    rhs, L_inv, R0, M = _wy_stage(ops, C, grad, new)                                           # stages 2, 3
    want = {p // C for p in capture} if capture else set()      # chunks whose start state a capture needs
    if grad:                                                                                   # stages 4, 5
        R, terms, finals, starts = _state_pass_graph(ops, R0, M, segments, want, dtype)
        o = _output_pass(terms, ops, R, B, H, N, C, q.dtype, grad)
    elif L_inv is None:
        R = ops.xc
        O = torch.matmul(ops.A_qk, R, out=new(N, B * H, C, V, dtype=dtype))
        if ops.A_qu is not None:
            O.view(-1, C, V).baddbmm_(ops.A_qu.reshape(-1, C, C), ops.yc.reshape(-1, C, V))
        finals, starts = _state_pass_no_erase(ops, O, segments, shared, want, final_state, B, H, new)
        o = _output_pass(O, ops, R, B, H, N, C, q.dtype, grad, add_within=False, unpack=unpack)
    else:
        R, O, finals, starts = _state_pass_erase(ops, rhs, L_inv, segments, shared, want, final_state, B, H, new)
        o = _output_pass(O, ops, R, B, H, N, C, q.dtype, grad, unpack=unpack)
    states = None
    if capture:                                                                                # stage 6
        caps = _capture_states(capture, C, starts, R, ops.cap_keys, ops.cap_extra, ops.yc, ops.cap_factors)
        states = caps.view(B, H, len(capture), K, V).transpose(1, 2)
    return o, finals, states


def _varlen(q, k, x, g, a, scale, initial_state, write_scale, extra_write, capture, dtype, chunk_size, final_state,
            grad, new, cu_seqlens):
    """Packed sequences (B = 1, cu_seqlens offsets into T): each sequence is copied to start a chunk of its own
    (zero rows pad its last chunk: no decay, no write, so the state passes through them unchanged), the chunks run
    as one batch of segments, and the outputs are gathered back. Padding costs at most C - 1 rows per sequence, not
    the longest sequence's length. Empty sequences keep their initial state (or zero)."""
    bounds = [int(b) for b in cu_seqlens]
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    n_seq, T = len(lengths), q.shape[1]
    H, K, V = x.shape[2], q.shape[-1], x.shape[-1]
    C = _chunk_length(chunk_size, a is not None, max(lengths, default=0))
    device = q.device
    segments, spans, dst, at = [], [], [], 0              # spans: (lo, hi, first row of the layout) per sequence
    for i, L in enumerate(lengths):
        if L:
            dst.append(torch.arange(at * C, at * C + L, device=device))
            init = None if initial_state is None else initial_state[i].to(dtype)
            segments.append(_Segment(at, at + -(-L // C), init))
            spans.append((bounds[i], bounds[i + 1], at * C))
            at += -(-L // C)
    N = at

    def empty_state(i):
        if initial_state is None:
            return torch.zeros(H, K, V, dtype=dtype, device=device)
        return initial_state[i].to(dtype).clone()

    if N == 0:
        o = x.new_zeros(1, 0, H, V).to(q.dtype)
        S = torch.stack([empty_state(i) for i in range(n_seq)]) if final_state else None
        return o, S, None
    dst = torch.cat(dst)                                   # packed step -> chunk-major step

    def pack(t):
        """t (1, T, ·) -> (1, N*C, ·), each sequence from its own chunk on: one contiguous copy per sequence (an
        index_copy over T ran 5x slower), the padding rows zeroed."""
        if t is None:
            return None
        if grad:
            out = t.new_zeros(1, N * C, *t.shape[2:])
        else:
            out = new(1, N * C, *t.shape[2:], dtype=t.dtype)
        for (lo, hi, row), seg in zip(spans, segments):
            out[:, row:row + hi - lo] = t[:, lo:hi]
            if not grad:
                out[:, row + hi - lo:seg.stop * C].zero_()
        return out

    packed = [pack(t) for t in (q, k, x, g, a, write_scale)]
    ew = None if extra_write is None else (pack(extra_write[0]), pack(extra_write[1]))
    cap = None if not capture else dst[torch.as_tensor(capture, device=device)].tolist()
    o, finals, states = _chunks(*packed[:5], scale, packed[5], ew, cap, dtype, 1, N * C, H, N, C, segments, False,
                                final_state, grad, new, (T, spans))
    if grad:                                               # without a graph the output pass unpacked it already
        o = o.index_select(1, dst)
    S = None
    if final_state:
        by_seq = iter(finals)
        S = torch.stack([next(by_seq).reshape(H, K, V) if L else empty_state(i) for i, L in enumerate(lengths)])
    return o, S, states
