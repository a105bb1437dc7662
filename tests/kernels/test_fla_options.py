"""fla's in-kernel options on kernels.recurrence (issue 30, item 4): each equals the same operation done outside
the call, on every backend; the chunk length is a public option."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recurscope import kernels

B, T, Hk, H, K, V = 1, 50, 1, 2, 8, 4


def raw(seed=0, channel=False):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g_raw = rnd(B, T, H, K) if channel else rnd(B, T, H)
    return dict(q=rnd(B, T, Hk, K), k=rnd(B, T, Hk, K), v=rnd(B, T, H, V), g_raw=g_raw, b_raw=rnd(B, T, H),
                A_log=rnd(H), dt_bias=rnd(H, K) if channel else rnd(H))


def l2(t):
    return t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("channel", [False, True], ids=["per head (GDN)", "per channel (KDA)"])
@pytest.mark.parametrize("backend", ["chunked", "reference", "triton"])
def test_every_option_equals_the_operation_done_outside(backend, channel):
    r = raw(1, channel)
    dtype = torch.float32 if backend == "triton" else torch.float64
    c = lambda t: t.to(dtype)  # noqa: E731
    # outside: what Gated DeltaNet / KDA layers compute before calling a kernel, q and k repeated over value heads
    q, k = (l2(t).repeat_interleave(H // Hk, 2) for t in (r["q"], r["k"]))
    dt = r["dt_bias"] if not channel else r["dt_bias"][None, None]
    g = -r["A_log"].exp()[(None, None, slice(None)) + ((None,) if channel else ())] * F.softplus(r["g_raw"] + dt)
    beta = r["b_raw"].sigmoid()[..., None]
    want = kernels.recurrence(*map(c, (q, k, beta * r["v"], g, beta * k)), backend="reference")
    got = kernels.recurrence(c(r["q"]), c(r["k"]), c(r["v"]), c(r["g_raw"]), use_qk_l2norm=True, beta=c(r["b_raw"]),
                             use_beta_sigmoid=True, A_log=c(r["A_log"]), dt_bias=c(r["dt_bias"]), backend=backend)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.o, want.o, atol=tol, rtol=tol)
    torch.testing.assert_close(got.final_state, want.final_state, atol=tol, rtol=tol)


def test_beta_without_sigmoid_and_without_gate():
    r = raw(2)
    beta = torch.rand(B, T, H, dtype=torch.float64)
    k = r["k"].repeat_interleave(H // Hk, 2)
    want = kernels.recurrence(r["q"].repeat_interleave(H // Hk, 2), k, beta[..., None] * r["v"], -r["g_raw"].abs(),
                              beta[..., None] * k, backend="reference")
    got = kernels.recurrence(r["q"], r["k"], r["v"], -r["g_raw"].abs(), beta=beta, backend="chunked")
    torch.testing.assert_close(got.o, want.o, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("chunk_size", [16, 48, 128])
def test_chunk_size_on_the_public_entry(chunk_size):
    r = raw(3)
    g = -r["g_raw"].abs()
    base = kernels.recurrence(r["q"], r["k"], r["v"], g, backend="reference")
    got = kernels.recurrence(r["q"], r["k"], r["v"], g, chunk_size=chunk_size, backend="chunked")
    torch.testing.assert_close(got.o, base.o, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.recurrence(r["q"], r["k"], r["v"], g, chunk_size=20, backend="chunked")


def test_option_errors_name_the_fix():
    r = raw(4)
    args = (r["q"], r["k"], r["v"], r["g_raw"])
    with pytest.raises(ValueError, match="beta and a both given"):
        kernels.recurrence(*args, r["k"].repeat_interleave(2, 2), beta=r["b_raw"])
    with pytest.raises(ValueError, match="use_beta_sigmoid needs beta"):
        kernels.recurrence(*args, use_beta_sigmoid=True)
    with pytest.raises(ValueError, match="dt_bias without A_log"):
        kernels.recurrence(*args, dt_bias=r["dt_bias"])
    with pytest.raises(ValueError, match=r"A_log must have shape \(H,\)"):
        kernels.recurrence(*args, A_log=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="dt_bias must hold 2 values"):
        kernels.recurrence(*args, A_log=r["A_log"], dt_bias=torch.zeros(5, dtype=torch.float64))
