"""The chunked (WY/UT-transform) form of the recurrence in PyTorch: the fast, differentiable path on a CPU.

Within a chunk of C steps starting from S_0, write r_t for the residual that step t adds along k_t:

    S_t = D_t S_{t-1} + k_t r_t^T + u_t y_t^T,   r_t = x_t - (D_t S_{t-1})^T a_t

Unrolling with the cumulative log decay G_t gives a unit lower-triangular system for all r_t of a chunk,
    (I + A_ak) R = X - (a * e^G) S_0 - A_au Y,    A_xy[t, s] = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]},
solved once per chunk, so that only one (K, K) @ (K, V) product per chunk remains sequential.
Decay factors are only ever formed as e^{G_t - G_s} with t >= s (or through a pivot that keeps each factor
bounded), so strong decays never overflow.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

SUB = 16  # sub-chunk for the per-channel decay pivots


def _pairwise_scalar(xm, ym, G, strict):
    """A[t, s] = (x_t . y_s) e^{G_t - G_s} for s <= t (s < t if strict); G is (..., C)."""
    C = G.shape[-1]
    diff = G[..., :, None] - G[..., None, :]
    keep = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    return (xm @ ym.transpose(-1, -2)) * diff.masked_fill(~keep, float("-inf")).exp()


def _pairwise_channel(xm, ym, G, strict, max_span):
    """A[t, s] = sum_k x_t[k] y_s[k] e^{G_t[k] - G_s[k]} for s <= t (s < t if strict); G is (..., C, K).

    Each block of SUB rows is measured from a pivot p just before it: x_t e^{G_t - G_p} <= 1, and
    y_s e^{G_p - G_s} <= 1 for earlier s. Inside the row block y_s e^{G_p - G_s} grows at most by the
    decay spanned by the block, which `max_span` keeps within the dtype's range; otherwise the diagonal
    blocks are recomputed from the materialised pairwise decays.
    """
    C = G.shape[-2]
    out = xm.new_zeros(*xm.shape[:-2], C, C)
    G0 = F.pad(G, (0, 0, 1, 0))  # G0[..., i] = cumulative decay before position i
    for i in range(0, C, SUB):
        rows = slice(i, i + SUB)
        pivot = G0[..., i:i + 1, :]
        xq = xm[..., rows, :] * (G[..., rows, :] - pivot).exp()
        yk = ym[..., : i + SUB, :] * (pivot - G[..., : i + SUB, :]).exp()
        out[..., rows, : i + SUB] = xq @ yk.transpose(-1, -2)
    span = float((G0[..., 0:C:SUB, :] - G0[..., SUB::SUB, :]).max()) if C >= SUB else 0.0
    if span > max_span:
        out = _exact_diagonal_blocks(out, xm, ym, G)
    keep = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    return out.masked_fill(~keep, 0.0)


def _exact_diagonal_blocks(out, xm, ym, G):
    """Recomputes the SUB x SUB diagonal blocks with the pairwise decay materialised (the safe slow path)."""
    C, K = G.shape[-2:]
    lead = G.shape[:-2]
    n = C // SUB
    Gb = G.reshape(*lead, n, SUB, K)
    diff = Gb[..., :, None, :] - Gb[..., None, :, :]
    keep = torch.ones(SUB, SUB, dtype=torch.bool, device=G.device).tril()
    dec = diff.masked_fill(~keep[..., None], float("-inf")).exp()
    blocks = torch.einsum("...tk,...sk,...tsk->...ts", xm.reshape(*lead, n, SUB, K), ym.reshape(*lead, n, SUB, K), dec)
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
    channel = g.dim() == 4
    C = min(chunk_size, -(-T // SUB) * SUB)
    if C % SUB:
        raise ValueError(f"chunk_size must be a multiple of {SUB}, got {chunk_size}")
    pad = (-T) % C
    N = (T + pad) // C

    def prep(t, last_dims):
        t = t.to(dtype).transpose(1, 2)  # (B, H, T, ...)
        if pad:
            t = F.pad(t, (0, 0) * last_dims + (0, pad))
        return t.reshape(B, H, N, C, *t.shape[3:])

    xw = x if write_scale is None else x.to(dtype) * write_scale[..., None].to(dtype)
    qc, kc, xc = prep(q, 1), prep(k, 1), prep(xw, 1)
    gc = prep(g, 1 if channel else 0)
    ac = None if a is None else prep(a, 1)
    uc, yc = (None, None) if extra_write is None else (prep(extra_write[0], 1), prep(extra_write[1], 1))

    G = gc.cumsum(-2 if channel else -1)
    G_last = G[..., -1:, :] if channel else G[..., -1:]
    if channel:
        gam = G.exp()                        # e^{G_t}, (..., C, K)
        to_end = (G_last - G).exp()          # e^{G_C - G_s}
        gam_C = G_last.exp()                 # (..., 1, K)
        max_span = 60.0 if dtype == torch.float32 else 600.0
        pair = lambda xm, ym, strict: _pairwise_channel(xm, ym, G, strict, max_span)  # noqa: E731
    else:
        gam = G.exp()[..., None]
        to_end = (G_last - G).exp()[..., None]
        gam_C = G_last.exp()[..., None]      # (..., 1, 1)
        pair = lambda xm, ym, strict: _pairwise_scalar(xm, ym, G, strict)  # noqa: E731

    # Chunk-local solve: R = R0 - M S_0.
    rhs = xc
    if uc is not None:
        A_au = pair(ac, uc, True) if ac is not None else None
        if A_au is not None:
            rhs = rhs - A_au @ yc
    if ac is not None:
        L = pair(ac, kc, True) + torch.eye(C, dtype=dtype, device=q.device)
        sol = torch.linalg.solve_triangular(L, torch.cat([rhs, ac * gam], -1), upper=False, unitriangular=True)
        R0, M = sol[..., :V], sol[..., V:]
    else:
        R0, M = rhs, None

    A_qk = pair(qc, kc, False)
    O_local = A_qk @ R0
    P = qc * gam if M is None else qc * gam - A_qk @ M
    if uc is not None:
        O_local = O_local + pair(qc, uc, False) @ yc

    # The sequential part: S_{n+1} = Phi_n S_n + KR0_n.
    kd_T = (kc * to_end).transpose(-1, -2)  # (B, H, N, K, C)
    KR0 = kd_T @ R0
    if uc is not None:
        KR0 = KR0 + (uc * to_end).transpose(-1, -2) @ yc
    decay_C = gam_C.transpose(-1, -2)        # (B, H, N, K, 1) or (B, H, N, 1, 1)
    KM = None if M is None else kd_T @ M
    S = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    starts = []
    for n in range(N):
        starts.append(S)
        S_next = decay_C[:, :, n] * S + KR0[:, :, n]
        if KM is not None:
            S_next = S_next - KM[:, :, n] @ S
        S = S_next
    S0 = torch.stack(starts, dim=2)          # (B, H, N, K, V)
    O = scale * (O_local + P @ S0)
    o = O.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2).to(q.dtype)

    states = None
    if capture:
        R = R0 if M is None else R0 - M @ S0
        caps = []
        for p in capture:
            n, i = divmod(p, C)
            if channel:
                dec = (G[:, :, n, i:i + 1] - G[:, :, n, : i + 1]).exp()             # (B, H, i+1, K)
                st = G[:, :, n, i].exp()[..., None] * S0[:, :, n]
            else:
                dec = (G[:, :, n, i:i + 1] - G[:, :, n, : i + 1]).exp()[..., None]
                st = G[:, :, n, i].exp()[..., None, None] * S0[:, :, n]
            st = st + (kc[:, :, n, : i + 1] * dec).transpose(-1, -2) @ R[:, :, n, : i + 1]
            if uc is not None:
                st = st + (uc[:, :, n, : i + 1] * dec).transpose(-1, -2) @ yc[:, :, n, : i + 1]
            caps.append(st)
        states = torch.stack(caps, dim=1)
    return o, S, states
