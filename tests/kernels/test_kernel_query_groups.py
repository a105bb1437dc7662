"""Query groups on kernels.recurrence (issue 31, item 3): q with H_q = m H heads where k, x, g and the states have H
(GLA-7B's grouped key/value heads); query head h m + j reads state h. Checked against an explicit float64 step loop
written here, with every patch (initial state, write scale, extra write, captures) and packed sequences."""
from __future__ import annotations

import pytest
import torch

from recurscope import kernels
from recurscope.kernels.inputs import family_inputs

B, T, H, M, K, V = 2, 37, 2, 3, 16, 8


def step_loop(q, k, x, g, a, scale, init, ws, extra):
    """The equation, one step at a time in float64, every query head read from its group's state."""
    S = init.double().clone()
    o = torch.zeros(B, T, H * M, V, dtype=torch.float64)
    states = []
    for t in range(T):
        for h in range(H):
            d = g[:, t, h].double().exp()
            S_h = (d[..., None] if d.dim() == 2 else d[:, None, None]) * S[:, h]
            if a is not None:
                S_h = S_h - k[:, t, h, :, None] * torch.einsum("bk,bkv->bv", a[:, t, h], S_h)[:, None, :]
            S_h = S_h + k[:, t, h, :, None] * (ws[:, t, h, None] * x[:, t, h])[:, None, :]
            S_h = S_h + extra[0][:, t, h, :, None] * extra[1][:, t, h][:, None, :]
            S[:, h] = S_h
            for j in range(M):
                o[:, t, h * M + j] = scale * torch.einsum("bkv,bk->bv", S_h, q[:, t, h * M + j])
        states.append(S.clone())
    return o, S, torch.stack(states, 1)


def grouped_inputs(family, seed=0):
    inp = family_inputs(family, B, T, H, K, V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, T, H * M, K, generator=gen, dtype=torch.float64)
    patches = dict(initial_state=torch.randn(B, H, K, V, generator=gen, dtype=torch.float64),
                   write_scale=torch.rand(B, T, H, generator=gen, dtype=torch.float64),
                   extra_write=(0.3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64),
                                torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)))
    return q, inp, patches


@pytest.mark.parametrize("family", ["gla", "gdn"])
@pytest.mark.parametrize("backend", ["reference", "chunked", "triton"])
def test_query_groups_equal_the_step_loop(backend, family):
    q, inp, kw = grouped_inputs(family)
    capture = [0, 5, T - 1]
    o, S, states = step_loop(q, inp.k, inp.x, inp.g, inp.a, K ** -0.5, kw["initial_state"], kw["write_scale"],
                             kw["extra_write"])
    dtype = torch.float32 if backend == "triton" else torch.float64
    cast = lambda t: t.to(dtype)  # noqa: E731
    out = kernels.recurrence(cast(q), *(None if t is None else cast(t) for t in (inp.k, inp.x, inp.g, inp.a)),
                             initial_state=cast(kw["initial_state"]), write_scale=cast(kw["write_scale"]),
                             extra_write=tuple(map(cast, kw["extra_write"])), capture=capture, backend=backend)
    tol = dict(atol=2e-4, rtol=2e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    assert out.o.shape == (B, T, H * M, V) and out.final_state.shape == (B, H, K, V)
    torch.testing.assert_close(out.o.double(), o, **tol)
    torch.testing.assert_close(out.final_state.double(), S, **tol)
    torch.testing.assert_close(out.states.double(), states[:, capture], **tol)


def test_query_groups_are_not_the_repeated_state():
    """The mirror of grouped value heads is not a relabelling: the m queries of a group read ONE state, so their
    outputs differ from each other (different q) while the states stay H, not H_q."""
    q, inp, _ = grouped_inputs("gla")
    out = kernels.recurrence(q, inp.k, inp.x, inp.g, backend="chunked")
    assert out.final_state.shape[1] == H
    assert (out.o[:, :, 0] - out.o[:, :, 1]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_query_groups_with_packed_sequences(backend):
    q, inp, _ = grouped_inputs("gla", seed=3)
    cu = [0, 10, 10, T]
    q1, k1, x1, g1 = (t[:1] for t in (q, inp.k, inp.x, inp.g))
    out = kernels.recurrence(q1, k1, x1, g1, cu_seqlens=torch.tensor(cu), backend=backend)
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        if hi == lo:
            assert out.final_state[i].abs().max() == 0
            continue
        one = kernels.recurrence(*(t[:, lo:hi] for t in (q1, k1, x1, g1)), backend="reference")
        torch.testing.assert_close(out.o[:, lo:hi], one.o, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(out.final_state[i:i + 1], one.final_state, atol=1e-10, rtol=1e-10)


def test_query_groups_gradients_match_the_reference():
    q, inp, kw = grouped_inputs("gla", seed=5)
    grads = {}
    for backend in ("reference", "chunked"):
        leaves = [t.clone().requires_grad_() for t in (q, inp.k, inp.x, inp.g)]
        out = kernels.recurrence(*leaves, initial_state=kw["initial_state"], backend=backend)
        (out.o.square().sum() + out.final_state.sum()).backward()
        grads[backend] = [t.grad for t in leaves]
    for ref, got in zip(grads["reference"], grads["chunked"]):
        torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-9)


def test_heads_that_fit_neither_grouping_are_refused():
    q, inp, _ = grouped_inputs("gla")
    with pytest.raises(ValueError, match="query groups"):
        kernels.recurrence(q[:, :, :5], inp.k, inp.x, inp.g, backend="reference")
    with pytest.raises(ValueError, match="query groups"):   # q with more heads than k, and k fewer than x
        kernels.recurrence(q, inp.k[:, :, :1], inp.x, inp.g, backend="reference")


def test_the_low_rank_entry_refuses_query_groups():
    q, inp, _ = grouped_inputs("gdn")
    with pytest.raises(ValueError, match="recurrence_low_rank takes q with k's heads"):
        kernels.recurrence_low_rank(q, inp.k, inp.x, inp.g, inp.a, inp.a, backend="reference")
