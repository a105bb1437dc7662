"""Input checks for the recurrence: every message names the tensor, what was expected and what came."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int               # value heads: x, g, the states and o have H heads
    K: int
    V: int
    channel_decay: bool  # g is (B, T, H, K) rather than (B, T, H)
    H_k: int = 0         # key heads of q and k (H = n H_k: grouped value heads); H when not grouped
    n_seqs: int = 0      # packed sequences (cu_seqlens); 0 without
    H_q: int = 0         # query heads of q and of o (H_q = m H: query groups, m queries read each state); H_k else


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got dtype {t.dtype}")


def _check_finite(name: str, t: torch.Tensor, allow_neg_inf: bool = False) -> None:
    # One reduction and no boolean mask on the common path: a finite sum means finite entries. A non-finite sum
    # (a NaN/inf entry, or finite entries whose sum overflows) falls through to the exact element-wise count.
    if bool(torch.isfinite(t.sum())):
        return
    wrong = ~torch.isfinite(t)
    if allow_neg_inf:
        wrong &= t != float("-inf")
    bad = int(wrong.sum())
    if bad:
        what = "NaN or +inf; -inf, a hard reset, is allowed" if allow_neg_inf else "NaN or inf"
        raise ValueError(f"{name} contains {bad} non-finite value(s) ({what}); clean the input before running the "
                         "recurrence")


def check_decay(g: torch.Tensor) -> None:
    """g is a log-decay: exp(g) <= 1 keeps every transition contracting. A positive entry makes the state grow
    step by step, which no family produces; research on such transitions opts in with allow_growth=True."""
    top = float(g.detach().max()) if g.numel() else 0.0
    if top > 0:
        n = int((g > 0).sum())
        raise ValueError(f"g holds {n} positive log-decay value(s) (max {top:.3g}): exp(g) > 1 grows the state "
                         "instead of decaying it; pass g <= 0 (e.g. logsigmoid of the gate), or allow_growth=True to "
                         "study unstable transitions on purpose")


def _expect(name: str, t: torch.Tensor, shape: Sequence[int], what: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {_shape(t)}")


def validate(
    q: torch.Tensor,
    k: torch.Tensor,
    x: torch.Tensor,
    g: torch.Tensor,
    a: Optional[torch.Tensor],
    initial_state: Optional[torch.Tensor],
    write_scale: Optional[torch.Tensor],
    extra_write,
    capture,
    check_finite: bool = True,
    cu_seqlens=None,
    allow_growth: bool = False,
) -> tuple[Dims, Optional[list[int]]]:
    """Checks shapes, dtypes and finiteness; returns the dimensions and the normalised capture list. With
    check_finite, a positive log-decay g (a transition that grows the state) is refused unless allow_growth."""
    for name, t in (("q", q), ("k", k), ("x", x), ("g", g)):
        _check_float(name, t)
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, T, H_k, K), got {_shape(q)}")
    B, T, Hq, K = q.shape
    if k.dim() != 4 or tuple(k.shape[:2]) != (B, T) or k.shape[3] != K:
        _expect("k", k, (B, T, Hq, K), "(B, T, H_k, K) like q")
    Hk = k.shape[2]
    if x.dim() != 4 or tuple(x.shape[:2]) != (B, T):
        raise ValueError(f"x must have shape (B, T, H, V) = ({B}, {T}, H, V), got {_shape(x)}")
    H, V = x.shape[2], x.shape[3]
    if Hq != Hk and (Hk != H or Hq % H):
        raise ValueError(f"q has {Hq} heads and k {Hk}: q and k must have the same heads (grouped value heads: "
                         f"x with a multiple of them), or k the value heads H = {H} of x and q a multiple of them "
                         "(query groups: each state read by H_q / H consecutive query heads)")
    if H % Hk:
        raise ValueError(f"x has H = {H} value heads, not a multiple of q and k's H_k = {Hk} heads; grouped value heads "
                         "need H = n * H_k (each key head serves n consecutive value heads)")
    n_seqs = _check_cu_seqlens(cu_seqlens, B, T)
    if T < 1 and cu_seqlens is None:
        raise ValueError(f"q has T = {T}; the sequence must hold at least one step (or pass cu_seqlens)")
    if g.dim() == 3:
        _expect("g", g, (B, T, H), "(B, T, H) for a per-head decay")
        channel = False
    elif g.dim() == 4:
        _expect("g", g, (B, T, H, K), "(B, T, H, K) for a per-channel decay")
        channel = True
    else:
        raise ValueError(f"g must have rank 3 (B, T, H) or rank 4 (B, T, H, K), got rank {g.dim()} with shape {_shape(g)}")
    tensors = {"q": q, "k": k, "x": x, "g": g}
    if a is not None:
        _check_float("a", a)
        _expect_heads("a", a, (B, T, H, K), Hk)
        tensors["a"] = a
    if initial_state is not None:
        _check_float("initial_state", initial_state)
        if n_seqs:
            _expect("initial_state", initial_state, (n_seqs, H, K, V), "(number of sequences in cu_seqlens, H, K, V)")
        else:
            _expect("initial_state", initial_state, (B, H, K, V), "(B, H, K, V)")
        tensors["initial_state"] = initial_state
    if write_scale is not None:
        _check_float("write_scale", write_scale)
        _expect("write_scale", write_scale, (B, T, H), "(B, T, H)")
        tensors["write_scale"] = write_scale
    if extra_write is not None:
        if not (isinstance(extra_write, (tuple, list)) and len(extra_write) == 2):
            raise ValueError("extra_write must be a pair (u, y) with u (B, T, H, K) and y (B, T, H, V)")
        u, y = extra_write
        _check_float("extra_write[0] (u)", u)
        _check_float("extra_write[1] (y)", y)
        _expect_heads("extra_write[0] (u)", u, (B, T, H, K), Hk)
        _expect("extra_write[1] (y)", y, (B, T, H, V), "(B, T, H, V)")
        tensors["extra_write[0] (u)"] = u
        tensors["extra_write[1] (y)"] = y
    dev = q.device
    for name, t in tensors.items():
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but q is on {dev}; put every input on one device")
    if check_finite:
        for name, t in tensors.items():
            _check_finite(name, t, allow_neg_inf=name == "g")
        if not allow_growth:
            check_decay(g)
    positions = None
    if capture is not None:
        positions = [int(p) for p in (capture.tolist() if isinstance(capture, torch.Tensor) else capture)]
        if any(p < 0 or p >= T for p in positions):
            raise ValueError(f"capture positions must lie in [0, {T - 1}], got {positions}")
        if positions != sorted(set(positions)):
            raise ValueError(f"capture must be a sorted list of distinct positions, got {positions}")
    return Dims(B, T, H, K, V, channel, Hk, n_seqs, Hq), positions


def _expect_heads(name: str, t: torch.Tensor, shape: Sequence[int], Hk: int) -> None:
    """shape (B, T, H, D), or (B, T, H_k, D) with the key heads (shared by each group of value heads)."""
    B, T, H, D = shape
    if t.dim() == 4 and tuple(t.shape) == (B, T, Hk, D):
        return
    _expect(name, t, shape, "(B, T, H, K) or (B, T, H_k, K)" if Hk != H else "(B, T, H, K)")


def _check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    """The number of packed sequences (0 without cu_seqlens)."""
    if cu_seqlens is None:
        return 0
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T, so the batch must be 1, got B = {B}; concatenate the "
                         "rows along T first")
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must run from 0 to T = {T} without decreasing (n + 1 offsets for n sequences), "
                         f"got {bounds}")
    return len(bounds) - 1


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32
