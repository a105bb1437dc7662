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

from typing import NamedTuple, Optional

import os

import torch

from recurscope.kernels._validate import _check_float, _expect, compute_dtype, validate

DEFAULT_CHUNK = 4       # the (C, C, K) decay factors cost C K per step: see experiments.bench.low_rank
LOW_RANK_BACKENDS = ("auto", "reference", "chunked", "triton")


class LowRankOutput(NamedTuple):          # the fields of kernels.RecurrenceOutput
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    states: Optional[torch.Tensor]


def recurrence_low_rank(
    q, k, x, g, a, b, *, scale=None, initial_state=None, write_scale=None, extra_write=None, capture=None,
    output_final_state: bool = True, backend: str = "auto", check_finite: bool = True, chunk_size: int = DEFAULT_CHUNK,
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
    if check_finite and not bool(torch.isfinite(b).all()):
        raise ValueError("b contains non-finite value(s) (NaN or inf); clean the input before running the recurrence")
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
    chunk_size: int = DEFAULT_CHUNK,
):
    """The chunked form in PyTorch, differentiable by autograd; returns (o, final_state, states) like the reference.

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
