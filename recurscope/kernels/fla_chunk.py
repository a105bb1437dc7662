"""The GPU path on fla's chunk kernels, with the patch features expressed exactly around them.

    S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T
    o_t = scale * S_t^T q_t

fla (0.6) has a chunk kernel for three of the forms this recurrence takes:
    no erase, per-channel decay (GLA)            fla.ops.gla.chunk_gla(q, k, v = x, g)
    no erase, per-head decay                     fla.ops.simple_gla.chunk_simple_gla(q, k, v = x, g)
    erase along the key, a = beta k, per-head    fla.ops.gated_delta_rule.chunk_gated_delta_rule(q, k, v = x / beta,
    decay (Gated DeltaNet, DeltaNet with g = 0)      g, beta), which writes beta k v^T = k x^T and erases beta k k^T
The patches map onto those calls without changing what the kernels compute:
    write_scale       scales the written value (x * write_scale); the erase term does not involve x, so it keeps acting
    capture           the sequence is split after each captured position; a segment's final state is the capture,
                      and the next segment starts from it (initial_state / output_final_state)
    extra_write       the sequence is also split after each position t where u_t y_t^T is non-zero; at that boundary
                      u_t y_t^T is added to the state and scale * (q_t . u_t) y_t to o_t (the extra write enters S_t
                      after the erase and decay of step t, so this is exact)
beta is recovered as (a . k) / (k . k), and a counts as a multiple of k when it matches beta k to within a few ulps of
a's dtype. State replacements and readout patches live in the model's mixers, which already run them as segments with an
initial state and edit the readout after the kernel; they reach this path as plain calls.

Packed sequences (cu_seqlens, B = 1) go to fla's kernels as fla's own cu_seqlens, in one call when nothing splits the
sequence; a split (capture or extra write) at packed step t cuts the segment there, and each segment's call gets the
sequence boundaries inside it, each piece starting from its sequence's carried state (so a split never crosses a
sequence). Grouped value heads (q, k with H_k heads, x, g and the states with H = n H_k) reach
`chunk_gated_delta_rule` as they are (fla 0.6 takes H_v > H_k there); `chunk_gla` and `chunk_simple_gla` take one
head count for q, k, v and g, so q and k are repeated over the value heads for them.

What falls back to the Triton kernel (kernels.triton_recurrent), and why:
    an erase that is not a multiple of k (GDN-2, QED, KDA, any per-channel decay with an erase): no fla chunk kernel
        computes (I - k a^T) for a general a;
    beta = (a . k) / (k . k) equal to zero where a write happens (x / beta is undefined);
    extra writes at more than MAX_SPLITS positions (a write-key patch at every position, as the mixers express a
        patched write key today): each one costs a split;
    float64 inputs (fla's kernels run in float32 and lower precisions), K or V above 256, or fla not importable;
    a hard reset (-inf in g), where fla's in-chunk differences of cumulative decays would read inf - inf.
`fallback_reason` names the case; the choice costs one host sync per call (the beta and extra-write checks).
"""
from __future__ import annotations

import bisect
from typing import Optional

import torch

MAX_SPLITS = 32
MAX_DIM = 256


def _fla_ops():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla warns at import when Triton has no GPU driver (the CPU interpreter)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    return chunk_gla, chunk_simple_gla, chunk_gated_delta_rule


def fla_available() -> bool:
    try:
        _fla_ops()
    except Exception:  # noqa: BLE001 - any import failure (missing package, incompatible triton) means "not available"
        return False
    return True


def _grouped(k: torch.Tensor, H: int) -> torch.Tensor:
    """k (B, T, H_k, K) seen over H = n H_k value heads as (B, T, H_k, 1, K), broadcasting against (B, T, H_k, n, K)
    (no copy)."""
    return k[:, :, :, None]


