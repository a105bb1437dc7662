"""Gradients through the fla chunk path's captures (issue 28.2): the states it returns at the capture positions
(segments split there, each starting from the last one's final state) carry the same gradient as the float64
reference's, for the inputs and the initial state. fla's kernels run in Triton's interpreter on a CPU (conftest)."""
from __future__ import annotations

import os

import pytest
import torch

from recurscope import kernels
from tests.kernels.test_fla_chunk import make, to32

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("fla_interpreter")]

fla_chunk = pytest.importorskip("recurscope.kernels.fla_chunk")
if not fla_chunk.fla_available():
    pytest.skip("fla is not importable", allow_module_level=True)


@pytest.mark.parametrize("family", ["gla", "gdn"])
def test_capture_gradients_on_the_fla_path_equal_the_reference(family):
    (q, k, x, g, a), feats = make(family, T=13)
    capture = [4, 9]
    weights = torch.randn(1, len(capture), 2, 8, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def grads(backend, cast):
        leaves = [cast(t).detach().requires_grad_(True) for t in (q, x, g, feats["initial_state"])]
        out = kernels.recurrence(leaves[0], cast(k), leaves[1], leaves[2], None if a is None else cast(a),
                                 initial_state=leaves[3], capture=capture, backend=backend)
        loss = (out.states.double() * weights.to(out.states.device)).sum() + out.o.double().sum()
        return [t.detach().double().cpu() for t in torch.autograd.grad(loss, leaves)]

    assert fla_chunk.fallback_reason(*(to32(t) for t in (q, k, x, g)), None if a is None else to32(a)) is None
    ref = grads("reference", lambda t: t)
    fla = grads("fla", to32)
    for name, want, got in zip(("q", "x", "g", "initial_state"), ref, fla):
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max())), name
