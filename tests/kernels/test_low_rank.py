"""The decay-plus-low-rank recurrence (kernels.recurrence_low_rank): the chunked path against the float64 step loop,
its gradient, its patch features, and both against fla 0.6.0's DPLR naive functions (chunk_rwkv7 and
fused_recurrent_rwkv7 are fla's DPLR op with a = -kk, b = kk * iclr) under fla's tolerance rule.

fla's dplr_recurrence(q, k, v, alpha, beta, gk) (head-first) computes S' = Diag(exp gk) S + k v^T + beta (alpha^T S),
with q scaled by K^-0.5: ours with a = -alpha, b = beta, x = v.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from recurscope import kernels
from recurscope.kernels.low_rank import low_rank_chunked

with warnings.catch_warnings():
    warnings.simplefilter("ignore")                      # fla warns that Triton has no GPU here
    fla_dplr = pytest.importorskip("fla.ops.generalized_delta_rule.dplr.naive")
    fla_testing = pytest.importorskip("fla.utils.testing")

FLA_RATIO = 0.005   # fla's assert_close: passes when max |err| <= 1e-6, else needs RMS(err) / RMS(ref) < ratio


def rwkv7_inputs(B, T, H, K, V, *, log_w_min=-0.6065306597126334, dtype=torch.float64, seed=0, per_head=False):
    """RWKV-7's form: w in [log_w_min, 0) per channel, kk unit-norm, a = kk, b = kk * iclr with iclr in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if log_w_min < -1.0:         # spread over decades down to log_w_min, so strong and mild decays alternate
        g = -torch.pow(10.0, u(B, T, H, K) * (torch.log10(torch.tensor(-log_w_min)) + 3) - 3)
    else:
        g = log_w_min * u(B, T, H, K)
    if per_head:
        g = g[..., 0]
    kk = F.normalize(r(B, T, H, K), dim=-1)
    iclr = u(B, T, H, K)
    out = dict(q=r(B, T, H, K), k=0.5 * r(B, T, H, K), x=r(B, T, H, V), g=g, a=kk, b=kk * iclr)
    return {n: t.to(dtype) for n, t in out.items()}


