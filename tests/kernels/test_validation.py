"""Bad input to kernels.recurrence raises ValueError naming the tensor and what was expected."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from recurscope import kernels
from recurscope.kernels._validate import _check_finite

B, T, H, K, V = 2, 5, 3, 4, 6


def good(**over):
    base = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), x=torch.randn(B, T, H, V),
                g=-torch.rand(B, T, H), a=torch.randn(B, T, H, K))
    base.update(over)
    return base


def call(backend="chunked", **kw):
    t = good(**{n: kw.pop(n) for n in list(kw) if n in ("q", "k", "x", "g", "a")})
    return kernels.recurrence(t["q"], t["k"], t["x"], t["g"], t["a"], backend=backend, **kw)


def test_good_input_runs():
    out = call()
    assert out.o.shape == (B, T, H, V) and out.final_state.shape == (B, H, K, V)


@pytest.mark.parametrize("name, tensor, expect", [
    ("k", torch.randn(B, T, H, K + 1), r"k must have shape \(B, T, H_k, K\).*\(2, 5, 3, 4\).*got \(2, 5, 3, 5\)"),
    ("x", torch.randn(B, T + 1, H, V), r"x must have shape \(B, T, H, V\) = \(2, 5, H, V\), got \(2, 6, 3, 6\)"),
    ("x", torch.randn(B, T, H + 1, V), r"x has H = 4 value heads, not a multiple of q and k's H_k = 3"),
    ("a", torch.randn(B, T, H, K - 1), r"a must have shape \(B, T, H, K\) = \(2, 5, 3, 4\), got \(2, 5, 3, 3\)"),
    ("g", torch.randn(B, T, H + 1), r"g must have shape \(B, T, H\).*\(2, 5, 3\), got \(2, 5, 4\)"),
    ("g", torch.randn(B, T, H, K + 2), r"g must have shape \(B, T, H, K\).*\(2, 5, 3, 4\), got \(2, 5, 3, 6\)"),
    ("q", torch.randn(B, T, K), r"q must have shape \(B, T, H_k, K\), got \(2, 5, 4\)"),
])
def test_mismatched_shapes(name, tensor, expect):
    with pytest.raises(ValueError, match=expect):
        call(**{name: tensor})


@pytest.mark.parametrize("g", [torch.randn(B, T), torch.randn(B, T, H, K, 1)])
def test_g_of_wrong_rank(g):
    with pytest.raises(ValueError, match=rf"g must have rank 3 \(B, T, H\) or rank 4 \(B, T, H, K\), got rank {g.dim()}"):
        call(g=g)


@pytest.mark.parametrize("name", ["q", "k", "x", "g", "a"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(name, bad):
    t = good()[name].clone()
    t.view(-1)[3] = bad
    if name == "g" and bad < 0:                           # a hard reset: the state before it is forgotten
        assert torch.isfinite(call(g=t).o).all()
        return
    what = r"NaN or \+inf; -inf, a hard reset, is allowed" if name == "g" else "NaN or inf"
    with pytest.raises(ValueError, match=rf"^{name} contains 1 non-finite value\(s\) \({what}\)"):
        call(**{name: t})


def test_finite_values_whose_sum_overflows_pass_the_cheap_check():
    """The finiteness check sums first; an overflowing sum of finite values must fall through to the exact check and
    pass, in float32 and float16."""
    for dtype in (torch.float32, torch.float16):
        big = torch.full((B, T, H, V), torch.finfo(dtype).max / 2, dtype=dtype)
        assert not torch.isfinite(big.sum())
        _check_finite("x", big)                           # no error
        big.view(-1)[7] = float("nan")
        with pytest.raises(ValueError, match=r"^x contains 1 non-finite value\(s\)"):
            _check_finite("x", big)
    out = call(x=torch.full((B, T, H, V), 3e38 / (T * V)), g=torch.zeros(B, T, H))
    assert out.o.shape == (B, T, H, V)


def test_non_finite_patch_inputs():
    state = torch.randn(B, H, K, V)
    state[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"initial_state contains 1 non-finite"):
        call(initial_state=state)
    ws = torch.ones(B, T, H)
    ws[1, 1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"write_scale contains 1 non-finite"):
        call(write_scale=ws)
    y = torch.randn(B, T, H, V)
    y[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"extra_write\[1\] \(y\) contains 1 non-finite"):
        call(extra_write=(torch.randn(B, T, H, K), y))


def test_patch_input_shapes():
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, K, V\) = \(2, 3, 4, 6\), got \(2, 3, 6, 4\)"):
        call(initial_state=torch.randn(B, H, V, K))
    with pytest.raises(ValueError, match=r"write_scale must have shape \(B, T, H\) = \(2, 5, 3\), got \(2, 5, 3, 1\)"):
        call(write_scale=torch.ones(B, T, H, 1))
    with pytest.raises(ValueError, match=r"extra_write\[0\] \(u\) must have shape \(B, T, H, K\)"):
        call(extra_write=(torch.randn(B, T, H, V), torch.randn(B, T, H, V)))
    with pytest.raises(ValueError, match=r"extra_write must be a pair \(u, y\)"):
        call(extra_write=torch.randn(B, T, H, K))


def test_capture_positions():
    with pytest.raises(ValueError, match=r"capture positions must lie in \[0, 4\], got \[0, 5\]"):
        call(capture=[0, 5])
    with pytest.raises(ValueError, match=r"capture must be a sorted list of distinct positions, got \[3, 1\]"):
        call(capture=[3, 1])


@pytest.mark.parametrize("backend", ["cuda", "Chunked", ""])
def test_unknown_backend(backend):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', 'chunked', 'triton', 'fla'\), got"):
        call(backend=backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("name", ["q", "x", "g"])
def test_integer_dtype(name, dtype):
    t = good()[name].to(dtype)
    with pytest.raises(ValueError, match=rf"^{name} must be a floating tensor \(float16/bfloat16/float32/float64\), got dtype {dtype}"):
        call(**{name: t})


def test_non_tensor_input():
    with pytest.raises(ValueError, match=r"x must be a torch.Tensor, got list"):
        call(x=[[1.0]])


@pytest.mark.slow
def test_triton_on_cpu_without_interpreter_subprocess():
    """tests/conftest.py sets TRITON_INTERPRET=1, so the plain-CPU case runs in a clean subprocess."""
    code = (
        "import torch\nfrom recurscope import kernels\n"
        "q = torch.randn(1, 3, 1, 4)\n"
        "try:\n"
        "    kernels.recurrence(q, q, torch.randn(1, 3, 1, 2), torch.zeros(1, 3, 1), backend='triton')\n"
        "except ValueError as e:\n"
        "    print('VALUEERROR:', e)\n"
        "else:\n"
        "    print('NO ERROR')\n"
    )
    env = {n: v for n, v in os.environ.items() if n not in ("TRITON_INTERPRET", "RECURSCOPE_BACKEND")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "VALUEERROR: backend 'triton' needs CUDA tensors, or TRITON_INTERPRET=1" in res.stdout, res.stdout
    assert "use backend='chunked' on a CPU" in res.stdout


def test_bad_environment_backend(monkeypatch):
    monkeypatch.setenv("RECURSCOPE_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"RECURSCOPE_BACKEND must be one of .* got 'fast'"):
        call(backend="auto")
