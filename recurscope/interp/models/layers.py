"""Small building blocks with fla 0.6.0's math and parameter names: RMSNorm, gated RMSNorm, causal short
convolution, SwiGLU MLP and rotary embeddings."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def _accumulate(x: torch.Tensor) -> torch.Tensor:
    """x in at least float32 (float64 stays float64, so that a float64 model is float64 throughout)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = _accumulate(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x):
        y = rms_normalise(x, self.eps)
        return y if self.weight is None else y * self.weight


_GATE_ACTS = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(RMSNorm):
    """rmsnorm(o) * weight * act(gate), per head over the value dimension."""

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "swish", elementwise_affine: bool = True):
        super().__init__(dim, eps, elementwise_affine)
        self.act = _GATE_ACTS[activation]

    def forward(self, x, gate):
        return super().forward(x) * self.act(gate)


class ShortConvolution(nn.Module):
    """Causal depthwise conv1d of width W followed by SiLU; the parameter is `weight` of shape (D, 1, W) as in fla.

    The tail (the last W - 1 inputs) is what a cache carries between calls.
    """

    def __init__(self, dim: int, kernel_size: int = 4, bias: bool = False):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(dim, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, tail: Optional[torch.Tensor] = None, cu_seqlens: Optional[list] = None):
        """x (B, T, D) -> (SiLU(conv), the tail). cu_seqlens: x (1, T, D) holds packed sequences at these offsets;
        each is convolved from zeros (no tap reaches into the sequence before it) and the tail is one per sequence,
        (n, W - 1, D)."""
        B, T, D = x.shape
        W = self.kernel_size
        if cu_seqlens is not None:
            return packed_conv(x, self.weight[:, 0], self.bias, cu_seqlens, W - 1)
        if tail is None:
            tail = x.new_zeros(B, W - 1, D)
        padded = torch.cat([tail.to(x.dtype), x], dim=1)
        y = F.conv1d(padded.transpose(1, 2), self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype), groups=D)
        return F.silu(y.transpose(1, 2)), padded[:, padded.shape[1] - (W - 1):]


def sequence_starts(cu_seqlens: list, T: int, device) -> torch.Tensor:
    """(T,) the offset of the packed sequence each position belongs to."""
    bounds = torch.as_tensor(cu_seqlens, dtype=torch.long, device=device)
    t = torch.arange(T, device=device)
    return bounds[torch.searchsorted(bounds, t, right=True) - 1]


def packed_tails(x: torch.Tensor, cu_seqlens: list, n: int) -> torch.Tensor:
    """x (1, T, D) packed -> (len(cu_seqlens) - 1, n, D): each sequence's last n inputs, zeros before its start."""
    tails = x.new_zeros(len(cu_seqlens) - 1, n, x.shape[-1])
    for i, (lo, hi) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        take = min(n, hi - lo)
        if take:
            tails[i, n - take:] = x[0, hi - take:hi]
    return tails


def packed_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], cu_seqlens: list,
                tail_len: int, activation: bool = True):
    """The causal depthwise conv (weight (D, W)) over packed sequences, x (1, T, D): the tap w of position t reads
    x[t - (W - 1) + w] only inside t's own sequence (zero before its start), as a run of that sequence alone would;
    SiLU after it when `activation`. Returns (y (1, T, D), each sequence's last `tail_len` inputs (n, tail_len, D))."""
    _, T, D = x.shape
    W = weight.shape[-1]
    # each sequence preceded by W - 1 zeros in one channels-first buffer (the fast layout of a depthwise conv), then
    # one conv over it: a window never reaches the sequence before; each sequence's outputs are copied back
    spans = [(lo, hi) for lo, hi in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    buf = x.new_zeros(1, D, T + len(spans) * (W - 1))
    xt = x[0].transpose(0, 1)
    starts, pos = [], 0
    for lo, hi in spans:
        pos += W - 1
        buf[0, :, pos:pos + hi - lo] = xt[:, lo:hi]
        starts.append(pos)
        pos += hi - lo
    conv = F.conv1d(buf, weight.to(x.dtype)[:, None], None if bias is None else bias.to(x.dtype), groups=D)
    y = x.new_empty(1, D, T)
    for (lo, hi), at in zip(spans, starts):
        y[0, :, lo:hi] = conv[0, :, at - (W - 1):at - (W - 1) + hi - lo]
    y = y.transpose(1, 2)
    return (F.silu(y) if activation else y), packed_tails(x, cu_seqlens, tail_len)


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary(x: torch.Tensor, offset, base: float) -> torch.Tensor:
    """NeoX-style (half-split, not interleaved) rotary embedding over the last dim; x is (B, T, H, D).

    offset: the position of the first token (an int), or a tensor of positions: (B,) each row's first (rows
    continuing caches of different lengths) or (B, T) every token's (packed sequences restarting at 0).
    The angle tables are float32, as in fla, so that fla-trained checkpoints see the same rotations.
    """
    T, D = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    if isinstance(offset, torch.Tensor):
        pos = offset.to(x.device, torch.float32)
        pos = pos[:, None] + torch.arange(T, device=x.device, dtype=torch.float32) if pos.dim() == 1 else pos
        ang = pos[..., None] * inv_freq                   # (B, T, D/2)
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]
    else:
        pos = torch.arange(offset, offset + T, device=x.device, dtype=torch.float32)
        ang = torch.outer(pos, inv_freq)                  # (T, D/2)
        cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(acc).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.to(acc) * cos + rotated * sin).to(x.dtype)
