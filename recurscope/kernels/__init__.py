"""One recurrence for the linear-attention family, with three backends and patch features.

    S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T
    o_t = scale * S_t^T q_t

States are (B, H, K, V), key dimension first. Each model family is a choice of (g, a, x); see docs/kernels.md.
No __version__ here on purpose: Hugging Face publishes another import package named `kernels`.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from recurscope.kernels._validate import compute_dtype, validate
from recurscope.kernels.chunked import recurrence_chunked
from recurscope.kernels.erase import ERASE_ARMS, erase_eigenvalue, erase_vector, project_out
from recurscope.kernels.low_rank import recurrence_low_rank  # the decay-plus-low-rank form (RWKV-7), its own entry
from recurscope.kernels.reference import recurrence_reference
from recurscope.kernels.scratch import release_scratch, scratch_limit, set_scratch_limit

BACKENDS = ("auto", "reference", "chunked", "triton", "fla")

__all__ = [
    "BACKENDS", "ERASE_ARMS", "RecurrenceOutput", "erase_eigenvalue", "erase_vector", "l2_normalise", "project_out",
    "recurrence", "recurrence_low_rank", "release_scratch", "resolve_backend", "scratch_limit", "set_scratch_limit",
]


class RecurrenceOutput(NamedTuple):
    o: torch.Tensor                       # (B, T, H, V), q's dtype
    final_state: Optional[torch.Tensor]   # (B, H, K, V), float32 (float64 for float64 inputs)
    states: Optional[torch.Tensor]        # (B, P, H, K, V) at the capture positions, or None


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" means fla's chunk kernels on CUDA when fla imports (kernels.fla_chunk, which falls back to triton for
    what fla cannot express), triton on CUDA otherwise, and chunked elsewhere; RECURSCOPE_BACKEND overrides "auto"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get("RECURSCOPE_BACKEND", "").strip()
        if env:
            if env not in BACKENDS:
                raise ValueError(f"RECURSCOPE_BACKEND must be one of {BACKENDS}, got {env!r}")
            backend = env
    if backend == "auto":
        if device.type == "cuda":
            from recurscope.kernels.fla_chunk import fla_available

            backend = "fla" if fla_available() else "triton"
        else:
            backend = "chunked"
    if backend in ("triton", "fla") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend '{backend}' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton kernels are "
            "imported; use backend='chunked' on a CPU"
        )
    return backend


def recurrence(
    q, k, x, g, a=None, *, scale=None, initial_state=None, write_scale=None, extra_write=None,
    capture=None, output_final_state: bool = True, backend: str = "auto", check_finite: bool = True,
    cu_seqlens=None, chunk_size: Optional[int] = None, use_qk_l2norm: bool = False, beta=None,
    use_beta_sigmoid: bool = False, A_log=None, dt_bias=None,
    allow_growth: bool = False,
) -> RecurrenceOutput:
    """Runs the recurrence over (B, T, H, ·) inputs; see the module docstring for the math.

    write_scale (B, T, H) multiplies the k x^T term (0 blocks a write; decay and erase still act).
    extra_write (u, y) adds u_t y_t^T at every step. capture: sorted positions whose S_t (after step t)
    is returned in `states`. initial_state continues a previous run, which is what stepping means.
    output_final_state=False: the final state is not needed (None is returned), and the chunked backend skips the
    last state update. An initial_state expanded along the batch (stride 0, S[:1].expand(B, ...)) is read, not
    copied per row, by the chunked backend.
    check_finite=False skips the NaN/inf scan of every input (one host sync each); the models pass their `debug`
    flag here, so that a forward on a GPU does not wait on the host. Shapes, dtypes and devices are always checked.
    g may hold -inf (a hard reset: the state before it is forgotten).

    fla's options (docs/kernels.md, "Grouped heads, packed sequences and fla's options"):
    - grouped value heads: q and k (and optionally a and u) with H_k heads where x, g and the states have
      H = n H_k; value head h reads key head h // n. The chunked and triton backends, and the fla backend's gated
      delta rule, read q and k per key head (no copy); the reference backend (and fla's GLA kernels) get them
      repeated.
    - query groups (GLA-7B's grouped key/value heads, the mirror): q with H_q = m H heads where k, x, g and the
      states have H; query head h m + j reads state h, and o has the H_q query heads. The reference computes the m
      readouts of each state at every step; the other backends run once per member j of the groups, on the strided
      view of q's j-th query heads (k, x, g and the patches are read as given, never repeated), the captures and the
      final state from the first run only: m times the recurrence's work, as fla's repeat of k, v and g costs, and
      no copy of any input.
    - cu_seqlens: n + 1 offsets into T (B = 1): n packed sequences, each from its own initial state (n, H, K, V)
      to its own final state (n, H, K, V); empty sequences keep their initial state. capture counts packed steps.
      The chunked, triton and fla backends run the packed batch in one call (fla: its own cu_seqlens, split only
      where a capture or extra write cuts it); the reference backend loops over sequences.
    - chunk_size: the chunked backend's chunk length (a multiple of 16; other backends ignore it).
    - use_qk_l2norm: q and k are L2-normalised along K first (x / sqrt(|x|^2 + 1e-6), as fla).
    - beta (B, T, H): the delta rule's step, a = beta k and x = beta x (a must then be None); use_beta_sigmoid
      passes beta through a sigmoid first.
    - A_log (H,) and dt_bias ((H,), or (H, K) for a per-channel decay): g is the gate's raw input, and the decay
      is g = -exp(A_log) softplus(g + dt_bias), as Gated DeltaNet and KDA form it.
    These run as the same torch operations one would write outside, in the entry; none copies q or k per value head.
    With check_finite, a positive log-decay g (exp(g) > 1: the state grows) is refused; allow_growth=True admits it,
    for research on unstable transitions (every backend computes it; the chunked form loses precision as it grows).
    """
    q, k, x, g, a = _fla_options(q, k, x, g, a, use_qk_l2norm, beta, use_beta_sigmoid, A_log, dt_bias)
    dims, positions = validate(q, k, x, g, a, initial_state, write_scale, extra_write, capture,
                               check_finite=check_finite, cu_seqlens=cu_seqlens, allow_growth=allow_growth)
    chosen = resolve_backend(backend, q.device)
    scale = dims.K ** -0.5 if scale is None else float(scale)
    if dims.H_q != dims.H_k and chosen != "reference":
        return _query_groups(q, k, x, g, a, dims, scale=scale, initial_state=initial_state, write_scale=write_scale,
                             extra_write=extra_write, capture=positions, output_final_state=output_final_state,
                             backend=chosen, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    dtype = compute_dtype(q)
    kwargs = dict(scale=scale, initial_state=initial_state, write_scale=write_scale,
                  extra_write=extra_write, capture=positions)
    if chosen == "chunked":
        if cu_seqlens is not None:
            kwargs["cu_seqlens"] = _bounds(cu_seqlens)
        if chunk_size is not None:
            kwargs["chunk_size"] = chunk_size
        o, S, states = recurrence_chunked(q, k, x, g, a, dtype=dtype, final_state=output_final_state, **kwargs)
        return RecurrenceOutput(o, S if output_final_state else None, states)
    # a and u with the key heads are repeated over the value heads; the triton kernel reads q and k per key head and
    # runs packed sequences itself, the reference and fla paths take one sequence per row and q and k repeated.
    a = _value_heads(a, dims)
    if extra_write is not None:
        kwargs["extra_write"] = (_value_heads(extra_write[0], dims), extra_write[1])
    if chosen == "triton":
        from recurscope.kernels.triton_recurrent import recurrence_triton

        cu = None if cu_seqlens is None else _bounds(cu_seqlens)
        o, S, states = recurrence_triton(q, k, x, g, a, output_final_state=output_final_state, cu_seqlens=cu, **kwargs)
        return RecurrenceOutput(o, S if output_final_state else None, states)
    if chosen == "fla":
        from recurscope.kernels.fla_chunk import recurrence_fla

        cu = None if cu_seqlens is None else _bounds(cu_seqlens)
        o, S, states = recurrence_fla(q, k, x, g, a, output_final_state=output_final_state, cu_seqlens=cu, **kwargs)
        return RecurrenceOutput(o, S if output_final_state else None, states)
    if dims.H_k != dims.H:
        q, k = (t.repeat_interleave(dims.H // dims.H_k, dim=2) for t in (q, k))

    def run(q, k, x, g, a, **kw):
        return recurrence_reference(q, k, x, g, a, dtype=dtype, **kw)

    if cu_seqlens is None:
        o, S, states = run(q, k, x, g, a, **kwargs)
    else:
        o, S, states = _per_sequence(run, q, k, x, g, a, cu_seqlens, dtype, **kwargs)
    return RecurrenceOutput(o, S if output_final_state else None, states)


def _query_groups(q, k, x, g, a, dims, *, capture, output_final_state, **kw) -> RecurrenceOutput:
    """Query groups on a backend that reads one query per state: one run per member j, q's heads j, m + j, 2m + j,
    ... (a strided view); the first run also returns the captures and the final state. The inputs were validated
    and fla's options applied by the caller, so the member runs skip both."""
    m = dims.H_q // dims.H
    members = q.unflatten(2, (dims.H, m))
    outs, first = [], None
    for j in range(m):
        r = recurrence(members[:, :, :, j], k, x, g, a, capture=capture if j == 0 else None,
                       output_final_state=output_final_state and j == 0, check_finite=False, allow_growth=True, **kw)
        first = r if j == 0 else first
        outs.append(r.o)
    return RecurrenceOutput(torch.stack(outs, 3).flatten(2, 3), first.final_state, first.states)


def _bounds(cu_seqlens) -> list[int]:
    """cu_seqlens (a tensor or a sequence) as a list of ints (one host read for a tensor)."""
    return [int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens)]


def _value_heads(t, dims):
    """a or u given with the key heads: repeated over each group of value heads, for the backends that need it."""
    if t is None or t.shape[2] == dims.H:
        return t
    return t.repeat_interleave(dims.H // t.shape[2], dim=2)


def _per_sequence(run, q, k, x, g, a, cu_seqlens, dtype, *, scale, initial_state, write_scale, extra_write,
                  capture):
    """cu_seqlens for a backend without it: one call per non-empty sequence, outputs concatenated along T, final
    states stacked per sequence, captures gathered in order."""
    bounds = _bounds(cu_seqlens)
    H, K, V = x.shape[2], q.shape[-1], x.shape[-1]
    sl = lambda t, lo, hi: None if t is None else t[:, lo:hi]  # noqa: E731
    outs, finals, states = [], [], []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else initial_state[i:i + 1]
        if hi == lo:
            finals.append(torch.zeros(1, H, K, V, dtype=dtype, device=q.device) if init is None
                          else init.to(dtype if dtype == torch.float64 else torch.float32).clone())
            continue
        cap = [p - lo for p in (capture or []) if lo <= p < hi] or None
        ew = None if extra_write is None else (extra_write[0][:, lo:hi], extra_write[1][:, lo:hi])
        o, S, st = run(*(sl(t, lo, hi) for t in (q, k, x, g, a)), scale=scale, initial_state=init,
                       write_scale=sl(write_scale, lo, hi), extra_write=ew, capture=cap)
        outs.append(o)
        finals.append(S)
        if st is not None:
            states.append(st)
    o = torch.cat(outs, 1) if outs else x.new_zeros(1, 0, q.shape[2], V).to(q.dtype)
    S = None if any(f is None for f in finals) else torch.cat(finals)
    return o, S, torch.cat(states, 1) if states else None


def l2_normalise(t: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """t / sqrt(|t|^2 + eps) along the last axis, worked in at least float32 and returned in t's dtype: the L2 norm
    of q and k in fla's and transformers' delta rules (the one implementation the models and the bridge use)."""
    acc = t.to(torch.promote_types(t.dtype, torch.float32))
    return (acc * torch.rsqrt((acc * acc).sum(-1, keepdim=True) + eps)).to(t.dtype)


def _fla_options(q, k, x, g, a, use_qk_l2norm, beta, use_beta_sigmoid, A_log, dt_bias):
    """fla's in-kernel options as the torch operations they stand for; q and k keep their own (key) heads."""
    if use_qk_l2norm:
        q, k = (l2_normalise(t) for t in (q, k))
    if A_log is not None or dt_bias is not None:
        if A_log is None:
            raise ValueError("dt_bias without A_log: the gate g = -exp(A_log) softplus(g + dt_bias) needs both (or "
                             "pass the decay itself as g)")
        H = x.shape[2]
        if tuple(A_log.shape) != (H,):
            raise ValueError(f"A_log must have shape (H,) = ({H},), one per value head, got {tuple(A_log.shape)}")
        raw = g.float() if g.dtype != torch.float64 else g
        if dt_bias is not None:
            per = (H,) if g.dim() == 3 else (H, q.shape[-1])
            if dt_bias.numel() != math.prod(per):
                raise ValueError(f"dt_bias must hold {math.prod(per)} values, shape {per}, for g of shape "
                                 f"{tuple(g.shape)}, got {tuple(dt_bias.shape)}")
            raw = raw + dt_bias.reshape(per).to(raw.dtype)
        decay = -A_log.to(raw.dtype).exp()
        g = (decay if g.dim() == 3 else decay[:, None]) * F.softplus(raw)
    if beta is not None:
        if a is not None:
            raise ValueError("beta and a both given: beta forms the erase a = beta k (and the write beta x); pass one")
        if beta.dim() != 3 or tuple(beta.shape) != tuple(x.shape[:3]):
            raise ValueError(f"beta must have shape (B, T, H) = {tuple(x.shape[:3])}, got {tuple(beta.shape)}")
        if use_beta_sigmoid:
            beta = beta.sigmoid()
        H, Hk = x.shape[2], k.shape[2]
        b = beta[..., None]
        a = (b.unflatten(2, (Hk, H // Hk)) * k[:, :, :, None]).flatten(2, 3) if H != Hk else b * k
        x = b.to(x.dtype) * x
    elif use_beta_sigmoid:
        raise ValueError("use_beta_sigmoid needs beta")
    return q, k, x, g, a