def _erase_beta(k: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """beta with a = beta k where a is a multiple of k: the projection (a . k) / (k . k), in float32. a has the value
    heads, k may have fewer (grouped value heads): each value head is projected on its key head."""
    H, Hk = a.shape[2], k.shape[2]
    kf = _grouped(k.float(), H)
    af = a.float().unflatten(2, (Hk, H // Hk))
    beta = (af * kf).sum(-1) / (kf * kf).sum(-1).clamp_min(torch.finfo(torch.float32).tiny)
    return beta.flatten(2, 3)


def _extra_write_positions(extra_write, T: int) -> list[int]:
    u, y = extra_write
    live = (u != 0).any(-1) & (y != 0).any(-1)           # (B, T, H)
    return torch.nonzero(live.any(0).any(-1))[:, 0].tolist()


def _plan(q, k, x, g, a, extra_write):
    """(form, beta, extra-write positions, reason): form None with a reason when the call must fall back."""
    K, V = q.shape[-1], x.shape[-1]
    if q.dtype == torch.float64:
        return None, None, [], "float64 inputs (fla's chunk kernels have no float64 path)"
    if K > MAX_DIM or V > MAX_DIM:
        return None, None, [], f"K = {K}, V = {V}: fla's chunk kernels take head dimensions up to {MAX_DIM}"
    if not fla_available():
        return None, None, [], "fla is not importable"
    if bool(torch.isneginf(g).any()):
        return None, None, [], "a hard reset (-inf in g): fla's chunk kernels take differences of cumulative decays"
    beta = None
    if a is None:
        form = "gla" if g.dim() == 4 else "simple_gla"
    elif g.dim() == 4:
        return None, None, [], "an erase with a per-channel decay (KDA, GDN-2, QED): no fla chunk kernel for it"
    else:
        beta = _erase_beta(k, a)
        H, Hk = a.shape[2], k.shape[2]
        along_k = (beta.unflatten(2, (Hk, H // Hk))[..., None] * _grouped(k.float(), H)).flatten(2, 3)
        # a multiple of k to within a's own rounding (a few ulps of each row's largest entry, in a's dtype)
        tol = 4 * torch.finfo(a.dtype).eps * a.float().abs().amax(-1, keepdim=True)
        if not bool(((a.float() - along_k).abs() <= tol).all()):
            return None, None, [], "an erase that is not a multiple of k (GDN-2/QED arms): no fla chunk kernel for it"
        if bool(((beta == 0) & (x != 0).any(-1)).any()):
            return None, None, [], "beta = 0 at a step that writes: x / beta is undefined"
        form = "gated_delta"
    splits = [] if extra_write is None else _extra_write_positions(extra_write, q.shape[1])
    if len(splits) > MAX_SPLITS:
        return None, None, [], f"extra writes at {len(splits)} positions (more than MAX_SPLITS = {MAX_SPLITS})"
    return form, beta, splits, None


def fallback_reason(q, k, x, g, a=None, *, extra_write=None) -> Optional[str]:
    """Why a call would fall back to the Triton kernel, or None when it runs on fla's chunk kernels."""
    return _plan(q, k, x, g, a, extra_write)[3]


def recurrence_fla(
    q, k, x, g, a=None, *, scale: float, initial_state=None, write_scale=None, extra_write=None,
    capture: Optional[list[int]] = None, output_final_state: bool = True, cu_seqlens: Optional[list[int]] = None,
):
    """Same contract as `recurrence_triton`: (o in q's dtype, final_state and states in float32). Inputs are assumed
    validated; q and k may hold the key heads (grouped value heads), a and the extra write's u the value heads.
    cu_seqlens: the packed sequences' offsets (a list of ints, B = 1); the final state is then one per sequence
    (n, H, K, V) and an empty sequence keeps its initial state. Falls back to the Triton kernel where the module
    docstring says."""
    form, beta, extra_at, reason = _plan(q, k, x, g, a, extra_write)
    if reason is not None:
        from recurscope.kernels.triton_recurrent import recurrence_triton

        return recurrence_triton(q, k, x, g, a, output_final_state=output_final_state, scale=scale,
                                 initial_state=initial_state, write_scale=write_scale, extra_write=extra_write,
                                 capture=capture, cu_seqlens=cu_seqlens)
    chunk_gla, chunk_simple_gla, chunk_gated_delta_rule = _fla_ops()
    B, T, H = x.shape[:3]
    K, V = q.shape[-1], x.shape[-1]
    if form != "gated_delta" and q.shape[2] != H:      # only fla's gated delta rule takes grouped value heads
        q, k = (t.repeat_interleave(H // t.shape[2], dim=2) for t in (q, k))
    v = x.float() if write_scale is None else x.float() * write_scale[..., None].float()
    if form == "gated_delta":
        v = torch.where(beta[..., None] == 0, torch.zeros_like(v), v / beta[..., None])
    k, v = k.to(q.dtype), v.to(q.dtype)                  # fla's kernels take q, k, v in one dtype
    bounds = [0, T] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    n_seq = B if cu_seqlens is None else len(bounds) - 1

    def segment(lo, hi, S, cu):
        sl = slice(lo, hi)
        args = (q[:, sl], k[:, sl], v[:, sl], g[:, sl])
        kw = dict(scale=scale, initial_state=S, output_final_state=True)
        if cu is not None:
            kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.long, device=q.device)
        if form == "gla":
            return chunk_gla(*args, **kw)
        if form == "simple_gla":
            return chunk_simple_gla(*args, **kw)
        return chunk_gated_delta_rule(*args, beta[:, sl].to(q.dtype), **kw)

    # the carried state of every sequence (of every row without cu_seqlens), float32
    if initial_state is None:
        carried = torch.zeros(n_seq, H, K, V, dtype=torch.float32, device=q.device)
    else:
        carried = initial_state.float().expand(n_seq, H, K, V).clone()
    seq_of = lambda t: bisect.bisect_right(bounds, t) - 1    # noqa: E731 - the (last) sequence that holds step t
    captured = set(capture or [])
    extra = set(extra_at)
    ends = sorted(captured | extra)
    if T and (not ends or ends[-1] != T - 1):
        ends.append(T - 1)
    outs, states, start = [], [], 0
    for end in ends:
        fresh = start == 0 and initial_state is None          # every state still zero: fla starts from none
        if cu_seqlens is None:
            o_seg, S = segment(start, end + 1, None if fresh else carried, None)
            carried = S.float()
        else:
            # the sequences this segment meets, each piece from its sequence's carried state
            cuts = sorted({start, end + 1} | {b for b in bounds if start < b <= end})
            ids = [seq_of(lo) for lo in cuts[:-1]]
            o_seg, S = segment(start, end + 1, None if fresh else carried[ids], [c - start for c in cuts])
            carried[ids] = S.float()
        if end in extra:
            u_t, y_t = extra_write[0][:, end].float(), extra_write[1][:, end].float()   # (B, H, K), (B, H, V)
            rows = slice(None) if cu_seqlens is None else [seq_of(end)]
            carried[rows] = carried[rows] + u_t[..., :, None] * y_t[..., None, :]
            q_t = q[:, end].float()
            if q_t.shape[1] != H:
                q_t = q_t.repeat_interleave(H // q_t.shape[1], dim=1)
            fix = scale * (q_t * u_t).sum(-1)[..., None] * y_t
            o_seg = torch.cat([o_seg[:, :-1], (o_seg[:, -1].float() + fix).to(o_seg.dtype)[:, None]], 1)
        if end in captured:
            states.append(carried.clone() if cu_seqlens is None else carried[[seq_of(end)]].clone())
        outs.append(o_seg)
        start = end + 1
    o = torch.cat(outs, 1).to(q.dtype) if outs else x.new_zeros(B, 0, H, V).to(q.dtype)
    return o, carried if output_final_state else None, torch.stack(states, 1) if states else None
