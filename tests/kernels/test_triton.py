"""The Triton recurrent kernel against the step-loop reference, for every model family and patch feature.

On a CPU this runs in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with
TRITON_INTERPRET=0 on a CUDA machine the same tests run the compiled kernel.
"""
import os

import pytest
import torch

from recurscope import kernels
from recurscope.kernels.inputs import FAMILIES, family_inputs
from recurscope.kernels.reference import recurrence_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py) or a CUDA device", allow_module_level=True)

from recurscope.kernels import triton_recurrent  # (after the interpreter switch is known)
from recurscope.kernels.triton_recurrent import recurrence_triton, tile_config

FEATURES = ("none", "write_scale", "extra_write", "capture", "initial_state", "all")


def feature_kwargs(features, B, T, H, K, V, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype=dtype, device=DEVICE)  # noqa: E731
    on = lambda name: features in (name, "all")  # noqa: E731
    kw = {}
    if on("write_scale"):
        ws = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
        ws[:, T // 2] = 0.0  # a blocked write
        kw["write_scale"] = ws.to(dtype=dtype, device=DEVICE)
    if on("extra_write"):
        kw["extra_write"] = (0.3 * rnd(B, T, H, K), rnd(B, T, H, V))
    if on("capture"):
        kw["capture"] = sorted({0, T // 2, T - 1})
    if on("initial_state"):
        kw["initial_state"] = rnd(B, H, K, V)
    return kw


def reference(q, k, x, g, a, scale, **kw):
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return recurrence_reference(q, k, x, g, a, scale=scale, dtype=dtype, **kw)


def assert_matches(got, want, atol=1e-5, rtol=1e-5, o_tol=None):
    o, S, states = got
    o_ref, S_ref, states_ref = want
    assert S.dtype == torch.float32
    o_atol, o_rtol = o_tol or (atol, rtol)
    torch.testing.assert_close(o.double(), o_ref.double(), atol=o_atol, rtol=o_rtol)
    torch.testing.assert_close(S.double(), S_ref.double(), atol=atol, rtol=rtol)
    if states_ref is None:
        assert states is None
    else:
        assert states.dtype == torch.float32 and states.shape == states_ref.shape
        torch.testing.assert_close(states.double(), states_ref.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_and_feature_match_reference_float64(family, features):
    """float64 inputs (reference in float64, kernel in float32 registers): agreement to float32 precision."""
    B, T, H, K, V = 2, 7, 2, 6, 5  # non power-of-two K and V, T not a multiple of anything useful
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, dtype=torch.float64, device=DEVICE).args()
    kw = feature_kwargs(features, B, T, H, K, V, torch.float64)
    got = recurrence_triton(q, k, x, g, a, scale=K ** -0.5, **kw)
    assert got[0].dtype == torch.float64
    assert_matches(got, reference(q, k, x, g, a, K ** -0.5, **kw))


@pytest.mark.parametrize("features", ("none", "all"))
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_reference_float32(family, features):
    B, T, H, K, V = 1, 5, 2, 8, 4
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=3, device=DEVICE).args()
    kw = feature_kwargs(features, B, T, H, K, V, torch.float32, seed=4)
    got = recurrence_triton(q, k, x, g, a, scale=0.37, **kw)
    assert_matches(got, reference(q, k, x, g, a, 0.37, **kw))


@pytest.mark.parametrize("family", ("gla", "qed"))
def test_single_step_captured(family):
    B, T, H, K, V = 2, 1, 1, 5, 3
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, dtype=torch.float64, seed=5, device=DEVICE).args()
    kw = feature_kwargs("all", B, T, H, K, V, torch.float64, seed=6)
    assert kw["capture"] == [0]
    got = recurrence_triton(q, k, x, g, a, scale=1.0, **kw)
    assert_matches(got, reference(q, k, x, g, a, 1.0, **kw))
    torch.testing.assert_close(got[2][:, 0], got[1])  # the one captured state is the final state


def test_capture_every_position_and_first_last():
    B, T, H, K, V = 1, 6, 2, 4, 4
    q, k, x, g, a = family_inputs("kda", B, T, H, K, V, dtype=torch.float64, seed=7, device=DEVICE).args()
    for capture in ([0, T - 1], list(range(T))):
        got = recurrence_triton(q, k, x, g, a, scale=0.5, capture=capture)
        assert got[2].shape == (B, len(capture), H, K, V)
        assert_matches(got, reference(q, k, x, g, a, 0.5, capture=capture))
        torch.testing.assert_close(got[2][:, -1], got[1])


def test_several_v_tiles_with_masked_edges():
    """K = 100 gives BK = 128 and BV = 16, so V = 20 spans two V tiles, the second one mostly masked."""
    B, T, H, K, V = 1, 3, 1, 100, 20
    BK, BV, _ = tile_config(K, V)
    assert (BK, BV) == (128, 16) and V > BV
    q, k, x, g, a = family_inputs("gdn2", B, T, H, K, V, dtype=torch.float64, seed=8, device=DEVICE).args()
    kw = feature_kwargs("all", B, T, H, K, V, torch.float64, seed=9)
    got = recurrence_triton(q, k, x, g, a, scale=K ** -0.5, **kw)
    assert_matches(got, reference(q, k, x, g, a, K ** -0.5, **kw))


@pytest.mark.parametrize("family", ("gdn", "qed"))
def test_bf16_inputs(family):
    """bf16 in, fp32 state: the state matches the reference run on the same bf16 values; o is rounded to bf16."""
    B, T, H, K, V = 1, 5, 2, 8, 6
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, dtype=torch.bfloat16, seed=10, device=DEVICE).args()
    kw = feature_kwargs("all", B, T, H, K, V, torch.bfloat16, seed=11)
    got = recurrence_triton(q, k, x, g, a, scale=K ** -0.5, **kw)
    assert got[0].dtype == torch.bfloat16
    want = reference(q, k, x, g, a, K ** -0.5, **kw)  # its o stays float32
    # o: the fp32 value stored as bf16 is within one bf16 ulp (2**-7 relative). One ulp, not half: the
    # interpreter truncates fp32 -> bf16 where the GPU rounds to nearest.
    assert_matches(got, want, o_tol=(1e-5, 2 ** -7))


