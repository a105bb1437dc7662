"""Our reference recurrence against fla 0.6.0's own pure-torch reference functions (naive.py), family by family.

Mapping of fla's parametrisations onto our (g, a, x), with S (B, H, K, V) and o = scale * S^T q:
  GLA   naive_recurrent_gla(q, k, v, gk)                   g = gk, a = None, x = v; scale fixed at K^-0.5
  GDN   naive_recurrent_gated_delta_rule(q, k, v, beta, g) g per head, a = beta k, x = beta v
        naive_chunk_gated_delta_rule(q, k, v, g, beta)     (note: g and beta swap places between the two)
  GDN-2 naive_recurrent_gdn2 / naive_chunk_gdn2(q, k, v, g, b, w)   a = b * k, x = w * v
  KDA   naive_recurrent_kda / naive_chunk_kda(q, k, v, g, beta)     g per channel, a = beta k, x = beta v
  DeltaNet delta_rule_recurrence(q, k, v, beta), head-first (B, H, T, ·) layout, no decay, scale fixed at K^-0.5
  QED   no QED op in fla 0.6.0; dplr_recurrence (head-first) computes S' = D S + k v^T + beta (alpha^T S),
        reading the state *before* the decay, so QED maps to alpha = -exp(g) * a, beta = k, v = x.
None of these normalise k themselves (their models do it before the op), so we pass unit-norm q and k.
All these naive functions keep the state as (K, V) and compute in float32; we compare to our float64 reference.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from recurscope import kernels

with warnings.catch_warnings():
    warnings.simplefilter("ignore")                      # fla warns that Triton has no GPU here
    fla_gla = pytest.importorskip("fla.ops.gla.naive")
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    fla_gdn2 = pytest.importorskip("fla.ops.gdn2.naive")
    fla_kda = pytest.importorskip("fla.ops.kda.naive")
    fla_delta = pytest.importorskip("fla.ops.delta_rule.naive")
    fla_dplr = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")

B, T, H, K, V = 2, 128, 3, 16, 8                         # T a multiple of 64: naive_chunk_kda asserts it
TOL = dict(atol=3e-5, rtol=3e-5)                         # fla computes in float32


@pytest.fixture
def data():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    return dict(
        q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, H, V),
        beta=u(B, T, H), g_head=-0.5 * u(B, T, H), g_chan=-0.5 * u(B, T, H, K),
        b=u(B, T, H, K), w=u(B, T, H, V), S0=r(B, H, K, V), lam=0.25 * torch.sigmoid(r(H)),
    )


def ours(q, k, x, g, a=None, **kw):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    kw = {n: d(t) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    return kernels.recurrence(d(q), d(k), d(x), d(g), d(a), backend="reference", **kw)


def check(fla_out, our_out):
    o_fla, S_fla = fla_out
    torch.testing.assert_close(o_fla.double(), our_out.o, **TOL)
    torch.testing.assert_close(S_fla.double(), our_out.final_state, **TOL)


def test_gla(data):
    q, k, v, g, S0 = data["q"], data["k"], data["v"], data["g_chan"], data["S0"]
    got = fla_gla.naive_recurrent_gla(q, k, v, g, initial_state=S0, output_final_state=True)
    check(got, ours(q, k, v, g, None, initial_state=S0))     # both default to scale K^-0.5


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_gated_delta_rule(data, form, scale):
    q, k, v, beta, g, S0 = data["q"], data["k"], data["v"], data["beta"], data["g_head"], data["S0"]
    common = dict(scale=scale, initial_state=S0, output_final_state=True)
    if form == "recurrent":
        got = fla_gdn.naive_recurrent_gated_delta_rule(q, k, v, beta, g, **common)
    else:
        got = fla_gdn.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, **common)
    bt = beta[..., None]
    check(got, ours(q, k, bt * v, g, bt * k, scale=scale, initial_state=S0))


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_gdn2(data, form):
    q, k, v, g, b, w, S0 = (data[n] for n in ("q", "k", "v", "g_chan", "b", "w", "S0"))
    fn = fla_gdn2.naive_recurrent_gdn2 if form == "recurrent" else fla_gdn2.naive_chunk_gdn2
    got = fn(q, k, v, g, b, w, scale=0.7, initial_state=S0, output_final_state=True)
    check(got, ours(q, k, w * v, g, kernels.erase_vector(k, q, b, data["lam"], "gdn2"), scale=0.7, initial_state=S0))


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_kda(data, form):
    q, k, v, g, beta, S0 = (data[n] for n in ("q", "k", "v", "g_chan", "beta", "S0"))
    fn = fla_kda.naive_recurrent_kda if form == "recurrent" else fla_kda.naive_chunk_kda
    got = fn(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    bt = beta[..., None]
    check(got, ours(q, k, bt * v, g, bt * k, initial_state=S0))


def test_deltanet(data):
    q, k, v, beta, S0 = (data[n] for n in ("q", "k", "v", "beta", "S0"))
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731  (B, T, H, ·) -> fla's head-first (B, H, T, ·)
    o, S = fla_delta.delta_rule_recurrence(hf(q), hf(k), hf(v), hf(beta), initial_state=S0, output_final_state=True)
    bt = beta[..., None]
    check((hf(o), S), ours(q, k, bt * v, torch.zeros(B, T, H), bt * k, initial_state=S0))


@pytest.mark.parametrize("arm", ["full", "nogate_noproj"])
def test_qed_through_fla_dplr(data, arm):
    """fla has no QED op; its diagonal-plus-low-rank recurrence covers QED's erase factor exactly."""
    q, k, v, g, b, w, S0 = (data[n] for n in ("q", "k", "v", "g_chan", "b", "w", "S0"))
    a = kernels.erase_vector(k, q, b, data["lam"], arm)
    x = w * v
    hf = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    alpha = -(g.exp() * a)                               # fla reads alpha^T S_{t-1} before the decay
    o, S = fla_dplr.dplr_recurrence(hf(q), hf(k), hf(x), hf(alpha), hf(k), hf(g), initial_state=S0,
                                    output_final_state=True)
    check((hf(o), S), ours(q, k, x, g, a, initial_state=S0))


def test_chunked_backend_agrees_with_fla_too(data):
    """The same GDN-2 comparison through our chunked backend in float32, end to end."""
    q, k, v, g, b, w, S0 = (data[n] for n in ("q", "k", "v", "g_chan", "b", "w", "S0"))
    o_fla, S_fla = fla_gdn2.naive_recurrent_gdn2(q, k, v, g, b, w, initial_state=S0, output_final_state=True)
    out = kernels.recurrence(q, k, w * v, g, b * k, initial_state=S0, backend="chunked")
    torch.testing.assert_close(out.o, o_fla, **TOL)
    torch.testing.assert_close(out.final_state, S_fla, **TOL)
