"""Gradients through the recurrence's hook points (issue 28.2): with autograd on, hook_state (at the requested
positions), the write hooks and hook_head_out carry the loss's gradient, on the reference and chunked backends, on
a tiny model of every family and on the bridged Qwen3.5. Checked against central finite differences in float64 and
against the write-gradient identity of the recurrence (docs/gradients.md)."""
from __future__ import annotations

import pytest
import torch

from recurscope.hooks import hook_name
from tests.interp.helpers_models import tiny_model

FAMILIES = ("gla", "gdn", "gdn2", "qed", "gdn_hybrid", "qwen35")
BACKENDS = ("reference", "chunked")
T = 10
POSITIONS = [3, 6]
WRITE_POINTS = ("hook_write_key", "hook_write_value", "hook_write_scale")


def _model(family: str, backend: str):
    if family == "qwen35":
        from recurscope.interp.loading import load_model

        model = load_model("tiny-qwen35", dtype=torch.float64)
    else:
        model = tiny_model(family).double()
    model.set_backend(backend)
    return model


def _tokens(model, seed=0):
    return torch.randint(0, model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))


def _loss_fn(model, seed=1):
    weights = torch.randn(2, T, model.cfg.vocab_size, generator=torch.Generator().manual_seed(seed),
                          dtype=torch.float64)
    return lambda logits: (logits.double() * weights).sum()


def _gradients(model, tokens, loss_fn, layer, points, positions=POSITIONS):
    """Gradients at each hook point's output, taken by TransformerLens backward hooks, and the activations."""
    grads, acts = {}, {}
    fwd = [(hook_name(p, layer), lambda t, hook: acts.__setitem__(hook.name, t.detach().clone())) for p in points]
    bwd = [(hook_name(p, layer), lambda g, hook: grads.__setitem__(hook.name, g.detach().clone())) for p in points]
    with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        loss_fn(model(tokens, state_positions=positions)).backward()
    return grads, acts


