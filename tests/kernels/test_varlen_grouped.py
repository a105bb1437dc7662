"""Packed variable-length batches (cu_seqlens) and grouped value heads on kernels.recurrence, every backend, against
a per-sequence loop and against q and k repeated over the value heads (issue 30, items 1 and 2)."""
from __future__ import annotations

import pytest
import torch

from recurscope import kernels
from recurscope.kernels.inputs import FAMILIES, family_inputs

H, K, V = 2, 16, 8
LAYOUTS = {
    "mixed with empties": [0, 0, 40, 40, 41, 150, 150],
    "one long": [0, 150],
    "all empty but one step": [0, 0, 1, 1],
    "many short": [0, 3, 20, 37, 38, 70, 101, 150],
}


def patches(T, n_seqs, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    ws = torch.rand(1, T, H, generator=gen, dtype=torch.float64).to(dtype)
    return dict(initial_state=rnd(n_seqs, H, K, V), write_scale=ws,
                extra_write=(0.3 * rnd(1, T, H, K), rnd(1, T, H, V)))


def per_sequence_loop(q, k, x, g, a, cu, capture, **kw):
    """The reference backend one sequence at a time: the meaning of cu_seqlens."""
    outs, finals, states = [], [], []
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        init = kw["initial_state"][i:i + 1]
        if hi == lo:
            finals.append(init)
            continue
        sl = lambda t: None if t is None else t[:, lo:hi]  # noqa: E731
        cap = [p - lo for p in capture if lo <= p < hi] or None
        r = kernels.recurrence(*map(sl, (q, k, x, g, a)), initial_state=init, write_scale=sl(kw["write_scale"]),
                               extra_write=tuple(map(sl, kw["extra_write"])), capture=cap, backend="reference")
        outs.append(r.o)
        finals.append(r.final_state)
        if cap:
            states.append(r.states)
    return torch.cat(outs, 1), torch.cat(finals), torch.cat(states, 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_cu_seqlens_equals_a_loop_over_sequences(backend, family, layout):
    cu = LAYOUTS[layout]
    T = cu[-1]
    q, k, x, g, a = family_inputs(family, 1, T, H, K, V, seed=len(cu)).args()
    kw = patches(T, len(cu) - 1)
    capture = sorted({0, T // 2, T - 1, *cu[1:-1]} - {T})
    o, S, states = per_sequence_loop(q, k, x, g, a, cu, capture, **kw)
    out = kernels.recurrence(q, k, x, g, a, cu_seqlens=torch.tensor(cu), capture=capture, backend=backend, **kw)
    assert out.final_state.shape == (len(cu) - 1, H, K, V)
    torch.testing.assert_close(out.o, o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.final_state, S, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.states, states, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["gla", "gdn", "gdn2"])
def test_cu_seqlens_on_the_triton_backend_and_without_initial_states(family):
    cu = [0, 0, 5, 6, 23]
    q, k, x, g, a = family_inputs(family, 1, 23, 1, 8, 4, dtype=torch.float32, seed=3).args()
    ref = kernels.recurrence(q, k, x, g, a, cu_seqlens=cu, backend="reference")
    tri = kernels.recurrence(q, k, x, g, a, cu_seqlens=cu, backend="triton")
    chk = kernels.recurrence(q, k, x, g, a, cu_seqlens=cu, backend="chunked")
    assert torch.equal(ref.final_state[0], torch.zeros(1, 8, 4))          # an empty sequence keeps a zero state
    for out in (tri, chk):
        torch.testing.assert_close(out.o, ref.o, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out.final_state, ref.final_state, atol=2e-5, rtol=2e-5)


def test_triton_runs_packed_sequences_and_grouped_heads_in_one_launch(monkeypatch):
    """The triton kernel takes cu_seqlens (one program row per sequence) and q, k with the key heads itself: one
    launch, captures, initial states and empty sequences included, and its backward (the chunked form recomputed)
    gives the loop's gradients."""
    from recurscope.kernels import triton_recurrent

    launches = []
    real = triton_recurrent._launch
    monkeypatch.setattr(triton_recurrent, "_launch", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    cu, groups = [0, 5, 5, 23, 40], 2
    inp = family_inputs("gdn2", 1, 40, 2 * groups, 8, 4, dtype=torch.float32, seed=6)
    q, k = inp.q[:, :, ::groups].clone().requires_grad_(), inp.k[:, :, ::groups].clone()
    init = torch.randn(4, 2 * groups, 8, 4, generator=torch.Generator().manual_seed(2))
    kw = dict(cu_seqlens=cu, initial_state=init, capture=[0, 4, 5, 30, 39])
    tri = kernels.recurrence(q, k, inp.x, inp.g, inp.a, backend="triton", **kw)
    assert launches == [1]
    rep = lambda t: t.repeat_interleave(groups, dim=2)  # noqa: E731
    q_ref = q.detach().clone().requires_grad_()
    ref = kernels.recurrence(rep(q_ref), rep(k), inp.x, inp.g, inp.a, backend="reference", **kw)
    for name, mine, theirs in zip(("o", "final_state", "states"), tri, ref):
        torch.testing.assert_close(mine, theirs, atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")
    assert torch.equal(tri.final_state[1], init[1])                       # the empty sequence keeps its state
    (d_tri,) = torch.autograd.grad(tri.o.sum() + tri.states.sum(), [q])
    (d_ref,) = torch.autograd.grad(ref.o.sum() + ref.states.sum(), [q_ref])
    torch.testing.assert_close(d_tri, d_ref, atol=5e-5, rtol=5e-5)


def test_cu_seqlens_all_empty_and_errors():
    q = torch.zeros(1, 0, H, K, dtype=torch.float64)
    x = torch.zeros(1, 0, H, V, dtype=torch.float64)
    init = torch.randn(2, H, K, V, dtype=torch.float64)
    for backend in ("chunked", "reference"):
        out = kernels.recurrence(q, q, x, torch.zeros(1, 0, H, dtype=torch.float64), cu_seqlens=[0, 0, 0],
                                 initial_state=init, backend=backend)
        assert out.o.shape == (1, 0, H, V) and torch.equal(out.final_state, init)
    q, k, x, g, a = family_inputs("gdn", 2, 10, H, K, V).args()
    with pytest.raises(ValueError, match="batch must be 1"):
        kernels.recurrence(q, k, x, g, a, cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T = 10"):
        kernels.recurrence(q[:1], k[:1], x[:1], g[:1], a[:1], cu_seqlens=[0, 6, 5, 10])
    with pytest.raises(ValueError, match="initial_state must have shape .*number of sequences"):
        kernels.recurrence(q[:1], k[:1], x[:1], g[:1], a[:1], cu_seqlens=[0, 5, 10],
                           initial_state=torch.zeros(1, H, K, V, dtype=torch.float64))


@pytest.mark.parametrize("family", ["gla", "gdn", "gdn2"])
def test_cu_seqlens_gradients_equal_the_loop(family):
    cu = [0, 7, 7, 40, 90]
    T = cu[-1]
    q, k, x, g, a = family_inputs(family, 1, T, H, 4, 3, seed=5).args()
    init = torch.randn(4, H, 4, 3, dtype=torch.float64)
    w = torch.randn(1, T, H, 3, dtype=torch.float64)

    def grads(packed):
        leaves = [t.clone().requires_grad_() for t in (q, k, x, g, init)]
        if packed:
            out = kernels.recurrence(*leaves[:4], a, cu_seqlens=cu, initial_state=leaves[4], capture=[3, 50],
                                     backend="chunked")
            loss = (out.o * w).sum() + out.final_state.pow(2).sum() + out.states.sum()
        else:
            kw = dict(write_scale=torch.ones(1, T, H, dtype=torch.float64),
                      extra_write=(torch.zeros(1, T, H, 4, dtype=torch.float64),
                                   torch.zeros(1, T, H, 3, dtype=torch.float64)), initial_state=leaves[4])
            o, S, states = per_sequence_loop(*leaves[:4], a, cu, [3, 50], **kw)
            loss = (o * w).sum() + S.pow(2).sum() + states.sum()
        return torch.autograd.grad(loss, leaves)

    for mine, theirs in zip(grads(True), grads(False)):
        torch.testing.assert_close(mine, theirs, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("decay", [0.1, 30.0], ids=["chunk-start pivot", "sub-block pivots"])
@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["chunked", "reference", "triton"])
def test_grouped_value_heads_equal_q_and_k_repeated(backend, family, groups, decay):
    """q and k with H_k heads serve `groups` consecutive value heads each (fla's and transformers' grouping); a and u
    may come per value head or per key head. Same as repeating q and k (and a, u) over the value heads, on both of
    the chunked kernel's routes (a strong decay takes the general one)."""
    if backend == "triton" and decay > 1:
        pytest.skip("the route matters to the chunked backend only")
    Hk, T = 2, 70
    Hv = Hk * groups
    dtype = torch.float32 if backend == "triton" else torch.float64
    inp = family_inputs(family, 1, T, Hv, 8, 4, dtype=dtype, seed=groups, decay=(0.0, decay))
    q, k = inp.q[:, :, ::groups], inp.k[:, :, ::groups]                  # one key head per group
    rep = lambda t: t.repeat_interleave(groups, dim=2)  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    u = (0.3 * torch.randn(1, T, Hk, 8, generator=gen, dtype=torch.float64)).to(dtype)
    y = torch.randn(1, T, Hv, 4, generator=gen, dtype=torch.float64).to(dtype)
    kw = dict(capture=[0, 33, T - 1], initial_state=torch.randn(1, Hv, 8, 4, generator=gen, dtype=dtype))
    a_key = None if inp.a is None else inp.a[:, :, ::groups]             # an erase given per key head
    for a_in, a_rep in ((inp.a, inp.a), (a_key, None if a_key is None else rep(a_key))):
        want = kernels.recurrence(rep(q), rep(k), inp.x, inp.g, a_rep, extra_write=(rep(u), y), backend="reference",
                                  **kw)
        got = kernels.recurrence(q, k, inp.x, inp.g, a_in, extra_write=(u, y), backend=backend, **kw)
        tol = 1e-10 if dtype == torch.float64 else 2e-5
        if backend == "chunked":                          # and in float32, where the no-graph layout pass scales q
            got32 = kernels.recurrence(*(t.float() for t in (q, k, inp.x, inp.g)), None if a_in is None else a_in.float(),
                                       extra_write=(u.float(), y.float()), backend=backend,
                                       **dict(kw, initial_state=kw["initial_state"].float()))
            for name, w, gt in zip(("o", "final_state", "states"), want, got32):
                torch.testing.assert_close(gt.double(), w, atol=2e-5, rtol=2e-5, msg=lambda m: f"float32 {name}: {m}")
        for name, w, gt in zip(("o", "final_state", "states"), want, got):
            torch.testing.assert_close(gt, w, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("family", ["gla", "gdn", "gdn2"])
def test_grouped_value_heads_gradients_reach_the_key_heads(family):
    groups, Hk, T = 2, 2, 40
    inp = family_inputs(family, 1, T, Hk * groups, 4, 3, seed=9)
    q, k = inp.q[:, :, ::groups].clone(), inp.k[:, :, ::groups].clone()
    w = torch.randn(1, T, Hk * groups, 3, dtype=torch.float64)

    def grads(grouped):
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        args = (qq, kk) if grouped else (qq.repeat_interleave(groups, 2), kk.repeat_interleave(groups, 2))
        out = kernels.recurrence(*args, inp.x, inp.g, inp.a, capture=[10], backend="chunked" if grouped else "reference")
        return torch.autograd.grad((out.o * w).sum() + out.states.sum(), [qq, kk])

    for mine, theirs in zip(grads(True), grads(False)):
        torch.testing.assert_close(mine, theirs, atol=1e-9, rtol=1e-9)


def test_grouped_value_heads_with_cu_seqlens():
    groups, Hk = 2, 1
    cu = [0, 30, 30, 77]
    inp = family_inputs("gdn2", 1, 77, Hk * groups, 8, 4, seed=4)
    q, k = inp.q[:, :, ::groups], inp.k[:, :, ::groups]
    want = kernels.recurrence(q.repeat_interleave(groups, 2), k.repeat_interleave(groups, 2), inp.x, inp.g, inp.a,
                              cu_seqlens=cu, backend="reference")
    got = kernels.recurrence(q, k, inp.x, inp.g, inp.a, cu_seqlens=cu, backend="chunked")
    torch.testing.assert_close(got.o, want.o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.final_state, want.final_state, atol=1e-10, rtol=1e-10)