def patches(B, T, H, K, V, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ws = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 1.5
    ws[:, ::7] = 0.0
    return dict(
        write_scale=ws.to(dtype),
        extra_write=(0.3 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype),
                     torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(dtype)),
        initial_state=torch.randn(B, H, K, V, generator=gen, dtype=torch.float64).to(dtype),
        capture=sorted({0, 1, 31, 32, 33, T // 2, T - 1}),
    )


def run(backend, d, **kw):
    return kernels.recurrence_low_rank(d["q"], d["k"], d["x"], d["g"], d["a"], d["b"], backend=backend, **kw)


def test_reference_is_the_equation_worked_by_hand():
    """Two steps, one head, K = V = 2, written out."""
    d = {n: t[:, :2, :1, :2] for n, t in rwkv7_inputs(1, 2, 1, 2, 2).items() if n != "x"}
    d["x"] = torch.tensor([[[[1.0, -2.0]], [[0.5, 3.0]]]], dtype=torch.float64)
    S = torch.zeros(2, 2, dtype=torch.float64)
    outs = []
    for t in range(2):
        at, bt, kt, qt, gt = (d[n][0, t, 0] for n in ("a", "b", "k", "q", "g"))
        S = (torch.diag(gt.exp()) - torch.outer(bt, at)) @ S + torch.outer(kt, d["x"][0, t, 0])
        outs.append(0.7 * S.T @ qt)
    got = run("reference", d, scale=0.7)
    torch.testing.assert_close(got.o[0, :, 0], torch.stack(outs), atol=1e-14, rtol=0)
    torch.testing.assert_close(got.final_state[0, 0], S, atol=1e-14, rtol=0)


@pytest.mark.parametrize("per_head", [False, True], ids=["per_channel", "per_head"])
@pytest.mark.parametrize("features", [False, True], ids=["plain", "all_patches"])
@pytest.mark.parametrize("log_w_min", [-0.6065306597126334, -1e4], ids=["rwkv7_range", "to_-1e4"])
def test_chunked_matches_reference_float64(per_head, features, log_w_min):
    B, T, H, K, V = 2, 75, 2, 8, 6                       # T = 2 * 32 + 11: a ragged last chunk
    d = rwkv7_inputs(B, T, H, K, V, log_w_min=log_w_min, per_head=per_head)
    kw = patches(B, T, H, K, V, torch.float64) if features else {}
    ref, chk = run("reference", d, **kw), run("chunked", d, **kw)
    for name, r, c in zip(("o", "final_state", "states"), ref, chk):
        if r is None:
            assert c is None, name
            continue
        torch.testing.assert_close(c, r, atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("log_w_min", [-0.6065306597126334, -1e4], ids=["rwkv7_range", "to_-1e4"])
def test_chunked_float32_stays_finite_and_close(log_w_min):
    B, T, H, K, V = 1, 128, 2, 16, 16
    d64 = rwkv7_inputs(B, T, H, K, V, log_w_min=log_w_min)
    kw64 = patches(B, T, H, K, V, torch.float64)
    d32 = {n: t.float() for n, t in d64.items()}
    kw32 = patches(B, T, H, K, V, torch.float32)
    ref, chk = run("reference", d64, **kw64), run("chunked", d32, **kw32)
    for name, r, c in zip(("o", "final_state", "states"), ref, chk):
        assert torch.isfinite(c).all(), name
        fla_testing.assert_close(name, r.float(), c, FLA_RATIO)
        torch.testing.assert_close(c.double(), r, atol=2e-4, rtol=2e-4)


def test_a_decay_rewritten_erase_overflows_where_this_form_does_not():
    """Why this form exists: recurrence's (I - k a'^T) Diag(exp g) equals Diag(exp g) - b a^T only with
    a' = Diag(exp g)^-1 a, which is inf in float32 at log w = -1e4."""
    d = {n: t.float() for n, t in rwkv7_inputs(1, 16, 1, 8, 4, log_w_min=-1e4).items()}
    rewritten = d["a"] / d["g"].exp()
    assert not torch.isfinite(rewritten).all()
    assert torch.isfinite(run("chunked", d).o).all()


@pytest.mark.parametrize("log_w_min", [-0.6065306597126334, -1e4], ids=["rwkv7_range", "to_-1e4"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_channel", "per_head"])
def test_chunked_gradient_matches_reference_gradient(log_w_min, per_head):
    B, T, H, K, V = 1, 40, 2, 6, 5
    d = rwkv7_inputs(B, T, H, K, V, log_w_min=log_w_min, per_head=per_head)
    kw = patches(B, T, H, K, V, torch.float64)
    kw["capture"] = [3, 35]
    leaves = list(d.values()) + [kw["write_scale"], *kw["extra_write"], kw["initial_state"]]
    for t in leaves:
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(5)
    cot = [torch.randn(s, generator=gen, dtype=torch.float64) for s in
           ((B, T, H, V), (B, H, K, V), (B, 2, H, K, V))]

    def grads(backend):
        out = run(backend, d, **kw)
        loss = sum((o * c).sum() for o, c in zip(out, cot))
        return torch.autograd.grad(loss, leaves)

    for i, (r, c) in enumerate(zip(grads("reference"), grads("chunked"))):
        assert torch.isfinite(c).all(), i
        torch.testing.assert_close(c, r, atol=1e-9, rtol=1e-9, msg=lambda m: f"leaf {i}: {m}")


def test_running_in_pieces_equals_running_whole():
    d = rwkv7_inputs(2, 70, 2, 8, 4)
    whole = run("chunked", d)
    first = run("chunked", {n: t[:, :29] for n, t in d.items()})
    second = run("chunked", {n: t[:, 29:] for n, t in d.items()}, initial_state=first.final_state)
    torch.testing.assert_close(torch.cat([first.o, second.o], 1), whole.o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(second.final_state, whole.final_state, atol=1e-12, rtol=1e-12)


def test_chunked_backward_does_not_index_whole_tensors_per_chunk():
    """The chunked path's backward grows linearly with T: the per-chunk loop reads unbound chunks, so autograd stacks
    their gradients once. Indexing a whole (B, H, N, ...) tensor per chunk instead puts one select node per chunk in
    the graph, each of which fills and adds a gradient of the whole tensor (quadratic in T; training tiny-rwkv7 at
    512 filler tokens spent 47% of its backward in those fills)."""
    d = rwkv7_inputs(1, 64, 2, 4, 3)
    for t in d.values():
        t.requires_grad_(True)
    o, S, _ = low_rank_chunked(d["q"], d["k"], d["x"], d["g"], d["a"], d["b"], scale=0.5, chunk_size=4)
    names, seen, todo = [], set(), [(o.sum() + S.sum()).grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        todo.extend(fn for fn, _ in node.next_functions)
    assert names.count("SelectBackward0") < 64 // 4, names.count("SelectBackward0")   # fewer than one per chunk


@pytest.mark.parametrize("per_head", [False, True], ids=["per_channel", "per_head"])
@pytest.mark.parametrize("log_w_min", [-0.6065306597126334, -1e4], ids=["rwkv7_range", "to_-1e4"])
def test_each_decay_range_takes_its_route_and_both_routes_agree(log_w_min, per_head, monkeypatch):
    """RWKV-7's decays (a chunk of 32 spans at most 19.4 nats) take the lifted route, decays past e^-60 within a chunk
    the segment-sum route; on the same inputs, where both can run, the two agree with every patch to float64
    rounding."""
    from recurscope.kernels import low_rank

    B, T, H, K, V = 1, 75, 2, 8, 6
    d = rwkv7_inputs(B, T, H, K, V, log_w_min=log_w_min, per_head=per_head)
    kw = patches(B, T, H, K, V, torch.float64)
    calls = []
    real = low_rank._low_rank_segments
    monkeypatch.setattr(low_rank, "_low_rank_segments", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = run("chunked", d, **kw)
    assert bool(calls) == (log_w_min < -1.0)
    if calls:
        return
    seg = real(d["q"], d["k"], d["x"], d["g"], d["a"], d["b"], scale=K ** -0.5, dtype=torch.float64, chunk_size=4,
               **kw)
    for name, r, c in zip(("o", "final_state", "states"), seg, got):
        torch.testing.assert_close(c, r, atol=1e-11, rtol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("chunk_size", [4, 16, 48, 64])
def test_lifted_route_at_every_chunk_size_matches_reference(chunk_size):
    """Chunks that halve down to 16 take the blocked inverse, others (48 -> 24 -> 12) too; 4 solves directly."""
    B, T, H, K, V = 1, 100, 2, 8, 6
    d = rwkv7_inputs(B, T, H, K, V)
    kw = patches(B, T, H, K, V, torch.float64)
    ref = run("reference", d, **kw)
    got = run("chunked", d, chunk_size=chunk_size, **kw)
    for name, r, c in zip(("o", "final_state", "states"), ref, got):
        torch.testing.assert_close(c, r, atol=1e-10, rtol=1e-10, msg=lambda m: f"{name}: {m}")


def test_lifted_route_float32_at_rwkv7_length_stays_near_float64():
    """T = 1024 (32 chunks of 32) in float32 against the float64 step loop: the running-product decay factors keep
    fla's error ratio well under its bound."""
    B, T, H, K, V = 1, 1024, 2, 32, 32
    d64 = rwkv7_inputs(B, T, H, K, V)
    ref = run("reference", d64)
    got = run("chunked", {n: t.float() for n, t in d64.items()})
    for name, r, c in zip(("o", "final_state"), ref, got):
        err = ((c.double() - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item()
        assert err < 1e-6, (name, err)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_size_does_not_change_the_result(chunk_size):
    d = rwkv7_inputs(1, 70, 1, 8, 4, log_w_min=-1e4)
    base = run("reference", d)
    got = low_rank_chunked(d["q"], d["k"], d["x"], d["g"], d["a"], d["b"], scale=8 ** -0.5, dtype=torch.float64,
                           chunk_size=chunk_size)
    torch.testing.assert_close(got[0], base.o, atol=1e-10, rtol=1e-10)


# --- fla's RWKV-7 (DPLR) naive functions -------------------------------------------------------------------------

def _head_first(t):
    return t.transpose(1, 2).contiguous()


@pytest.mark.parametrize("log_w_min", [-0.6065306597126334, -20.0, -1e4], ids=["rwkv7_range", "to_-20", "to_-1e4"])
@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_against_fla_dplr_recurrence(log_w_min, backend):
    """fla's dplr_recurrence in float32 against ours; RWKV-7's sign convention: fla a = -kk, b = kk * iclr."""
    B, T, H, K, V = 2, 96, 2, 16, 8
    d = rwkv7_inputs(B, T, H, K, V, log_w_min=log_w_min, dtype=torch.float32)
    S0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(3))
    hf = _head_first
    o_fla, S_fla = fla_dplr.dplr_recurrence(hf(d["q"]), hf(d["k"]), hf(d["x"]), hf(-d["a"]), hf(d["b"]), hf(d["g"]),
                                            initial_state=S0, output_final_state=True)
    if backend == "reference":
        d = {n: t.double() for n, t in d.items()}
        S0 = S0.double()
    ours = run(backend, d, initial_state=S0)
    fla_testing.assert_close("o", hf(o_fla).double(), ours.o.double(), FLA_RATIO)
    fla_testing.assert_close("ht", S_fla.double(), ours.final_state.double(), FLA_RATIO)


@pytest.mark.parametrize("log_w_min", [-0.6065306597126334, -1e4], ids=["rwkv7_range", "to_-1e4"])
def test_against_fla_dplr_chunkwise(log_w_min):
    """fla's chunked naive form (chunk 32) against our float64 reference and our float32 chunked path."""
    B, T, H, K, V = 1, 64, 2, 16, 8
    d = rwkv7_inputs(B, T, H, K, V, log_w_min=log_w_min, dtype=torch.float32)
    hf = _head_first
    o_fla, S_fla = fla_dplr.dplr_chunkwise(hf(d["q"]), hf(d["k"]), hf(d["x"]), hf(-d["a"]), hf(d["b"]), hf(d["g"]),
                                           output_final_state=True, chunk_size=32)
    ref = run("reference", {n: t.double() for n, t in d.items()})
    chk = run("chunked", d)
    for ours in (ref, chk):
        fla_testing.assert_close("o", hf(o_fla).double(), ours.o.double(), FLA_RATIO)
        fla_testing.assert_close("ht", S_fla.double(), ours.final_state.double(), FLA_RATIO)


@pytest.mark.parametrize("per_head", [False, True], ids=["per_channel", "per_head"])
@pytest.mark.parametrize("features", [False, True], ids=["plain", "all_patches"])
def test_triton_forward_in_the_interpreter_matches_reference(per_head, features):
    """The fused Triton forward (kernels.low_rank_triton) in Triton's interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1), on tiny shapes with a V tile split (K = 8 keeps BV = V) and log w down to -1e4."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    B, T, H, K, V = 2, 19, 2, 8, 6
    d64 = rwkv7_inputs(B, T, H, K, V, log_w_min=-1e4, per_head=per_head)
    kw64 = patches(B, T, H, K, V, torch.float64) if features else {}
    if features:
        kw64["capture"] = [0, 7, 18]
    d32 = {n: t.float() for n, t in d64.items()}
    kw32 = {n: (tuple(x.float() for x in v) if isinstance(v, tuple) else v.float() if torch.is_tensor(v) else v)
            for n, v in kw64.items()}
    ref = run("reference", d64, **kw64)
    got = run("triton", d32, **kw32)
    for name, r, c in zip(("o", "final_state", "states"), ref, got):
        if r is None:
            assert c is None, name
            continue
        torch.testing.assert_close(c.double(), r, atol=2e-5, rtol=2e-5, msg=lambda m: f"{name}: {m}")


def test_bad_input_names_the_problem():
    d = rwkv7_inputs(1, 8, 1, 4, 4)
    with pytest.raises(ValueError, match="b must have shape"):
        kernels.recurrence_low_rank(d["q"], d["k"], d["x"], d["g"], d["a"], d["b"][..., :3])
    with pytest.raises(ValueError, match="needs both a"):
        kernels.recurrence_low_rank(d["q"], d["k"], d["x"], d["g"], d["a"], None)
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.recurrence_low_rank(d["q"], d["k"], d["x"], d["g"], d["a"], d["b"], backend="fla")
