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
    H: int
    K: int
    V: int
    channel_decay: bool  # g is (B, T, H, K) rather than (B, T, H)


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got dtype {t.dtype}")


def _check_finite(name: str, t: torch.Tensor) -> None:
    # One reduction and no boolean mask on the common path: a finite sum means finite entries. A non-finite sum
    # (a NaN/inf entry, or finite entries whose sum overflows) falls through to the exact element-wise count.
    if bool(torch.isfinite(t.sum())):
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN or inf); clean the input before running the recurrence")


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
) -> tuple[Dims, Optional[list[int]]]:
    """Checks shapes, dtypes and finiteness; returns the dimensions and the normalised capture list."""
    for name, t in (("q", q), ("k", k), ("x", x), ("g", g)):
        _check_float(name, t)
    if q.dim() != 4:
        raise ValueError(f"q must have shape (B, T, H, K), got {_shape(q)}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError(f"q has T = {T}; the sequence must hold at least one step")
    _expect("k", k, (B, T, H, K), "(B, T, H, K) like q")
    if x.dim() != 4 or tuple(x.shape[:3]) != (B, T, H):
        raise ValueError(f"x must have shape (B, T, H, V) = ({B}, {T}, {H}, V), got {_shape(x)}")
    V = x.shape[3]
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
        _expect("a", a, (B, T, H, K), "(B, T, H, K)")
        tensors["a"] = a
    if initial_state is not None:
        _check_float("initial_state", initial_state)
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
        _expect("extra_write[0] (u)", u, (B, T, H, K), "(B, T, H, K)")
        _expect("extra_write[1] (y)", y, (B, T, H, V), "(B, T, H, V)")
        tensors["extra_write[0] (u)"] = u
        tensors["extra_write[1] (y)"] = y
    dev = q.device
    for name, t in tensors.items():
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but q is on {dev}; put every input on one device")
    if check_finite:
        for name, t in tensors.items():
            _check_finite(name, t)
    positions = None
    if capture is not None:
        positions = [int(p) for p in (capture.tolist() if isinstance(capture, torch.Tensor) else capture)]
        if any(p < 0 or p >= T for p in positions):
            raise ValueError(f"capture positions must lie in [0, {T - 1}], got {positions}")
        if positions != sorted(set(positions)):
            raise ValueError(f"capture must be a sorted list of distinct positions, got {positions}")
    return Dims(B, T, H, K, V, channel), positions


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32