def test_output_final_state_off_returns_none():
    B, T, H, K, V = 1, 3, 1, 4, 4
    q, k, x, g, a = family_inputs("gdn", B, T, H, K, V, dtype=torch.float32, seed=12, device=DEVICE).args()
    o, S, states = recurrence_triton(q, k, x, g, a, scale=0.5, output_final_state=False)
    assert S is None and states is None
    torch.testing.assert_close(o, reference(q, k, x, g, a, 0.5)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gla", "gdn", "qed"])
def test_backward_equals_the_reference_gradients(family):
    """The triton backend's backward (the chunked form recomputed under autograd) gives every input's gradient,
    captures and final state included, as the float64 reference does."""
    B, T, H, K, V = 1, 37, 2, 4, 3
    inp = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=13, device=DEVICE)
    kw = feature_kwargs("all", B, T, H, K, V, torch.float32, seed=16)
    leaves = {"q": inp.q, "k": inp.k, "x": inp.x, "g": inp.g, "a": inp.a, "ws": kw["write_scale"],
              "u": kw["extra_write"][0], "y": kw["extra_write"][1], "S0": kw["initial_state"]}
    leaves = {n: t for n, t in leaves.items() if t is not None}
    def grads(backend, dtype):
        p = {n: t.detach().to(dtype).requires_grad_() for n, t in leaves.items()}
        out = kernels.recurrence(p["q"], p["k"], p["x"], p["g"], p.get("a"), write_scale=p["ws"],
                                 extra_write=(p["u"], p["y"]), initial_state=p["S0"], capture=kw["capture"],
                                 backend=backend)
        w = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=torch.float64).to(dtype)
             for i, t in enumerate(out)]
        loss = sum((t * wt).sum() for t, wt in zip(out, w))
        return dict(zip(p, torch.autograd.grad(loss, list(p.values()))))

    mine, ref = grads("triton", torch.float32), grads("reference", torch.float64)
    for name in ref:
        scale = ref[name].abs().max() + 1e-12
        err = float((mine[name].double() - ref[name]).abs().max() / scale)
        assert err < 1e-4, f"d/d{name}: {err:.1e}"


def test_public_recurrence_dispatches_to_triton(monkeypatch):
    B, T, H, K, V = 1, 4, 2, 6, 3
    q, k, x, g, a = family_inputs("qed", B, T, H, K, V, dtype=torch.float32, seed=14, device=DEVICE).args()
    kw = feature_kwargs("all", B, T, H, K, V, torch.float32, seed=15)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return recurrence_triton(*args, **kwargs)

    monkeypatch.setattr(triton_recurrent, "recurrence_triton", spy)
    out = kernels.recurrence(q, k, x, g, a, backend="triton", **kw)
    assert len(calls) == 1 and calls[0]["capture"] == kw["capture"]
    ref = kernels.recurrence(q, k, x, g, a, backend="reference", **kw)
    assert_matches(tuple(out), tuple(ref))
    no_final = kernels.recurrence(q, k, x, g, a, backend="triton", output_final_state=False)
    assert no_final.final_state is None


@pytest.mark.parametrize("K,V", [(1, 1), (5, 3), (64, 64), (100, 20), (128, 128), (256, 256), (256, 7), (512, 64)])
def test_tile_rule(K, V):
    BK, BV, num_warps = tile_config(K, V)
    assert BK >= K and BK & (BK - 1) == 0 and BV & (BV - 1) == 0
    assert BV <= triton_recurrent.triton.next_power_of_2(V)
    assert BK * BV <= triton_recurrent.MAX_TILE_ELEMENTS or BV == 1
    assert 1 <= num_warps <= 4
    # no more than STATE_ENTRIES_PER_THREAD fp32 state values per thread
    assert BK * BV <= num_warps * 32 * triton_recurrent.STATE_ENTRIES_PER_THREAD or num_warps == 4
