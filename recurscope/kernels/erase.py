"""QED erase vectors for every ablation arm, and the erase eigenvalue e_t = 1 - a_t^T k_t.

a = b*k + lam * d, where d depends on the arm: eq. 6 and Table 1 of "The Query Knows What to Forget: A Second
Erase Direction for Linear Attention" (Gupta, Das, Gupta; arXiv:2608.13668). See docs/kernels.md.
"""
from __future__ import annotations

from typing import Optional

import torch

#: Every arm, in the order the QED suite reports them: the GDN-2 baseline, the paper's four QED arms, then
#: "noproj" (the gate without the projection), the arm the paper never ran.
ERASE_ARMS = ("gdn2", "full", "nogate", "nogate_noproj", "rand", "noproj")


def project_out(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """P_perp_k(v) = v - k (k^T v), for unit-norm k along the last dimension."""
    return v - k * (k * v).sum(-1, keepdim=True)


def erase_vector(k, q, b, lam, arm: str = "full", z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Builds a (..., H, K) from unit-norm k, q, gate b (..., H, K) and lam (H,).

    Gating comes first and projection second, as in the paper: P_perp_k(b * q), not b * P_perp_k(q).
    z: (H, K) fixed random unit directions for the "rand" arm.
    """
    if arm not in ERASE_ARMS:
        raise ValueError(f"arm must be one of {ERASE_ARMS}, got {arm!r}")
    if k.shape != q.shape or k.shape != b.shape:
        raise ValueError(f"k, q and b must share a shape (..., H, K); got k {tuple(k.shape)}, q {tuple(q.shape)}, b {tuple(b.shape)}")
    H = k.shape[-2]
    base = b * k
    if arm == "gdn2":
        return base
    lam = torch.as_tensor(lam, dtype=k.dtype, device=k.device)
    if lam.shape != (H,):
        raise ValueError(f"lam must have shape (H,) = ({H},), got {tuple(lam.shape)}")
    lam = lam[:, None]
    if arm == "full":
        d = project_out(k, b * q)
    elif arm == "nogate":
        d = project_out(k, q)
    elif arm == "nogate_noproj":
        d = q
    elif arm == "noproj":
        d = b * q
    else:  # rand
        if z is None or tuple(z.shape) != (H, k.shape[-1]):
            raise ValueError(f"arm 'rand' needs z of shape (H, K) = ({H}, {k.shape[-1]}), got {None if z is None else tuple(z.shape)}")
        d = project_out(k, b * z.to(k.dtype))
    return base + lam * d


def erase_eigenvalue(k: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """e_t = 1 - a_t^T k_t: the one non-trivial eigenvalue of the erase factor I - k a^T."""
    return 1.0 - (a * k).sum(-1)
