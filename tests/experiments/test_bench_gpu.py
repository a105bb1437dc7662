"""experiments/bench/gpu.py end to end on tiny shapes, so that the first lent GPU does not stop on a mistake in the
script: on a CPU fla's and our Triton kernels run in Triton's interpreter (conftest's `fla_interpreter`), on a GPU
natively. The timings of such a run mean nothing; what is checked is that every contender runs, the patched
calls take the fla path they claim, and every target gets its verdict."""
from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("fla_interpreter")]
pytest.importorskip("fla.ops.gla")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(B=1, T=24, H=2, K=16, V=16, dtype=torch.float32)


def load_bench(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "experiments", "bench",
                                                                               f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # end to end
def test_gpu_bench_runs_every_contender_and_gives_every_verdict(capsys):
    gpu = load_bench("gpu")
    # the scan bench's GLA-340M shape, shrunk to two layers of two heads
    tiny_gla = dict(load_bench("scan").SHAPES["gla"], hidden_size=32, num_hidden_layers=2, num_heads=2,
                    hidden_ratio=2, gate_low_rank_dim=4)
    device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
                          else "cpu")
    verdicts = gpu.recurrence_benches(1, device, TINY) + gpu.scan_bench(1, device, tiny_gla, 307)
    varlen = gpu.varlen_gva_benches(1, device, dict(TINY, B=2))
    out = capsys.readouterr().out
    for fam in ("GLA", "GDN"):
        # write_scale, captures and extra writes are expressible on fla's kernels for both families: no fallback
        assert f"{fam} patches off: fla chunk kernels" in out and f"{fam} patches on: fla chunk kernels" in out
        assert f"{fam}: our Triton kernel vs fla's fused recurrent" in out
    # per family: patched off, patched on, Triton against fused recurrent; then the scan
    assert len(verdicts) == 7, verdicts
    # grouped value heads (fla path, triton) and packed sequences (fla, triton) against today's copies and padding
    assert "GVA: fla chunk kernels" in out and len(varlen) == 4, varlen
    assert any("varlen fla" in v for v in varlen) and any("varlen triton" in v for v in varlen)
    assert all(re.search(r"\(target <= [0-9.]+x.*\) (met|MISSED)$", v) for v in verdicts + varlen), verdicts
    assert "-head scan vs one clean + one donor forward" in out
