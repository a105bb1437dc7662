"""Hard resets and strong decays: the float32 chunked path stays within 1e-6 (relative, fla's error ratio) of the
float64 recurrence for log decays down to -1e4 and -inf at random positions (issue 30, item 3). Before the decay
sums were taken in float64 past PRECISE_SPAN, a reset of -1000 cost 5e-5: each in-chunk partial sum after it was
rounded at the magnitude 1000."""
from __future__ import annotations

import pytest
import torch

from recurscope import kernels
from recurscope.kernels.inputs import family_inputs


def err_ratio(mine, ref):
    """fla's tolerance measure (tests' get_err_ratio): rms of the difference over rms of the reference."""
    return float((mine.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-300))


@pytest.mark.parametrize("reset", [-30.0, -100.0, -1000.0, -1e4, float("-inf")])
@pytest.mark.parametrize("family", ["gla", "gdn", "kda", "gdn2", "qed"])
@pytest.mark.parametrize("grad", [False, True], ids=["no graph", "autograd"])
def test_float32_within_1e6_of_float64_under_hard_resets(family, reset, grad):
    B, T, H, K, V = 2, 300, 2, 16, 8
    inp = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=7, decay=(0.0, 0.1))
    g = inp.g.clone()
    gen = torch.Generator().manual_seed(int(abs(reset)) % 1000 if reset > -1e30 else 1)
    where = torch.rand(g.shape[:3], generator=gen) < 0.05              # resets at random steps, rows and heads
    if g.dim() == 4:                                                    # per channel: some channels only
        where = where[..., None] & (torch.rand(g.shape, generator=gen) < 0.5)
    g[where] = reset
    init = torch.randn(B, H, K, V, generator=gen)
    capture = [0, 31, 32, 150, T - 1]
    leaves = [t.clone().requires_grad_(grad) for t in (inp.q, inp.k, inp.x)]
    out = kernels.recurrence(*leaves, g, inp.a, initial_state=init, capture=capture, backend="chunked")
    up = lambda t: None if t is None else t.double()  # noqa: E731
    ref = kernels.recurrence(*map(up, (inp.q, inp.k, inp.x, g, inp.a)), initial_state=init.double(), capture=capture,
                             backend="reference")
    for name, mine, theirs in zip(("o", "final_state", "states"), out, ref):
        assert torch.isfinite(mine).all(), name
        assert err_ratio(mine.detach(), theirs) < 1e-6, f"{name}: {err_ratio(mine.detach(), theirs):.2e}"
    if grad:
        grads = torch.autograd.grad(out.o.sum() + out.final_state.sum(), leaves)
        assert all(torch.isfinite(d).all() for d in grads)


def test_moderate_decays_stay_on_the_float32_sums_and_within_1e6():
    """Ordinary decays (a chunk spanning under PRECISE_SPAN nats) keep the fast float32 sums and their precision."""
    from recurscope.kernels import chunked

    for family, per_step in (("gdn", 0.2), ("gdn2", 0.2), ("gla", 0.1)):
        inp = family_inputs(family, 1, 256, 2, 16, 8, dtype=torch.float32, seed=2, decay=(0.0, per_step))
        C = chunked.default_chunk_size(inp.a is not None)
        G, base2, span = chunked._decay_sums(inp.g, 1, 256, 2, 256 // C, C, torch.float32, False, None)
        assert G.dtype == torch.float32 and span <= chunked.PRECISE_SPAN, family
        out = kernels.recurrence(*inp.args(), backend="chunked")
        ref = kernels.recurrence(*(None if t is None else t.double() for t in inp.args()), backend="reference")
        assert err_ratio(out.o, ref.o) < 1e-6, family


def test_decay_sums_switch_to_float64_past_the_span_and_clamp_resets():
    from recurscope.kernels import chunked

    g = torch.full((1, 64, 1, 4), -0.5)                   # 32 nats over a chunk of 64: past PRECISE_SPAN
    g[0, 10, 0, 1] = float("-inf")
    G, base2, span = chunked._decay_sums(g, 1, 64, 1, 1, 64, torch.float32, False, None)
    assert G.dtype == torch.float64 and not base2
    assert torch.isfinite(G).all() and float(G.min()) >= -chunked.LOG_DECAY_FLOOR - 64
    expect = g.double().clamp(min=-chunked.LOG_DECAY_FLOOR).cumsum(1)[0].transpose(0, 1)
    torch.testing.assert_close(G[0], expect, rtol=0, atol=1e-9)
