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
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from recurscope.kernels import scratch

SUB = 16  # sub-chunk for the per-channel decay pivots
LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def default_chunk_size(erase: bool) -> int:
    """Steps per chunk when the caller names none. A chunk's pairwise terms cost O(C (K + V)) per step and the
    sequential products O(K V) whatever C is, so a shorter chunk does less work; with an erase vector (the inverse
    and its product) 32 steps ran 0.85-0.93x the time of 64 on one CPU thread at K = V = 128, without one (GLA) 64
    ran faster (docs/performance.md)."""
    return 32 if erase else 64


def _pairwise_scalar(xs, ym, G):
    """For each x in xs: A[t, s] = (x_t . y_s) e^{G_t - G_s} for s <= t, zero above; G is (..., C)."""
    C = G.shape[-1]
    above = torch.ones(C, C, dtype=torch.bool, device=G.device).triu(1)
    dec = (G[..., :, None] - G[..., None, :]).masked_fill_(above, float("-inf")).exp_()
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
    blocks are recomputed from the materialised pairwise decays. The y side is shared by every x.
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
        xq = X[..., rows, :] * (G[..., rows, :] - pivot).exp()[..., None, :, :]
        lift = pivot - G[..., : i + SUB, :]
        if span > max_span:
            # Clamped so that a block spanning more decay than max_span stays finite (also in the backward pass);
            # only those blocks' diagonal entries can be affected, and they are recomputed exactly below.
            lift = lift.clamp(max=max_span)
        yk = ym[..., : i + SUB, :] * lift.exp()
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
    dec = diff.masked_fill(~keep[..., None], float("-inf")).exp()
    blocks = torch.einsum("...tk,...sk,...tsk->...ts", split(xm), split(ym), dec)
    out = out.clone()
    for j in range(n):
        out[..., j * SUB:(j + 1) * SUB, j * SUB:(j + 1) * SUB] = blocks[..., j, :, :]
    return out


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


