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


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), the form fla's kernels use inside the delta rules."""
    xf = _accumulate(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


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

    def forward(self, x: torch.Tensor, tail: Optional[torch.Tensor] = None):
        B, T, D = x.shape
        W = self.kernel_size
        if tail is None:
            tail = x.new_zeros(B, W - 1, D)
        padded = torch.cat([tail.to(x.dtype), x], dim=1)
        y = F.conv1d(padded.transpose(1, 2), self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype), groups=D)
        return F.silu(y.transpose(1, 2)), padded[:, padded.shape[1] - (W - 1):]


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotary(x: torch.Tensor, offset: int, base: float) -> torch.Tensor:
    """NeoX-style (half-split, not interleaved) rotary embedding over the last dim; x is (B, T, H, D).

    The angle tables are float32, as in fla, so that fla-trained checkpoints see the same rotations.
    """
    T, D = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    pos = torch.arange(offset, offset + T, device=x.device, dtype=torch.float32)
    ang = torch.outer(pos, inv_freq)                      # (T, D/2)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    acc = torch.promote_types(x.dtype, torch.float32)
    x1, x2 = x.to(acc).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.to(acc) * cos + rotated * sin).to(x.dtype)
