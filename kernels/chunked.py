"""The chunked (WY/UT-transform) form of the recurrence in PyTorch: the fast, differentiable path on a CPU.

Within a chunk of C steps starting from S_0, write r_t for the residual that step t adds along k_t:

    S_t = D_t S_{t-1} + k_t r_t^T + u_t y_t^T,   r_t = x_t - (D_t S_{t-1})^T a_t

Unrolling with the cumulative log decay G_t gives a unit lower-triangular system for all r_t of a chunk,
    (I + A_ak) R = X - (a * e^G) S_0 - A_au Y,    A_xy[t, s] = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]},
solved once per chunk for R = R0 - M S_0 (all chunks at once). The sequential part is then two
(C, K) x (K, V) products per chunk: R = R0 - M S_0 and S_C = e^{G_C} S_0 + (k e^{G_C - G})^T R.
Decay factors are only ever formed as e^{G_t - G_s} with t >= s (or through a pivot that keeps each factor
bounded), so strong decays never overflow.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

SUB = 16  # sub-chunk for the per-channel decay pivots


def _pairwise_scalar(xs, ym, G):
    """For each x in xs: A[t, s] = (x_t . y_s) e^{G_t - G_s} for s <= t, zero above; G is (..., C)."""
    C = G.shape[-1]
    diff = G[..., :, None] - G[..., None, :]
    keep = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    dec = diff.masked_fill(~keep, float("-inf")).exp()
    prods = torch.cat(xs, -2) @ ym.transpose(-1, -2)     # one product for every row set
    return [p * dec for p in prods.split(C, -2)]


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
    out = X.new_zeros(*X.shape[:-2], C, C)
    G0 = F.pad(G, (0, 0, 1, 0))                           # G0[..., i] = cumulative decay before position i
    for i in range(0, C, SUB):
        rows = slice(i, i + SUB)
        pivot = G0[..., i:i + 1, :]
        xq = X[..., rows, :] * (G[..., rows, :] - pivot).exp()[..., None, :, :]
        # Clamped so that a block spanning more decay than max_span stays finite (also in the backward pass);
        # only those blocks' diagonal entries can be affected, and they are recomputed exactly below.
        yk = ym[..., : i + SUB, :] * (pivot - G[..., : i + SUB, :]).clamp(max=max_span).exp()
        prod = xq.flatten(-3, -2) @ yk.transpose(-1, -2)  # (..., n*SUB, i+SUB)
        out[..., rows, : i + SUB] = prod.unflatten(-2, (n, -1))
    span = float((G0[..., 0:C:SUB, :] - G0[..., SUB::SUB, :]).detach().max()) if C >= SUB else 0.0
    if span > max_span:
        out = _exact_diagonal_blocks(out, X, ym[..., None, :, :], G[..., None, :, :])
    keep = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    return list(out.masked_fill(~keep, 0.0).unbind(-3))


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


def recurrence_chunked(
    q, k, x, g, a=None, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, dtype: torch.dtype = torch.float32, chunk_size: int = 64,
):
    """Same contract as `recurrence_reference`; differentiable. Inputs are assumed validated."""
    B, T, H, K = q.shape
    V = x.shape[-1]
    BH = B * H
    channel = g.dim() == 4
    C = min(chunk_size, -(-T // SUB) * SUB)
    if C % SUB:
        raise ValueError(f"chunk_size must be a multiple of {SUB}, got {chunk_size}")
    pad = (-T) % C
    N = (T + pad) // C

    def prep(t, has_last_dim=True):
        """(B, T, H, ...) -> (N, B*H, C, ...): chunk-major, so that each step of the loop reads one block."""
        t = t.to(dtype)
        if not has_last_dim:
            t = t[..., None]
        if pad:
            t = F.pad(t, (0, 0, 0, 0, 0, pad))
        t = t.reshape(B, N, C, H, t.shape[-1]).permute(1, 0, 3, 2, 4).reshape(N, BH, C, t.shape[-1])
        return t if has_last_dim else t[..., 0]

    xw = x if write_scale is None else x.to(dtype) * write_scale[..., None].to(dtype)
    qc, kc, xc = prep(q), prep(k), prep(xw)
    gc = prep(g, channel)
    ac = None if a is None else prep(a)
    uc, yc = (None, None) if extra_write is None else (prep(extra_write[0]), prep(extra_write[1]))

    G = gc.cumsum(-2 if channel else -1)
    if channel:
        G_last = G[..., -1:, :]
        gam = G.exp()                            # e^{G_t}, (N, BH, C, K)
        to_end = (G_last - G).exp()              # e^{G_C - G_s}
        decay_C = G_last.exp().transpose(-1, -2)  # (N, BH, K, 1)
        max_span = 60.0 if dtype == torch.float32 else 600.0
        pair = lambda xs, ym: _pairwise_channel(xs, ym, G, max_span)  # noqa: E731
    else:
        G_last = G[..., -1:]
        gam = G.exp()[..., None]
        to_end = (G_last - G).exp()[..., None]
        decay_C = G_last.exp()[..., None]        # (N, BH, 1, 1)
        pair = lambda xs, ym: _pairwise_scalar(xs, ym, G)  # noqa: E731

    strict = ~torch.eye(C, dtype=torch.bool, device=q.device)
    rows = [qc] if ac is None else [qc, ac]
    A_qk, *A_ak = pair(rows, kc)
    A_qu, *A_au = (None,) if uc is None else pair(rows, uc)

    # Chunk-local solve: R = R0 - M S_0, for all chunks at once.
    rhs = xc
    if uc is not None and ac is not None:
        rhs = rhs - (A_au[0] * strict) @ yc
    if ac is not None:
        eye = torch.eye(C, dtype=dtype, device=q.device)
        # The explicit inverse of the unit triangular system, then two products: faster than a solve with V+K columns.
        L_inv = torch.linalg.solve_triangular(A_ak[0] * strict + eye, eye.expand_as(A_qk), upper=False, unitriangular=True)
        R0, M = L_inv @ rhs, L_inv @ (ac * gam)
    else:
        R0, M = rhs, None

    # The sequential part, one chunk per step.
    kd_T = (kc * to_end).transpose(-1, -2).contiguous()  # (N, BH, K, C)
    UY = None if uc is None else (uc * to_end).transpose(-1, -2) @ yc
    S = q.new_zeros(BH, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype).reshape(BH, K, V)
    if M is None:
        KR = kd_T @ R0 if UY is None else torch.baddbmm(UY.flatten(0, 1), kd_T.flatten(0, 1), R0.flatten(0, 1)).view(N, BH, K, V)
    starts, Rs = [], []
    for n in range(N):
        starts.append(S)
        if M is None:
            S = decay_C[n] * S + KR[n]
        else:
            R_n = torch.baddbmm(R0[n], M[n], S, alpha=-1.0)
            Rs.append(R_n)
            S_next = decay_C[n] * S if UY is None else torch.addcmul(UY[n], decay_C[n], S)
            S = torch.baddbmm(S_next, kd_T[n], R_n)
    S0 = torch.stack(starts)                     # (N, BH, K, V)
    R = R0 if M is None else torch.stack(Rs)

    O = A_qk @ R + (qc * gam) @ S0
    if uc is not None:
        O = O + A_qu @ yc
    O = O * scale
    o = O.reshape(N, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T].to(q.dtype)

    states = None
    if capture:
        caps = []
        for p in capture:
            n, i = divmod(p, C)
            Gn = G[n]                                                    # (BH, C, K) or (BH, C)
            dec = (Gn[:, i:i + 1] - Gn[:, : i + 1]).exp()
            st = Gn[:, i].exp()[..., None] * S0[n] if channel else Gn[:, i].exp()[:, None, None] * S0[n]
            dec = dec if channel else dec[..., None]
            st = st + (kc[n, :, : i + 1] * dec).transpose(-1, -2) @ R[n, :, : i + 1]
            if uc is not None:
                st = st + (uc[n, :, : i + 1] * dec).transpose(-1, -2) @ yc[n, :, : i + 1]
            caps.append(st.reshape(B, H, K, V))
        states = torch.stack(caps, dim=1)
    return o, S.reshape(B, H, K, V), states