def _loss_with(model, tokens, loss_fn, name, change, positions=POSITIONS):
    with torch.no_grad(), model.hooks(fwd_hooks=[(name, lambda t, hook: change(t))]):
        return float(loss_fn(model(tokens, state_positions=positions)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hook_gradients_equal_finite_differences_in_float64(family, backend):
    model = _model(family, backend)
    layer = model.recurrent_layers[0]
    tokens, loss_fn = _tokens(model), _loss_fn(model)
    points = ("hook_state", "hook_head_out") + WRITE_POINTS
    grads, acts = _gradients(model, tokens, loss_fn, layer, points)
    assert set(grads) == {hook_name(p, layer) for p in points}, "a backward hook did not fire"
    gen = torch.Generator().manual_seed(2)
    checks = []
    for point in points:
        name = hook_name(point, layer)
        # in the activation's own scale, so that the step is small next to it (the norms after the readout bend
        # sharply at small activations)
        direction = torch.randn(acts[name].shape, generator=gen, dtype=torch.float64)
        direction *= float(acts[name].double().pow(2).mean().sqrt())
        if point == "hook_state":   # one captured position at a time: a patch replaces the state it changes
            for i in range(len(POSITIONS)):
                only = torch.zeros_like(direction)
                only[:, i] = direction[:, i]
                checks.append((f"{name}[{POSITIONS[i]}]", name, only, grads[name]))
        else:
            checks.append((name, name, direction, grads[name]))
    # The native models are float64 throughout. transformers' gated RMSNorm and softmax run in float32 even in a
    # float64 model (their own casts), so the bridged model's differences need a longer step, whose truncation
    # error Richardson's extrapolation removes, and carry float32's rounding.
    step, rel = (5e-2, 3e-4) if family == "qwen35" else (1e-5, 1e-6)
    for label, name, direction, grad in checks:
        def loss_at(eps):
            return _loss_with(model, tokens, loss_fn, name, lambda t: t + eps * direction.to(t.dtype))

        central = lambda h: (loss_at(h) - loss_at(-h)) / (2 * h)  # noqa: E731
        numeric = (4 * central(step / 2) - central(step)) / 3
        analytic = float((grad.double() * direction).sum())
        assert analytic == pytest.approx(numeric, rel=rel, abs=rel * 1e-2), label


def _transition(g_t, k_t, a_t):
    """A_t = (I - k_t a_t^T) Diag(exp g_t) per (batch, head), (B, H, K, K): S_t = A_t S_{t-1} + W_t."""
    K = k_t.shape[-1]
    decay = g_t.exp()
    decay = decay[..., None].expand(*decay.shape, K) if decay.dim() == 2 else decay
    A = torch.diag_embed(decay)
    if a_t is not None:
        A = A - k_t[..., :, None] * (a_t[..., None, :] * decay[..., None, :])
    return A


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_write_gradient_is_the_sum_of_later_captured_state_gradients_carried_back(family, backend):
    """L = sum over captured p of <C_p, S_p>. Since S_p = Phi(p, t) S_t + (terms without W_t) and S_t = A_t S_{t-1}
    + W_t, dL/dW_t = sum_{p >= t captured} Phi(p, t)^T C_p, with Phi(p, t) = A_p ... A_{t+1}; computed here by the
    adjoint recursion M_t = [t captured] C_t + A_{t+1}^T M_{t+1}. With W_t = ws_t u_t x_t^T the write hooks' gradients
    are dL/du_t = ws_t M_t x_t, dL/dx_t = ws_t M_t^T u_t and dL/dws_t = u_t^T M_t x_t."""
    model = _model(family, backend)
    layer = model.recurrent_layers[0]
    tokens = _tokens(model)
    captured = [2, 5, T - 1]
    names = {p: hook_name(p, layer) for p in ("hook_k", "hook_decay", "hook_erase", "hook_state") + WRITE_POINTS}
    acts, grads = {}, {}
    weights = None

    def keep(t, hook):
        acts[hook.name] = t

    fwd = [(n, keep) for p, n in names.items() if n in model.hook_dict]
    bwd = [(names[p], lambda g, hook: grads.__setitem__(hook.name, g.detach())) for p in WRITE_POINTS]
    with model.hooks(fwd_hooks=fwd, bwd_hooks=bwd):
        model(tokens, state_positions=captured)
        states = acts[names["hook_state"]]                     # (B, P, H, K, V), in the graph
        weights = torch.randn(states.shape, generator=torch.Generator().manual_seed(3), dtype=states.dtype)
        (states * weights).sum().backward()
    k, g = acts[names["hook_k"]].detach(), acts[names["hook_decay"]].detach()
    a = acts[names["hook_erase"]].detach() if names["hook_erase"] in acts else None
    u, x = acts[names["hook_write_key"]].detach(), acts[names["hook_write_value"]].detach()
    ws = acts[names["hook_write_scale"]].detach()
    M = torch.zeros_like(states[:, 0].detach())
    expected = {p: [None] * T for p in WRITE_POINTS}
    for t in reversed(range(T)):
        if t < T - 1:
            A_next = _transition(g[:, t + 1], k[:, t + 1], None if a is None else a[:, t + 1]).to(M.dtype)
            M = A_next.transpose(-1, -2) @ M
        if t in captured:
            M = M + weights[:, captured.index(t)]
        w = ws[:, t, :, None].to(M.dtype)
        expected["hook_write_key"][t] = w * (M @ x[:, t, ..., None].to(M.dtype))[..., 0]
        expected["hook_write_value"][t] = w * (M.transpose(-1, -2) @ u[:, t, ..., None].to(M.dtype))[..., 0]
        expected["hook_write_scale"][t] = (u[:, t, ..., None].to(M.dtype) * M * x[:, t, :, None, :]).sum((-1, -2))
    for point in WRITE_POINTS:
        want = torch.stack(expected[point], dim=1)
        got = grads[names[point]].to(want.dtype)
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-10 * float(want.abs().max())), point


@pytest.mark.parametrize("family", ("gdn2", "qwen35"))
def test_with_every_position_captured_the_write_gradient_is_the_state_gradient_at_its_step(family):
    """W_t enters S_t additively, so dL/dW_t = dL/dS_t: dL/dx_t = ws_t (dL/dS_t)^T u_t for any loss."""
    model = _model(family, "chunked")
    layer = model.recurrent_layers[0]
    tokens, loss_fn = _tokens(model), _loss_fn(model)
    points = ("hook_state", "hook_write_value")
    grads, acts = _gradients(model, tokens, loss_fn, layer, points + ("hook_write_key",), positions=list(range(T)))
    dS = grads[hook_name("hook_state", layer)]                                   # (B, T, H, K, V)
    u = acts[hook_name("hook_write_key", layer)].to(dS.dtype)
    want = (dS.transpose(-1, -2) @ u[..., None])[..., 0]
    got = grads[hook_name("hook_write_value", layer)].to(dS.dtype)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-10 * float(want.abs().max()))


@pytest.mark.parametrize("name", ("tiny-gla", "tiny-qwen35"))
def test_state_gradients_reach_retain_grad_and_run_with_cache_incl_bwd(name):
    """The issue's two symptoms: retain_grad on hook_state gave None and a backward hook never fired.
    run_with_cache(..., incl_bwd=True) now returns hook_state_grad, equal to the retained gradient of the same loss."""
    from recurscope.interp.loading import load_model

    model = load_model(name)
    tokens = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(0))
    state = hook_name("hook_state", model.recurrent_layers[0])
    kept = {}

    def retain(t, hook):
        t.retain_grad()
        kept["state"] = t

    with model.hooks(fwd_hooks=[(state, retain)]):
        model(tokens, state_positions=[4, 9], return_type="loss").backward()
    assert kept["state"].grad is not None and kept["state"].grad.abs().sum() > 0
    model.zero_grad()
    _, cache = model.run_with_cache(tokens, state_positions=[4, 9], return_type="loss", incl_bwd=True,
                                    names_filter=lambda n: n == state)
    assert torch.allclose(cache[state + "_grad"], kept["state"].grad, rtol=1e-5, atol=1e-6)
