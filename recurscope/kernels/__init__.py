"""One recurrence for the linear-attention family, with three backends and patch features.

    S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + write_scale_t k_t x_t^T + u_t y_t^T
    o_t = scale * S_t^T q_t

States are (B, H, K, V), key dimension first. Each model family is a choice of (g, a, x); see docs/kernels.md.
No __version__ here on purpose: Hugging Face publishes another import package named `kernels`.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from recurscope.kernels._validate import compute_dtype, validate
from recurscope.kernels.chunked import recurrence_chunked
from recurscope.kernels.erase import ERASE_ARMS, erase_eigenvalue, erase_vector, project_out
from recurscope.kernels.low_rank import recurrence_low_rank  # the decay-plus-low-rank form (RWKV-7), its own entry
from recurscope.kernels.reference import recurrence_reference
from recurscope.kernels.scratch import release_scratch, scratch_limit, set_scratch_limit

BACKENDS = ("auto", "reference", "chunked", "triton", "fla")

__all__ = [
    "BACKENDS", "ERASE_ARMS", "RecurrenceOutput", "erase_eigenvalue", "erase_vector", "project_out",
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
    """
    dims, positions = validate(q, k, x, g, a, initial_state, write_scale, extra_write, capture,
                               check_finite=check_finite)
    chosen = resolve_backend(backend, q.device)
    scale = dims.K ** -0.5 if scale is None else float(scale)
    dtype = compute_dtype(q)
    kwargs = dict(scale=scale, initial_state=initial_state, write_scale=write_scale,
                  extra_write=extra_write, capture=positions)
    if chosen == "reference":
        o, S, states = recurrence_reference(q, k, x, g, a, dtype=dtype, **kwargs)
    elif chosen == "chunked":
        o, S, states = recurrence_chunked(q, k, x, g, a, dtype=dtype, final_state=output_final_state, **kwargs)
    elif chosen == "fla":
        from recurscope.kernels.fla_chunk import recurrence_fla

        o, S, states = recurrence_fla(q, k, x, g, a, output_final_state=output_final_state, **kwargs)
    else:
        from recurscope.kernels.triton_recurrent import recurrence_triton

        o, S, states = recurrence_triton(q, k, x, g, a, output_final_state=output_final_state, **kwargs)
    return RecurrenceOutput(o, S if output_final_state else None, states)
