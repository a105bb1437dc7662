"""The chunked backend against the reference step loop: every family, every patch feature, dtypes, autograd, stepping."""
from __future__ import annotations

import pytest
import torch

from recurscope import kernels
from recurscope.kernels.inputs import FAMILIES, family_inputs


def make_patches(features, B, T, H, K, V, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    kw = {}
    if "write_scale" in features:
        ws = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 1.5
        ws[:, ::7] = 0.0                                     # blocked writes
        kw["write_scale"] = ws.to(dtype)
    if "extra_write" in features:
        u = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) * 0.3
        y = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
        kw["extra_write"] = (u.to(dtype), y.to(dtype))
    if "initial_state" in features:
        kw["initial_state"] = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(dtype)
    if "capture" in features:
        kw["capture"] = sorted({0, 1, 15, 63, 64, 65, T // 2, T - 2, T - 1} & set(range(T)))
    return kw


def run_both(q, k, x, g, a, **kw):
    ref = kernels.recurrence(q, k, x, g, a, backend="reference", **kw)
    chk = kernels.recurrence(q, k, x, g, a, backend="chunked", **kw)
    return ref, chk


def assert_outputs_close(ref, chk, atol, rtol):
    for name, r, c in zip(("o", "final_state", "states"), ref, chk):
        if r is None:
            assert c is None, name
            continue
        assert c.dtype == r.dtype and c.shape == r.shape, name
        torch.testing.assert_close(c, r, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


FEATURE_SETS = [(), ("write_scale",), ("extra_write",), ("capture",), ("initial_state",),
                ("write_scale", "extra_write", "capture", "initial_state")]


@pytest.mark.parametrize("features", FEATURE_SETS, ids=lambda f: "+".join(f) or "plain")
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_matches_reference_float64(family, features):
    B, T, H, K, V = 2, 150, 2, 16, 8                          # T = 2 * 64 + 22: a ragged last chunk
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, seed=hash(features) % 1000).args()
    kw = make_patches(features, B, T, H, K, V, torch.float64)
    ref, chk = run_both(q, k, x, g, a, **kw)
    assert_outputs_close(ref, chk, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("features", [(), ("write_scale", "extra_write", "capture", "initial_state")],
                         ids=["plain", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_matches_reference_float32(family, features):
    """float32 chunked against the float64 reference of the very same float32 inputs."""
    B, T, H, K, V = 2, 150, 2, 16, 8
    inputs = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=5).args()
    kw = make_patches(features, B, T, H, K, V, torch.float32)
    chk = kernels.recurrence(*inputs, backend="chunked", **kw)
    up = lambda t: None if t is None else t.double()  # noqa: E731
    kw64 = {n: (tuple(map(up, t)) if isinstance(t, tuple) else up(t)) if n != "capture" else t for n, t in kw.items()}
    ref = kernels.recurrence(*map(up, inputs), backend="reference", **kw64)
    assert chk.o.dtype == torch.float32 and chk.final_state.dtype == torch.float32
    assert_outputs_close(tuple(map(up, ref)), tuple(map(up, chk)), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("chunk_size", [16, 32, 48, 64, 128])
@pytest.mark.parametrize("features", [(), ("write_scale", "extra_write", "capture", "initial_state")],
                         ids=["plain", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_chunk_size_matches_reference(family, features, chunk_size):
    """The default chunk length depends on the family (32 with an erase vector, 64 without); every multiple of the
    sub-block computes the same recurrence, a ragged last chunk included."""
    from recurscope.kernels.chunked import default_chunk_size, recurrence_chunked

    assert default_chunk_size(True) == 32 and default_chunk_size(False) == 64
    B, T, H, K, V = 2, 150, 2, 16, 8
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, seed=chunk_size).args()
    kw = make_patches(features, B, T, H, K, V, torch.float64)
    ref = kernels.recurrence(q, k, x, g, a, backend="reference", **kw)
    chk = recurrence_chunked(q, k, x, g, a, scale=K ** -0.5, dtype=torch.float64, chunk_size=chunk_size, **kw)
    assert_outputs_close(ref, chk, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="multiple of 16"):
        recurrence_chunked(q, k, x, g, a, scale=K ** -0.5, chunk_size=24)


@pytest.mark.parametrize("family", FAMILIES)
def test_lifted_route_serves_every_no_graph_call_and_a_capture_moves_no_output(family, monkeypatch):
    """A no-graph call whose decays stay within the chunk-start pivot's range forms its operands straight from the
    caller's tensors (_lifted_operands), captures and extra writes included, so a capture leaves the outputs bit for
    bit; autograd and decays past the range take the general route. Both routes give one answer."""
    from recurscope.kernels import chunked

    calls = []
    lifted = chunked._lifted_operands
    monkeypatch.setattr(chunked, "_lifted_operands", lambda *a: calls.append(1) or lifted(*a))
    B, T, H, K, V = 2, 100, 2, 16, 8
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=2).args()
    ws = torch.rand(B, T, H, generator=torch.Generator().manual_seed(3))
    plain = kernels.recurrence(q, k, x, g, a, write_scale=ws, backend="chunked")
    captured = kernels.recurrence(q, k, x, g, a, write_scale=ws, capture=[5, 40, T - 1], backend="chunked")
    zero_u = (torch.zeros(B, T, H, K), torch.zeros(B, T, H, V))
    extra = kernels.recurrence(q, k, x, g, a, write_scale=ws, extra_write=zero_u, backend="chunked")
    assert calls == [1, 1, 1]
    assert torch.equal(captured.o, plain.o) and torch.equal(captured.final_state, plain.final_state)
    torch.testing.assert_close(captured.states[:, -1], plain.final_state, atol=2e-6, rtol=2e-6)
    leaves = [t.clone().requires_grad_() for t in (q, k, x)]
    graphed = kernels.recurrence(*leaves, g, a, write_scale=ws, backend="chunked")
    graphed_capture = kernels.recurrence(*leaves, g, a, write_scale=ws, capture=[5, 40, T - 1], backend="chunked")
    assert calls == [1, 1, 1]
    for other in (extra, graphed):
        torch.testing.assert_close(other.o.detach(), plain.o, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(other.final_state.detach(), plain.final_state, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(graphed_capture.states.detach(), captured.states, atol=2e-6, rtol=2e-6)
    if family != "deltanet":                             # no decay: nothing can leave the range
        kernels.recurrence(q, k, x, g * 200, a, backend="chunked")
        assert calls == [1, 1, 1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("T", [1, 16, 64, 65, 130])
def test_lengths_and_first_last_capture(family, T):
    q, k, x, g, a = family_inputs(family, 1, T, 2, 8, 4, seed=T).args()
    capture = sorted({0, T - 1})
    ref, chk = run_both(q, k, x, g, a, capture=capture)
    assert chk.states.shape == (1, len(capture), 2, 8, 4)
    assert_outputs_close(ref, chk, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(chk.states[:, -1], chk.final_state, atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["gla", "gdn", "kda", "gdn2", "qed"])
def test_strong_decay_float32_stays_finite_and_matches(family):
    """log decays down to -30 per step: products over a chunk reach e^-1900, far past float32's range."""
    B, T, H, K, V = 1, 200, 2, 16, 8
    inputs = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=9, decay=(0.0, 30.0)).args()
    kw = make_patches(("initial_state", "capture", "extra_write"), B, T, H, K, V, torch.float32)
    chk = kernels.recurrence(*inputs, backend="chunked", **kw)
    for t in (chk.o, chk.final_state, chk.states):
        assert torch.isfinite(t).all()
    up = lambda t: None if t is None else t.double()  # noqa: E731
    kw64 = dict(kw, initial_state=up(kw["initial_state"]), extra_write=tuple(map(up, kw["extra_write"])))
    ref = kernels.recurrence(*map(up, inputs), backend="reference", **kw64)
    assert_outputs_close(tuple(map(up, ref)), tuple(map(up, chk)), atol=2e-5, rtol=2e-5)


def test_mixed_weak_and_strong_channel_decay_float32():
    """Some channels barely decay while others decay by e^-30 per step, inside the same chunk."""
    B, T, H, K, V = 1, 128, 2, 16, 8
    q, k, x, g, a = family_inputs("kda", B, T, H, K, V, dtype=torch.float32, seed=4, decay=(0.0, 0.05)).args()
    g = g.clone()
    g[..., ::2] = -30.0 * torch.rand(g[..., ::2].shape, generator=torch.Generator().manual_seed(2))
    chk = kernels.recurrence(q, k, x, g, a, backend="chunked")
    assert torch.isfinite(chk.o).all() and torch.isfinite(chk.final_state).all()
    ref = kernels.recurrence(*(t.double() for t in (q, k, x, g, a)), backend="reference")
    torch.testing.assert_close(chk.o.double(), ref.o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(chk.final_state.double(), ref.final_state, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["gla", "gdn", "qed"])
def test_half_inputs_accumulate_in_float32(family, dtype):
    B, T, H, K, V = 1, 100, 2, 16, 8
    inputs = family_inputs(family, B, T, H, K, V, dtype=dtype, seed=3).args()
    kw = make_patches(("initial_state", "capture"), B, T, H, K, V, dtype)
    chk = kernels.recurrence(*inputs, backend="chunked", **kw)
    assert chk.o.dtype == dtype
    assert chk.final_state.dtype == torch.float32 and chk.states.dtype == torch.float32
    up = lambda t: None if t is None else t.double()  # noqa: E731
    ref = kernels.recurrence(*map(up, inputs), backend="reference", **dict(kw, initial_state=up(kw["initial_state"])))
    # States carry float32 error only: the half inputs are exact in float64.
    torch.testing.assert_close(chk.final_state.double(), ref.final_state, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(chk.states.double(), ref.states, atol=2e-5, rtol=2e-5)
    # o is rounded once to the half dtype at the end: within half a unit in the last place of the float64 value,
    # plus float32 error. (Comparing with the rounded reference instead fails by one unit wherever the float32
    # and float64 values straddle a rounding midpoint, which any reordering of float32 sums can cause.)
    tiny, eps = torch.finfo(dtype).tiny, torch.finfo(dtype).eps
    ulp = eps * 2.0 ** torch.floor(torch.log2(ref.o.abs().clamp_min(tiny)))
    excess = (chk.o.double() - ref.o).abs() - (ulp / 2 + 1e-6)
    assert float(excess.max()) <= 0, f"o is off by more than half a unit of {dtype} at {int(excess.argmax())}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_keeps_the_half_dtype_contract(dtype):
    """The contract of RecurrenceOutput: o in q's dtype, states in float32, for every backend."""
    inputs = family_inputs("gdn", 1, 20, 2, 8, 4, dtype=dtype).args()
    ref_half = kernels.recurrence(*inputs, backend="reference")
    assert ref_half.final_state.dtype == torch.float32
    assert ref_half.o.dtype == dtype


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_reference(family):
    B, T, H, K, V = 1, 70, 2, 4, 3                            # two chunks
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, seed=8).args()
    kw = make_patches(("write_scale", "extra_write", "initial_state"), B, T, H, K, V, torch.float64)
    leaves = {"q": q, "k": k, "x": x, "g": g, "a": a, "write_scale": kw["write_scale"],
              "u": kw["extra_write"][0], "y": kw["extra_write"][1], "initial_state": kw["initial_state"]}
    leaves = {n: t for n, t in leaves.items() if t is not None}
    gen = torch.Generator().manual_seed(0)
    w_o = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    w_s = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    w_c = torch.randn(B, 3, H, K, V, generator=gen, dtype=torch.float64)

    def grads(backend):
        p = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
        out = kernels.recurrence(
            p["q"], p["k"], p["x"], p["g"], p.get("a"), write_scale=p["write_scale"],
            extra_write=(p["u"], p["y"]), initial_state=p["initial_state"], capture=[0, 40, T - 1], backend=backend,
        )
        loss = (out.o * w_o).sum() + (out.final_state * w_s).sum() + (out.states * w_c).sum()
        return dict(zip(p, torch.autograd.grad(loss, list(p.values()))))

    ref, chk = grads("reference"), grads("chunked")
    for name in ref:
        torch.testing.assert_close(chk[name], ref[name], atol=1e-9, rtol=1e-9, msg=lambda m: f"d/d{name}: {m}")


def _graph_node_names(root):
    names, seen, todo = [], set(), [root]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(fn for fn, _ in node.next_functions)
    return names


@pytest.mark.parametrize("family", ["gla", "gdn", "gdn2"])
def test_backward_does_not_select_from_whole_tensors_per_chunk(family):
    """The state pass under autograd reads each chunk from one unbind per tensor, so its backward stacks the chunks'
    gradients once. A select per chunk of a whole (N, ...) tensor puts one node per chunk in the graph, each filling
    and adding a gradient the size of the whole tensor: quadratic in the number of chunks (59% fill_ and 11% add_ of
    a GDN forward plus backward at T = 2048, docs/performance.md)."""
    B, T, H, K, V = 1, 16 * 12, 2, 4, 3
    q, k, x, g, a = (None if t is None else t.requires_grad_(True)
                     for t in family_inputs(family, B, T, H, K, V, seed=3).args())
    out = kernels.recurrence(q, k, x, g, a, backend="chunked", chunk_size=16)
    names = _graph_node_names((out.o.sum() + out.final_state.sum()).grad_fn)
    assert names.count("SelectBackward0") < T // 16, names.count("SelectBackward0")   # fewer than one per chunk


@pytest.mark.parametrize("family", ["gla", "gdn", "qed"])
def test_stepping_equals_one_run(family):
    """Running [0, t) then [t, T) from the returned state equals the full run (inside chunks and at boundaries)."""
    B, T, H, K, V = 1, 150, 2, 8, 4
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, seed=12).args()
    full = kernels.recurrence(q, k, x, g, a, backend="chunked")
    sl = lambda t, s: None if t is None else t[:, s]  # noqa: E731
    for t in (1, 37, 63, 64, 65, 128, 149):
        first, second = slice(0, t), slice(t, T)
        o1, S1, _ = kernels.recurrence(*(sl(z, first) for z in (q, k, x, g, a)), backend="chunked")
        o2, S2, _ = kernels.recurrence(*(sl(z, second) for z in (q, k, x, g, a)), initial_state=S1, backend="chunked")
        torch.testing.assert_close(torch.cat([o1, o2], 1), full.o, atol=1e-10, rtol=1e-10, msg=lambda m: f"t={t}: {m}")
        torch.testing.assert_close(S2, full.final_state, atol=1e-10, rtol=1e-10, msg=lambda m: f"t={t}: {m}")


def test_output_final_state_false_returns_none():
    q, k, x, g, a = family_inputs("gdn", 1, 20, 1, 4, 4).args()
    out = kernels.recurrence(q, k, x, g, a, backend="chunked", output_final_state=False)
    assert out.final_state is None and out.states is None


@pytest.mark.parametrize("features", [(), ("write_scale", "extra_write", "capture")], ids=["plain", "patched"])
@pytest.mark.parametrize("T", [7, 150])
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_expanded_initial_state_and_no_final_state_match_reference(family, T, features):
    """Rows continuing one prefix (the head scan's suffix rows) pass S[:1].expand(B, ...): the chunked backend reads
    it as one state per head; with output_final_state=False it skips the last update. Both equal the reference on
    the materialised state, and the caller's state is left untouched."""
    B, H, K, V = 3, 2, 16, 8
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, seed=31).args()
    kw = make_patches(features, B, T, H, K, V, torch.float64)
    one = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    shared = one.expand(B, H, K, V)
    assert shared.stride(0) == 0
    ref = kernels.recurrence(q, k, x, g, a, backend="reference", initial_state=shared.clone(), **kw)
    for final in (True, False):
        chk = kernels.recurrence(q, k, x, g, a, backend="chunked", initial_state=shared, output_final_state=final, **kw)
        assert_outputs_close(ref if final else ref._replace(final_state=None), chk, atol=1e-10, rtol=1e-10)
        own = kernels.recurrence(q, k, x, g, a, backend="chunked", initial_state=shared.clone(),
                                 output_final_state=final, **kw)
        assert_outputs_close(ref if final else ref._replace(final_state=None), own, atol=1e-10, rtol=1e-10)
    assert torch.equal(one, torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64))


def test_gradients_stay_finite_and_exact_under_decays_that_overflow_a_sub_chunk():
    # Up to -12 per step: a 16-step block spans ~190 nats, past the float32 pivot range, so the exact
    # diagonal-block path takes over; its backward must not see inf * 0 from the pivoted factors.
    torch.manual_seed(7)
    B, T, H, K, V = 1, 100, 2, 8, 6
    q = torch.randn(B, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    x = torch.randn(B, T, H, V)
    g = torch.rand(B, T, H, K) * -12
    a = torch.rand(B, T, H, K) * k
    leaves = [t.clone().requires_grad_() for t in (q, k, x, g, a)]
    out = kernels.recurrence(*leaves, backend="chunked")
    (out.o.sum() + out.final_state.sum()).backward()
    ref = [t.double().requires_grad_() for t in (q, k, x, g, a)]
    out_ref = kernels.recurrence(*ref, backend="reference")
    (out_ref.o.sum() + out_ref.final_state.sum()).backward()
    for mine, theirs in zip(leaves, ref):
        assert torch.isfinite(mine.grad).all()
        scale = theirs.grad.abs().max() + 1e-12
        assert ((mine.grad.double() - theirs.grad).abs().max() / scale) < 1e-4


def test_pairwise_terms_pivoted_at_the_chunk_start_equal_the_blocked_pivots(monkeypatch):
    """The per-channel pairwise terms, pivoted once at the chunk's start (within the dtype's decay range) and at
    every sub-block (any decay), both equal the materialised sum_k x_t y_s e^{G_t - G_s}; a chunk spanning more
    decay than float32 holds takes the sub-block path; and a later step never moves an earlier output, not even by
    rounding (a patch leaves every earlier position bit for bit)."""
    from recurscope.kernels import chunked

    gen = torch.Generator().manual_seed(3)
    N, BH, C, K = 2, 3, 64, 8
    G = (-torch.rand(N, BH, C, K, generator=gen, dtype=torch.float64)).cumsum(-2)
    x, y = (torch.randn(N, BH, C, K, generator=gen, dtype=torch.float64) for _ in range(2))
    dec = (G[..., :, None, :] - G[..., None, :, :]).exp() * torch.ones(C, C, dtype=torch.float64).tril()[..., None]
    exact = torch.einsum("...tk,...sk,...tsk->...ts", x, y, dec)
    start_pivot = chunked._pairwise_lifted(x * G.exp(), y / G.exp(), C)
    stacked = chunked._pairwise_lifted(torch.cat([x * G.exp(), 2 * x * G.exp()], -2), y / G.exp(), C)
    torch.testing.assert_close(stacked, torch.cat([exact, 2 * exact], -2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(start_pivot, exact, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked._pairwise_channel([x], y, G, 600.0)[0], exact, rtol=1e-12, atol=1e-12)

    calls = []
    blocked = chunked._pairwise_channel
    monkeypatch.setattr(chunked, "_pairwise_channel", lambda *a: calls.append(1) or blocked(*a))
    q, k, x, g, a = family_inputs("gdn2", 1, 64, 1, 8, 4, dtype=torch.float32, decay=(0.0, 0.5)).args()
    kernels.recurrence(q, k, x, g, a, backend="chunked")
    assert calls == []                                   # spans about 16 nats: one pivot per chunk
    kernels.recurrence(q, k, x, g * 8, a, backend="chunked")
    assert calls == [1]                                  # spans about 128 nats: sub-block pivots

    for family in ("gla", "gdn2"):
        q, k, x, g, a = family_inputs(family, 1, 50, 2, 8, 4, dtype=torch.float32, decay=(0.0, 0.5)).args()
        clean = kernels.recurrence(q, k, x, g, a, backend="chunked").o
        later = [t.clone() for t in (q, k, x, g)]
        for t in later:
            t[:, 30:] *= 1.5
        moved = kernels.recurrence(*later, a, backend="chunked").o
        assert torch.equal(moved[:, :30], clean[:, :30]), family
        assert not torch.equal(moved[:, 30:], clean[:, 30:])


@pytest.mark.parametrize("family_erase", [False, True])
def test_gradients_stay_finite_when_a_chunk_spans_decay_whose_square_overflows(family_erase):
    # About -0.8 per step: a 64-step chunk spans ~50 nats, inside the forward's start-pivot range (60) but e^{2x50}
    # overflows float32, which the backward of y / e^{G} would need. (The QED training test caught NaN here.)
    torch.manual_seed(11)
    B, T, H, K, V = 1, 128, 2, 8, 6
    q = torch.randn(B, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    x = torch.randn(B, T, H, V)
    g = -0.6 - 0.4 * torch.rand(B, T, H, K)
    a = torch.rand(B, T, H, K) * k if family_erase else None
    leaves = [t.clone().requires_grad_() for t in (q, k, x, g, a) if t is not None]
    out = kernels.recurrence(*leaves, backend="chunked")
    (out.o.sum() + out.final_state.sum()).backward()
    ref = [t.double().requires_grad_() for t in (q, k, x, g, a) if t is not None]
    out_ref = kernels.recurrence(*ref, backend="reference")
    (out_ref.o.sum() + out_ref.final_state.sum()).backward()
    for mine, theirs in zip(leaves, ref):
        assert torch.isfinite(mine.grad).all()
        scale = theirs.grad.abs().max() + 1e-12
        assert ((mine.grad.double() - theirs.grad).abs().max() / scale) < 1e-4


@pytest.mark.parametrize("T", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("g_dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_base2_decay_sums_equal_a_float64_cumsum(T, g_dtype):
    """The no-graph per-channel decay sums (chunk-major copy scaled by log2 e, summed in place) equal a float64
    cumsum of the same g within each chunk, rows past T repeating the sum at T, for any dtype of g (cast before it is
    scaled, so bfloat16 is not rounded again) and a non-contiguous g."""
    from recurscope.kernels import chunked

    gen = torch.Generator().manual_seed(T)
    B, H, K, C = 2, 3, 5, 32
    N = -(-T // C)
    g64 = -torch.rand(B, H, T, K, generator=gen, dtype=torch.float64)
    g = g64.to(g_dtype).transpose(1, 2)                      # (B, T, H, K), not contiguous
    assert T == 1 or not g.is_contiguous()
    padded = torch.zeros(B, N * C, H, K, dtype=torch.float64)
    padded[:, :T] = g.double()
    expect = padded.view(B, N, C, H, K).cumsum(2).permute(1, 0, 3, 2, 4).reshape(N, B * H, C, K) / chunked.LN2
    poisoned = lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731  every entry is written
    got = chunked._log2_decay_sums(g, B, T, H, N, C, torch.float32, poisoned)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expect, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("C", [16, 32, 64])
def test_unit_lower_inverse_into_buffers_equals_the_allocating_form_and_linalg_inv(C):
    """The blocked unit-triangular inverse, with its levels and solves written into given buffers (no graph) and
    allocated (autograd), equals inv(I + strict lower part of A) in float64; the diagonal and upper triangle of A are
    never read, and every entry of every buffer is written."""
    from recurscope.kernels import chunked

    gen = torch.Generator().manual_seed(C)
    A = torch.randn(3, 2, C, C, generator=gen, dtype=torch.float64) * 0.2
    junk = A.clone()
    junk.triu_().fill_(float("nan"))
    A_junk = torch.where(torch.ones(C, C, dtype=torch.bool).triu(), junk, A)
    expect = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A.tril(-1))
    poisoned = lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731
    torch.testing.assert_close(chunked._unit_lower_inverse(A_junk, poisoned), expect, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked._unit_lower_inverse(A_junk), expect, rtol=1e-12, atol=1e-12)
