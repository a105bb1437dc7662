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

FAMILIES = ("gla", "gdn", "deltanet", "kda", "gdn2", "qed")


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
    normal = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    uniform = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    # Draw order is fixed whatever the family (q, k, v, both decays, beta, then the GDN-2 gates and lam), so a
    # seed gives every family the same q, k, v and decays.
    q, k, v = normal(B, T, H, K), normal(B, T, H, K), normal(B, T, H, V)
    g_head = -(lo + (hi - lo) * uniform(B, T, H))
    g_chan = -(lo + (hi - lo) * uniform(B, T, H, K))
    parts: dict = {}
    if family == "gla":
        k = k * K ** -0.5
        g, a, x = g_chan, None, v
    else:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        beta = uniform(B, T, H)
        if family in ("gdn", "deltanet", "kda"):
            g = {"gdn": g_head, "deltanet": torch.zeros_like(g_head), "kda": g_chan}[family]
            x, a = beta[..., None] * v, beta[..., None] * k
            parts["beta"] = beta
        else:
            b, w = uniform(B, T, H, K), uniform(B, T, H, V)
            g, x = g_chan, w * v
            parts.update(b=b, w=w)
            if family == "gdn2":
                a = b * k
            else:
                lam = 0.25 * torch.sigmoid(normal(H))
                z = F.normalize(normal(H, K), dim=-1) if arm == "rand" else None
                a = erase_vector(k, q, b, lam, arm, z)
                parts.update(lam=lam, z=z)
    out = FamilyInputs(family, q, k, x, g, a, v, **parts)
    for f in fields(out):
        t = getattr(out, f.name)
        if isinstance(t, torch.Tensor):
            setattr(out, f.name, t.to(dtype=dtype, device=device))
    return out
