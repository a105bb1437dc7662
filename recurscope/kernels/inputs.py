"""Seeded random inputs of the recurrence in the form each family builds them, for tests, benchmarks and
experiments: one builder, so that every check of a backend sees the same families.

    GLA       per-channel g, no erase, x = v, raw keys scaled by K^-1/2
    GDN       per-head g, a = beta k, x = beta v          (unit-norm q and k from here on)
    DeltaNet  g = 0, a = beta k, x = beta v
    KDA       per-channel g, a = beta k, x = beta v
    GDN-2     per-channel g, a = b * k, x = w * v
    QED       per-channel g, a = erase_vector(k, q, b, lam, arm), x = w * v
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F

from recurscope.kernels.erase import ERASE_ARMS, erase_vector

@dataclass
class FamilyInputs:
    """The recurrence's inputs (q, k, x, g, a) and the parts they were built from (None where a family has none):
    v the value, beta the delta-rule step (B, T, H), b and w GDN-2's erase and write gates, lam QED's (H,)
    strengths and z the "rand" arm's (H, K) directions."""

    family: str
    q: torch.Tensor
    k: torch.Tensor
    x: torch.Tensor
    g: torch.Tensor
    a: Optional[torch.Tensor]
    v: torch.Tensor
    beta: Optional[torch.Tensor] = None
    b: Optional[torch.Tensor] = None
    w: Optional[torch.Tensor] = None
    lam: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None

    def args(self) -> tuple:
        """(q, k, x, g, a), the positional arguments of `kernels.recurrence`."""
        return self.q, self.k, self.x, self.g, self.a


class _Draws:
    """The seeded float64 draws of one call, and QED's erase arm."""

    def __init__(self, gen: torch.Generator, arm: str):
        self.gen, self.arm = gen, arm

    def normal(self, *shape):
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

    def uniform(self, *shape):
        return torch.rand(*shape, generator=self.gen, dtype=torch.float64)


def _gla(draw, q, k, v, g_head, g_chan):
    return q, k * k.shape[-1] ** -0.5, v, g_chan, None, {}


def _delta_rule(decay: str):
    """GDN (per-head decay), DeltaNet (no decay), KDA (per-channel decay): a = beta k, x = beta v."""
    def build(draw, q, k, v, g_head, g_chan):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = draw.uniform(*g_head.shape)
        g = {"head": g_head, "none": torch.zeros_like(g_head), "channel": g_chan}[decay]
        return q, k, beta[..., None] * v, g, beta[..., None] * k, {"beta": beta}
    return build


def _gdn2_gates(draw, q, k, v):
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    draw.uniform(*q.shape[:3])   # beta's draw, unused here: every non-GLA family draws it, so a seed's b and w agree
    return q, k, draw.uniform(*k.shape), draw.uniform(*v.shape)


def _gdn2(draw, q, k, v, g_head, g_chan):
    q, k, b, w = _gdn2_gates(draw, q, k, v)
    return q, k, w * v, g_chan, b * k, {"b": b, "w": w}


def _qed(draw, q, k, v, g_head, g_chan):
    q, k, b, w = _gdn2_gates(draw, q, k, v)
    lam = 0.25 * torch.sigmoid(draw.normal(q.shape[2]))
    z = F.normalize(draw.normal(q.shape[2], q.shape[3]), dim=-1) if draw.arm == "rand" else None
    return q, k, w * v, g_chan, erase_vector(k, q, b, lam, draw.arm, z), {"b": b, "w": w, "lam": lam, "z": z}


#: One builder per family of inputs, returning (q, k, x, g, a, the parts they came from).
_BUILDERS = {"gla": _gla, "gdn": _delta_rule("head"), "deltanet": _delta_rule("none"), "kda": _delta_rule("channel"),
             "gdn2": _gdn2, "qed": _qed}
FAMILIES = tuple(_BUILDERS)


def family_inputs(family: str, B: int, T: int, H: int, K: int, V: int, *, dtype: torch.dtype = torch.float64,
                  device=None, seed: int = 0, decay: tuple[float, float] = (0.0, 1.0),
                  arm: str = "full") -> FamilyInputs:
    """Random inputs of `family` (one of FAMILIES), drawn in float64 on the CPU from `seed` and then cast to
    `dtype` and moved to `device`, so that every dtype and device sees the same numbers.

    decay = (lo, hi): log decays are uniform in [-hi, -lo]. Gates (beta, b, w) are uniform in (0, 1);
    lam = 0.25 sigmoid(N(0, 1)) per head; arm is QED's erase arm (kernels.ERASE_ARMS).
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if arm not in ERASE_ARMS:
        raise ValueError(f"arm must be one of {ERASE_ARMS}, got {arm!r}")
    lo, hi = decay
    if not 0.0 <= lo <= hi:
        raise ValueError(f"decay must be (lo, hi) with 0 <= lo <= hi (log decays in [-hi, -lo]), got {decay!r}")
    gen = torch.Generator().manual_seed(seed)
    draw = _Draws(gen, arm)
    # Draw order is fixed whatever the family (q, k, v, both decays, then each family's own gates in the order
    # beta, b, w, lam), so a seed gives every family the same q, k, v and decays.
    q, k, v = draw.normal(B, T, H, K), draw.normal(B, T, H, K), draw.normal(B, T, H, V)
    g_head = -(lo + (hi - lo) * draw.uniform(B, T, H))
    g_chan = -(lo + (hi - lo) * draw.uniform(B, T, H, K))
    q, k, x, g, a, parts = _BUILDERS[family](draw, q, k, v, g_head, g_chan)
    out = FamilyInputs(family, q, k, x, g, a, v, **parts)
    for f in fields(out):
        t = getattr(out, f.name)
        if isinstance(t, torch.Tensor):
            setattr(out, f.name, t.to(dtype=dtype, device=device))
    return out
