"""The fla chunk-kernel path (kernels.fla_chunk) against the float64 reference, with every patch feature, on tiny
shapes. On a CPU fla's Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest), with the
test-only adjustments of conftest's `fla_interpreter` fixture, undone after this module.
Each fla call takes seconds in the interpreter, so the shapes are tiny and the cases few."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from recurscope import kernels

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("fla_interpreter")]

fla_chunk = pytest.importorskip("recurscope.kernels.fla_chunk")
if not fla_chunk.fla_available():
    pytest.skip("fla is not importable", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def make(family, B=1, T=21, H=2, K=8, V=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(B, T, H, K), F.normalize(r(B, T, H, K), dim=-1), r(B, T, H, V)
    if family == "gla":
        g, a, x = F.logsigmoid(r(B, T, H, K) + 2), None, v
    elif family == "simple_gla":
        g, a, x = F.logsigmoid(r(B, T, H) + 2), None, v
    else:  # gdn: a = beta k, x = beta v
        beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.9 + 0.05
        g, a, x = F.logsigmoid(r(B, T, H) + 2), beta[..., None] * k, beta[..., None] * v
    ws = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 1.5
    ws[:, ::5] = 0.0
    u = torch.zeros(B, T, H, K, dtype=torch.float64)
    y = torch.zeros(B, T, H, V, dtype=torch.float64)
    for t in (3, 11):                                    # extra writes at two positions: two splits
        u[:, t], y[:, t] = r(B, H, K) * 0.3, r(B, H, V)
    S0 = r(B, H, K, V) * 0.5
    return (q, k, x, g, a), dict(write_scale=ws, extra_write=(u, y), initial_state=S0, capture=[0, 7, 11, T - 1])


def to32(t):
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(to32(s) for s in t)
    return t.to(DEVICE, torch.float32) if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("family", ["gla", "simple_gla", "gdn"])
def test_fla_path_matches_the_reference_with_every_patch(family):
    inputs, kw = make(family)
    assert fla_chunk.fallback_reason(*map(to32, inputs), extra_write=to32(kw["extra_write"])) is None
    ref = kernels.recurrence(*inputs, backend="reference", **kw)
    got = kernels.recurrence(*map(to32, inputs), backend="fla", **{n: to32(v) for n, v in kw.items()})
    for name, r, c in zip(("o", "final_state", "states"), ref, got):
        torch.testing.assert_close(c.double().cpu(), r, atol=2e-4, rtol=2e-4, msg=lambda m: f"{name}: {m}")


def test_plain_call_matches_and_falls_back_where_fla_has_no_kernel():
    inputs, _ = make("gdn", seed=3)
    q, k, x, g, a = map(to32, inputs)
    ref = kernels.recurrence(*inputs, backend="reference")
    got = kernels.recurrence(q, k, x, g, a, backend="fla")
    torch.testing.assert_close(got.o.double().cpu(), ref.o, atol=2e-4, rtol=2e-4)
    # An erase that is not a multiple of k (a QED-like arm) falls back, to the Triton kernel, and still matches.
    a_off = a + 0.1 * torch.roll(k, 1, dims=-1)
    assert "not a multiple of k" in fla_chunk.fallback_reason(q, k, x, g, a_off)
    g_chan = g[..., None].expand(*g.shape, k.shape[-1]).contiguous()
    assert "per-channel decay" in fla_chunk.fallback_reason(q, k, x, g_chan, a)
    assert "float64" in fla_chunk.fallback_reason(*inputs)
    reset = g.clone()
    reset[:, 5] = float("-inf")
    assert "hard reset" in fla_chunk.fallback_reason(q, k, x, reset, a)
    fell = kernels.recurrence(q, k, x, g, a_off, backend="fla")
    want = kernels.recurrence(*(t.double().cpu() for t in (q, k, x, g, a_off)), backend="reference")
    torch.testing.assert_close(fell.o.double().cpu(), want.o, atol=2e-4, rtol=2e-4)