def _chunk_major(t, B, T, H, N, C, dtype, scale=None, new=None):
    """(B, T, H[, D]) -> (N, B*H, C, D), zero-padded to N*C steps: one contiguous copy (cast and scale included),
    so that each step of the sequential loop reads one block. A per-head tensor (B, T, H) becomes (N, B*H, C).
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
    dst = out.permute(1, 0, 3, 2, 4)                       # (B, N, C, H, D) view of the chunk-major buffer
    # Without a graph the scale is applied in the copy itself (out= records none), when no cast would round first.
    fused = scale is not None and not grad and t.dtype == dtype
    put = (lambda d, src: torch.mul(src, scale, out=d)) if fused else (lambda d, src: d.copy_(src))
    full = T // C
    if full:
        put(dst[:, :full], t[:, : full * C].reshape(B, full, C, H, D))
    if T > full * C:
        put(dst[:, full, : T - full * C], t[:, full * C:])
        if not grad and new is not None:
            dst[:, full, T - full * C:].zero_()
    out = out.view(N, B * H, C, D)
    if scale is not None and not fused:
        out = out * scale if grad else out.mul_(scale)
    return out[..., 0] if squeeze else out


def _into_chunk_major(t, factor, B, T, H, N, C, out, op=torch.mul):
    """out = op(t, factor) with t (B, T, H, D) in the caller's layout and factor and out chunk-major, (N, B*H, C, ·):
    the layout change and the scaling in one pass over t (a copy when factor is None). Rows past T are zeroed."""
    D = t.shape[-1]
    dst = out.view(N, B, H, C, D).permute(1, 0, 3, 2, 4)          # (B, N, C, H, D)
    fac = None if factor is None else factor.view(N, B, H, C, -1).permute(1, 0, 3, 2, 4)
    full = T // C
    for lo, n, steps in ((0, slice(0, full), full * C), (full * C, full, T - full * C)):
        if not steps:
            continue
        src = t[:, lo:lo + steps]
        if isinstance(n, slice):
            src, d, f = src.reshape(B, full, C, H, D), dst[:, n], None if fac is None else fac[:, n]
        else:
            d, f = dst[:, n, :steps], None if fac is None else fac[:, n, :steps]
            dst[:, n, steps:].zero_()
        if f is None:
            d.copy_(src)
        else:
            op(src, f, out=d)
    return out


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


class _Lifted(NamedTuple):
    """The operands of the chunk-start-pivoted route, chunk-major (N, B*H, C, ·); None where a call has none."""
    qg: torch.Tensor                  # q_t e^{G_t}, unscaled (the output scale is applied in the final layout pass)
    ag: Optional[torch.Tensor]        # a_t e^{G_t}
    kd: torch.Tensor                  # k_s e^{G_C - G_s}
    ud: Optional[torch.Tensor]        # u_s e^{G_C - G_s}
    xc: torch.Tensor                  # the (write-scaled) x
    yc: Optional[torch.Tensor]        # the extra write's y
    A_qk: torch.Tensor                # pairwise terms, lower triangles, (N, B*H, C, C)
    A_ak: Optional[torch.Tensor]
    A_qu: Optional[torch.Tensor]
    A_au: Optional[torch.Tensor]
    gam: torch.Tensor                 # e^{G_t}: (N, B*H, C, K), or (N, B*H, C, 1) for a per-head decay
    decay_row: torch.Tensor           # e^{G_C}: (N, B*H, 1, K) or (N, B*H, 1, 1)


def _lifted_operands(q, k, x, a, write_scale, extra_write, G, channel, B, T, H, N, C, dtype, new):
    """Every operand of a no-graph call whose decays allow the chunk-start pivot (|G_t| <= max_span), each formed
    from the caller's tensor in one pass that fuses the layout change with its decay factor. The row vectors carry
    e^{G_t} and the column vectors e^{-G_s} (k_lift = k e^{-G}), so a pairwise term is one full product, masked
    (_pairwise_lifted); and k e^{G_C - G_s} = k_lift e^{G_C} is k_lift scaled in place once the products have read
    it. With an erase vector,
    a e^{G} and q e^{G} are the two row halves of one buffer: each pairwise term is then one product. A per-channel
    G arrives in base 2 (the caller summed g log2 e), a per-head one in natural units. new(*shape, dtype=) allocates
    every buffer."""
    K = q.shape[-1]
    BH = B * H
    if channel:
        G_last = G[..., -1:, :].clone()
        gam = G.exp2_()                          # G is in base 2 here, this call's own and not read again
        decay_row = G_last.exp2_()               # (N, BH, 1, K)
    else:
        gam = G.exp()[..., None]                 # (N, BH, C, 1)
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
    A_qu = A_au = ud = yc = None
    if extra_write is not None:
        u_lift = into(extra_write[0], gam, block(C), torch.div)
        A_qu, A_au = pairwise(u_lift)
        ud = u_lift.mul_(decay_row)
        yc = into(extra_write[1], None, block(C, extra_write[1].shape[-1]))
    ws = None if write_scale is None else _chunk_major(write_scale, B, T, H, N, C, dtype, None, new)[..., None]
    xc = into(x, ws, block(C, x.shape[-1]))
    return _Lifted(qg, ag, kd, ud, xc, yc, A_qk, A_ak, A_qu, A_au, gam, decay_row)


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


def _shared_state_product(P, S0, B, H):
    """P S0 for rows (B*H, C, K) that all start from one state per head, S0 (H, K, V): per head one
    (B*C, K) x (K, V) product instead of B small ones, and S0 is never copied per row. Returns (H, B, C, V)."""
    BH, C, K = P.shape
    Ph = P.view(B, H, C, K).transpose(0, 1).reshape(H, B * C, K)
    return torch.bmm(Ph, S0).view(H, B, C, -1)


def recurrence_chunked(
    q, k, x, g, a=None, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float32, chunk_size: Optional[int] = None,
    final_state: bool = True,
):
    """Same contract as `recurrence_reference`; differentiable. Inputs are assumed validated.

    final_state=False returns None for the final state, and without autograd the last chunk's state update is
    skipped. An initial_state expanded along the batch (stride 0 in B, e.g. S[:1].expand(B, ...)) is read as one
    state per head, never copied per row: many rows continuing one prefix (the head scan) cost one product per head.
    Without autograd the large temporaries come from this thread's scratch pool (kernels.scratch); what is returned
    never does.
    """
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (q, k, x, g, a, initial_state, write_scale, *(extra_write or ())))
    with scratch.lease(q.device, enabled=not grad) as new:
        return _recurrence_chunked(q, k, x, g, a, scale, initial_state, write_scale, extra_write, capture, dtype,
                                   chunk_size, final_state, grad, new)


def _recurrence_chunked(q, k, x, g, a, scale, initial_state, write_scale, extra_write, capture, dtype, chunk_size,
                        final_state, grad, new):
    """The body of recurrence_chunked; new(*shape, dtype=) gives a temporary that must not outlive the call."""
    B, T, H, K = q.shape
    V = x.shape[-1]
    BH = B * H
    channel = g.dim() == 4
    if chunk_size is None:
        chunk_size = default_chunk_size(a is not None)
    C = min(chunk_size, -(-T // SUB) * SUB)
    if C % SUB:
        raise ValueError(f"chunk_size must be a multiple of {SUB}, got {chunk_size}")
    N = -(-T // C)

    prep = lambda t, s=None: _chunk_major(t, B, T, H, N, C, dtype, s, new)  # noqa: E731
    # A per-channel decay without autograd is summed in base 2 (g log2 e, then 2^G): torch's exp2 ran about 3x faster
    # than exp on this project's CPU, and one exponential per step and channel is the largest elementwise pass of
    # those families. Scaling each g before the sum keeps the exponent's rounding at the sum's own.
    base2 = channel and not grad
    if base2:
        G = _log2_decay_sums(g, B, T, H, N, C, dtype, new)
    else:
        G = prep(g).cumsum(-2 if channel else -1)
    max_span = 60.0 if dtype == torch.float32 else 600.0
    # The decay from the chunk's start, G_t, within [-max_span, max_span] lets the pairwise terms pivot at the chunk's
    # start (one host read decides; past the range they pivot at every SUB-step block, exact for any decay). Only
    # without autograd: the backward of y / e^{G} carries e^{-2G}, which overflows long before e^{-G} does.
    start_pivot = False
    if not grad:
        lo, hi = (float(v) for v in torch.stack(torch.aminmax(G.detach())).tolist())
        start_pivot = max(abs(lo), abs(hi)) * (LN2 if base2 else 1.0) <= max_span
    if base2 and not start_pivot:
        G.mul_(LN2)                              # back to natural units for the sub-block pivots
    out_scale = 1.0
    lifted = None
    if start_pivot:
        # Every no-graph call whose decays allow it (patched or not, so that a patch never moves an unpatched
        # position, not even by rounding): the operands straight from the caller's tensors, the output scale in the
        # final layout pass.
        lifted = _lifted_operands(q, k, x, a, write_scale, extra_write, G, channel, B, T, H, N, C, dtype, new)
        qg, ag, kd, ud, xc, yc = lifted.qg, lifted.ag, lifted.kd, lifted.ud, lifted.xc, lifted.yc
        A_qk, A_qu = lifted.A_qk, lifted.A_qu
        A_ak = [] if lifted.A_ak is None else [lifted.A_ak]
        A_au = [] if lifted.A_au is None else [lifted.A_au]
        decay_C = lifted.decay_row.transpose(-1, -2)   # (N, BH, K, 1), or (N, BH, 1, 1)
        UY = None if ud is None else torch.matmul(ud.transpose(-1, -2), yc, out=new(N, BH, K, V, dtype=dtype))
        out_scale = scale
    else:
        qc, kc, xc = prep(q, scale), prep(k), prep(x)     # the output scale rides on q
        if write_scale is not None:
            wc = prep(write_scale)[..., None]
            xc = xc * wc if grad else xc.mul_(wc)
        ac = None if a is None else prep(a)
        uc, yc = (None, None) if extra_write is None else (prep(extra_write[0]), prep(extra_write[1]))
        # Without autograd and captures (which read k, u and G later), the chunk-major copies are this call's own and
        # are scaled in place once read: fresh buffers cost page faults on every call.
        consume = not grad and not capture
        scaled = lambda t, f: None if t is None else (t.mul_(f) if consume else t * f)  # noqa: E731
        if channel:
            G_last = G[..., -1:, :].clone()
            to_end = torch.sub(G_last, G)            # e^{G_C - G_s}
            to_end = to_end.exp_() if not grad else to_end.exp()
            gam = G.exp()                            # e^{G_t}, (N, BH, C, K); G itself is read again by the pivots
            decay_C = G_last.exp().transpose(-1, -2)  # (N, BH, K, 1)
            pair = lambda xs, ym: _pairwise_channel(xs, ym, G, max_span)  # noqa: E731
        else:
            G_last = G[..., -1:]
            gam = G.exp()[..., None]
            to_end = (G_last - G).exp()[..., None]
            decay_C = G_last.exp()[..., None]        # (N, BH, 1, 1)
            pair = lambda xs, ym: _pairwise_scalar(xs, ym, G)  # noqa: E731
        rows = [qc] if ac is None else [qc, ac]
        A_qk, *A_ak = pair(rows, kc)
        A_qu, *A_au = (None,) if uc is None else pair(rows, uc)
        qg = scaled(qc, gam)                         # q_t e^{G_t}: the output's state term
        ag = scaled(ac, gam)                         # a_t e^{G_t}: the erase's state term
        kd = scaled(kc, to_end)                      # k_s e^{G_C - G_s}
        ud = scaled(uc, to_end)
        UY = None if ud is None else ud.transpose(-1, -2) @ yc

    # Chunk-local solve: R = L^-1 (rhs - (a e^G) S_0) with L = I + A_ak. The system's diagonal is 1 and its upper
    # triangle is never read, so A_ak goes in as it is. With autograd, R = R0 - M S_0 (R0 = L^-1 rhs, M = L^-1 a e^G)
    # for all chunks at once; without, L^-1 is applied inside the loop to one chunk's right side, which on a CPU
    # costs less than the two batched products with their short inner dimension (docs/performance.md).
    rhs = xc
    if yc is not None and ag is not None:             # an extra write with an erase
        strict = ~torch.eye(C, dtype=torch.bool, device=q.device)
        rhs = rhs - (A_au[0] * strict) @ yc
    L_inv = None if ag is None else _unit_lower_inverse(A_ak[0], None if grad else new)  # faster than solves
    if ag is not None and grad:
        R0, M = L_inv @ rhs, L_inv @ ag
    else:
        R0, M = rhs, None

    # The sequential part, one chunk per step; the output of a chunk is formed as soon as its residuals are known.
    kd_T = kd.transpose(-1, -2)                  # (N, BH, K, C)
    want = {p // C for p in capture} if capture else set()      # chunks whose start state a capture needs
    starts = {}
    if grad:
        # Autograd records every product, so nothing that a product saved may change afterwards: no in-place updates.
        S = q.new_zeros(BH, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype).reshape(BH, K, V)
        outs, Rs = [], []
        for n in range(N):
            if n in want:
                starts[n] = S
            R_n = R0[n] if M is None else torch.baddbmm(R0[n], M[n], S, alpha=-1.0)
            Rs.append(R_n)
            outs.append(torch.baddbmm(A_qk[n] @ R_n, qg[n], S))
            S_next = decay_C[n] * S if UY is None else torch.addcmul(UY[n], decay_C[n], S)
            S = torch.baddbmm(S_next, kd_T[n], R_n)
        O = torch.stack(outs)
        R = Rs                                   # per-chunk residuals, indexed by chunk like the buffer below
        if A_qu is not None:
            O = O + A_qu @ yc
    else:
        # No graph: one preallocated output, each chunk's right side (our own) rid of its state term in place, the
        # state updated in place from the second chunk on. The first chunk only reads the initial state (its update
        # is out of place), so the caller's state is never copied or written; a batch-expanded initial state stays
        # one state per head.
        shared = initial_state is not None and B > 1 and initial_state.stride(0) == 0
        if initial_state is None:
            S = q.new_zeros(BH, K, V, dtype=dtype)
        elif shared:
            S = initial_state[0].to(dtype)                          # (H, K, V), one per head
        else:
            S = initial_state.to(dtype).reshape(BH, K, V)
        R = R0
        update_last = final_state          # captures need the chunk start states and residuals, not S_N
        if L_inv is None:
            # Without an erase the residuals are the inputs, so all but the chunk start states is batched over the
            # chunks: P[n] = e^{G_C} P[n-1] + K_n^T R_n (P[-1] = S_0), the state after chunk n, is formed in place in
            # K^T R's buffer (one elementwise step per chunk), and the state term of every later chunk is one product.
            O = torch.matmul(A_qk, R, out=new(N, BH, C, V, dtype=dtype))
            if A_qu is not None:
                O.view(-1, C, V).baddbmm_(A_qu.reshape(-1, C, C), yc.reshape(-1, C, V))
            if initial_state is not None:
                if shared:
                    O[0].view(B, H, C, V).add_(_shared_state_product(qg[0], S, B, H).transpose(0, 1))
                else:
                    O[0].baddbmm_(qg[0], S)
            if 0 in want:
                starts[0] = S.expand(B, H, K, V).reshape(BH, K, V) if shared else S.clone()
            if N > 1 or update_last:
                P = torch.matmul(kd_T, R, out=new(N, BH, K, V, dtype=dtype))
                if UY is not None:
                    P.add_(UY)
                if initial_state is not None:
                    if shared:
                        P[0].view(B, H, K, V).add_(decay_C[0].view(B, H, -1, 1) * S)
                    else:
                        P[0].addcmul_(decay_C[0], S)
                for n in range(1, N):
                    P[n].addcmul_(decay_C[n], P[n - 1])
                if N > 1:
                    O[1:].view(-1, C, V).baddbmm_(qg[1:].reshape(-1, C, K), P[:-1].reshape(-1, K, V))
                for n in want - {0}:
                    starts[n] = P[n - 1]
                S = P[N - 1].clone() if update_last else None   # a copy, so the final state does not hold P
            else:
                S = None
        else:
            O = new(N, BH, C, V, dtype=dtype)
            R = new(*rhs.shape, dtype=dtype)  # rhs is this call's own: each chunk's state term is taken off in place
            if A_qu is not None:
                torch.matmul(A_qu, yc, out=O)
            written = A_qu is not None       # O already holds a term, so the state term adds to it
            # Per-chunk views taken in one call each: indexing in the loop costs a Python-level call per use.
            rhs_n, ag_n, L_n, R_l, O_n, qg_n, kdT_n, dec_n, UY_n = (
                None if t is None else t.unbind(0) for t in (rhs, ag, L_inv, R, O, qg, kd_T, decay_C, UY))
            for n in range(N):
                first, last = n == 0, n == N - 1
                if n in want:
                    if first and shared:
                        starts[n] = S.expand(B, H, K, V).reshape(BH, K, V)
                    else:
                        # the caller's start state is never written; ours (zeros, later chunks) is updated in place
                        starts[n] = S if first and initial_state is not None else S.clone()
                if first and shared:
                    rhs_n[n].view(B, H, C, V).sub_(_shared_state_product(ag_n[n], S, B, H).transpose(0, 1))
                elif not (first and initial_state is None):                # a zero start takes nothing off
                    rhs_n[n].baddbmm_(ag_n[n], S, alpha=-1.0)
                R_n = torch.bmm(L_n[n], rhs_n[n], out=R_l[n])
                # The state term of the output, (q e^G) S_0; the within-chunk term A_qk R follows for all chunks.
                if first and shared:
                    term = _shared_state_product(qg_n[n], S, B, H).transpose(0, 1)
                    O_n[n].view(B, H, C, V).add_(term) if written else O_n[n].view(B, H, C, V).copy_(term)
                elif first and initial_state is None:                    # a zero start adds nothing
                    if not written:
                        O_n[n].zero_()
                elif written:
                    O_n[n].baddbmm_(qg_n[n], S)
                else:
                    torch.bmm(qg_n[n], S, out=O_n[n])
                if last and not update_last:
                    S = None
                    break
                if first and initial_state is not None:
                    # Out of place: e^{G_C} S_0 as a new (BH, K, V) state (broadcast over rows when S_0 is shared).
                    if shared:
                        S = (dec_n[n].view(B, H, -1, 1) * S).view(BH, K, V)
                    else:
                        S = dec_n[n] * S
                else:
                    S.mul_(dec_n[n])
                S.baddbmm_(kdT_n[n], R_n)
                if UY is not None:
                    S.add_(UY_n[n])
            # R now holds every chunk's residuals: the within-chunk output is one batched product.
            O.view(N * BH, C, V).baddbmm_(A_qk.reshape(N * BH, C, C), R.view(N * BH, C, V))
    o = O.view(N, B, H, C, V).permute(1, 0, 3, 2, 4)
    if not grad:
        # The layout, the scale and the cast in one pass, into a buffer of the caller's own (O may be scratch).
        dst = torch.empty(B, N, C, H, V, dtype=q.dtype, device=q.device)
        o = torch.mul(o, out_scale, out=dst) if out_scale != 1.0 else dst.copy_(o)
    o = o.reshape(B, N * C, H, V)[:, :T].to(q.dtype)

    states = None
    if capture:
        def factors(n, i):
            if lifted is not None:
                # kd_s e^{G_p} / e^{G_C} = k_s e^{G_p - G_s}, each factor within the dtype's range on this route
                gam_p = lifted.gam[n][:, i]                              # (BH, K) or (BH, 1)
                return gam_p[..., None], (gam_p / lifted.decay_row[n][:, 0])[:, None]
            Gn = G[n]                                                    # (BH, C, K) or (BH, C)
            dec = (Gn[:, i:i + 1] - Gn[:, : i + 1]).exp()
            return (Gn[:, i].exp()[..., None], dec) if channel else (Gn[:, i].exp()[:, None, None], dec[..., None])

        keys, extra_keys = (kd, ud) if lifted is not None else (kc, uc)
        caps = _capture_states(capture, C, starts, R, keys, extra_keys, yc, factors)
        states = caps.view(B, H, len(capture), K, V).transpose(1, 2)
    return o, (S.reshape(B, H, K, V) if final_state and S is not None else None), states
