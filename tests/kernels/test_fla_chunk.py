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


def _packed_case(family, gva, seed=5):
    """Four packed sequences (lengths 5, 0, 9, 7; one empty) with grouped value heads (H_k = 1, H = 2) or not, their
    own initial states, and every patch: write scales, extra writes and captures placed so that segments cross
    sequence boundaries (the empty sequence included)."""
    bounds = [0, 5, 5, 14, 21]
    inputs, kw = make(family, B=1, T=21, H=2, seed=seed)
    q, k, x, g, a = inputs
    if gva:                                   # one key head serving both value heads: a = beta k of that key head
        q, k = q[:, :, :1], k[:, :, :1]
        if a is not None:
            beta = (a * k).sum(-1) / (k * k).sum(-1)
            a = beta[..., None] * k
    u, y = kw["extra_write"]
    u, y = torch.zeros_like(u), torch.zeros_like(y)
    gen = torch.Generator().manual_seed(seed + 1)
    for t in (3, 10):                          # inside sequences 0 and 2
        u[:, t] = torch.randn(1, 2, u.shape[-1], generator=gen, dtype=torch.float64) * 0.3
        y[:, t] = torch.randn(1, 2, y.shape[-1], generator=gen, dtype=torch.float64)
    kw.update(extra_write=(u, y), capture=[2, 16],
              initial_state=torch.randn(4, 2, 8, 4, generator=gen, dtype=torch.float64) * 0.5)
    return (q, k, x, g, a), kw, bounds


@pytest.mark.parametrize("family,gva", [("gla", False), ("simple_gla", True), ("gdn", True), ("gdn", False)])
def test_fla_path_takes_packed_sequences_and_grouped_value_heads(family, gva, monkeypatch):
    """cu_seqlens (with an empty sequence) and grouped value heads on fla's chunk kernels, every patch on: equal to the
    reference backend's loop over sequences. The packed call reaches fla once per segment (not once per sequence),
    with fla's own cu_seqlens; the gated delta rule gets q and k with the key heads."""
    inputs, kw, bounds = _packed_case(family, gva)
    ref = kernels.recurrence(*inputs, backend="reference", cu_seqlens=bounds, **kw)
    calls = []
    real = fla_chunk._fla_ops

    def spy_ops():
        def spy(fn):
            def call(q, k, *args, **kw):
                calls.append((q.shape[2], kw.get("cu_seqlens")))
                return fn(q, k, *args, **kw)
            return call
        return tuple(spy(fn) for fn in real())

    monkeypatch.setattr(fla_chunk, "_fla_ops", spy_ops)
    got = kernels.recurrence(*map(to32, inputs), backend="fla", cu_seqlens=bounds,
                             **{n: to32(v) for n, v in kw.items()})
    for name, r, c in zip(("o", "final_state", "states"), ref, got):
        torch.testing.assert_close(c.double().cpu(), r, atol=2e-4, rtol=2e-4, msg=lambda m: f"{name}: {m}")
    # splits after steps 2, 3, 10, 16 and the end: 5 calls, each with the boundaries inside it (steps 4..10 run the
    # end of sequence 0 and the start of sequence 2 across the empty one; 11..16 cross from sequence 2 into 3)
    assert [cu.tolist() for _, cu in calls] == [[0, 3], [0, 1], [0, 1, 7], [0, 3, 6], [0, 4]]
    assert {h for h, _ in calls} == {1 if (gva and family == "gdn") else 2}
