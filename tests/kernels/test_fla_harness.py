"""fla-style cases on kernels.recurrence (issue 30): packed variable-length batches with empty sequences, grouped
value heads, fla's in-kernel options (q/k L2 norm, the A_log/dt_bias gate, the beta sigmoid), head dimensions up to
512, lengths from 1 to 8192, fp16/bf16/fp32 inputs, against fla's own naive recurrent functions (an independent
step loop, run per sequence on float32 copies of the same inputs, the options applied outside), with fla's tolerance
rule: pass when the largest absolute error is at most 1e-6, else the error ratio rms(diff) / rms(ref) must stay under
the ratio (fla's op tests use 0.002-0.005 for half precision). The grid's large shapes are marked slow."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from recurscope import kernels

with warnings.catch_warnings():
    warnings.simplefilter("ignore")                      # fla warns that Triton has no GPU here
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    fla_kda = pytest.importorskip("fla.ops.kda.naive")

RATIO = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def fla_assert_close(name, ref, mine, ratio, err_atol=1e-6):
    diff = (ref.double() - mine.double())
    if float(diff.abs().max()) <= err_atol:
        return
    err = float(diff.pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt().clamp_min(1e-12))
    assert err < ratio, f"{name}: error ratio {err:.2e} >= {ratio:.0e}"


def case(family, lengths, Hk, groups, D, dtype, gate, resets=False, slow=False):
    tag = f"{family}-L{'+'.join(map(str, lengths)) if len(lengths) < 6 else f'{len(lengths)}seqs'}-Hk{Hk}x{groups}" \
          f"-D{D}-{str(dtype)[6:]}{'-gate' if gate else ''}{'-resets' if resets else ''}"
    return pytest.param(family, lengths, Hk, groups, D, dtype, gate, resets, id=tag,
                        marks=[pytest.mark.slow] if slow else [])


CASES = [
    # quick grid: varlen with empty sequences, grouped heads, the options, every dtype, short and ragged lengths
    case("gdn", [1], 1, 1, 16, torch.float32, False),
    case("gdn", [0, 15, 0, 64, 100], 2, 2, 32, torch.float32, True),
    case("kda", [0, 15, 0, 64, 100], 2, 2, 32, torch.float32, True),
    case("gdn", [63, 1, 0, 130], 1, 4, 64, torch.float16, True),
    case("kda", [63, 1, 0, 130], 1, 4, 64, torch.bfloat16, True),
    case("gdn", [200], 2, 1, 16, torch.bfloat16, False, resets=True),
    case("kda", [7, 200], 2, 2, 16, torch.float32, False, resets=True),
    case("gdn", [3, 5, 8, 13, 21, 34, 55], 1, 2, 16, torch.float16, True),
    # slow: long sequences and large heads
    case("gdn", [2048], 1, 2, 128, torch.float32, True, slow=True),
    case("kda", [100, 0, 1948], 2, 2, 128, torch.bfloat16, True, slow=True),
    case("gdn", [8192], 1, 1, 64, torch.float16, True, slow=True),
    case("gdn", [300, 0, 212], 1, 2, 256, torch.float32, True, slow=True),
    case("kda", [64, 200], 1, 1, 512, torch.float32, True, slow=True),
    case("gdn", [130], 1, 2, 512, torch.bfloat16, False, slow=True),
]


@pytest.mark.parametrize("family, lengths, Hk, groups, D, dtype, gate, resets", CASES)
def test_fla_style_case_against_fla_naive(family, lengths, Hk, groups, D, dtype, gate, resets):
    H = Hk * groups
    T = sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(T + D + H)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(1, T, Hk, D).to(dtype), rnd(1, T, Hk, D).to(dtype), rnd(1, T, H, D).to(dtype)
    per = (1, T, H, D) if family == "kda" else (1, T, H)
    b_raw = rnd(1, T, H)
    h0 = (0.5 * rnd(len(lengths), H, D, D)).to(dtype)
    if gate:
        g_in, A_log, dt_bias = rnd(*per), rnd(H) * 0.5, rnd(H * D if family == "kda" else H)
        g = -A_log.exp()[(...,) + ((None,) if family == "kda" else ())] * F.softplus(
            g_in + dt_bias.view(*per[2:]))
    else:
        g_in = g = -0.1 * torch.rand(*per, generator=gen)
        A_log = dt_bias = None
    if resets:                                            # fla's varlen tests write -1000 at masked positions
        where = torch.rand(per[:3], generator=gen) < 0.05
        g_in = g = g.masked_fill(where[..., None] if family == "kda" else where, -1000.0)
    out = kernels.recurrence(q, k, v, g_in, beta=b_raw, use_beta_sigmoid=True, use_qk_l2norm=True, A_log=A_log,
                             dt_bias=dt_bias, cu_seqlens=cu, initial_state=h0, backend="chunked")
    # the peer: fla's naive recurrent step loop, one sequence at a time, on float32 copies with the options outside
    l2 = lambda t: t.float() * torch.rsqrt(t.float().pow(2).sum(-1, keepdim=True) + 1e-6)  # noqa: E731  fla's l2norm
    qn, kn = l2(q), l2(k)
    beta = b_raw.sigmoid()
    o_ref, S_ref = [], []
    for i, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        if hi == lo:
            S_ref.append(h0[i].float())
            continue
        s = slice(lo, hi)
        if family == "kda":                                # fla's KDA takes grouped heads itself
            o_i, S_i = fla_kda.naive_recurrent_kda(qn[:, s], kn[:, s], v[:, s].float(), g[:, s], beta[:, s],
                                                   initial_state=h0[i:i + 1].float(), output_final_state=True)
        else:
            rep = lambda t: t.repeat_interleave(groups, dim=2)  # noqa: E731
            o_i, S_i = fla_gdn.naive_recurrent_gated_delta_rule(
                rep(qn[:, s]), rep(kn[:, s]), v[:, s].float(), beta[:, s], g[:, s],
                initial_state=h0[i:i + 1].float(), output_final_state=True)
        o_ref.append(o_i)
        S_ref.append(S_i[0])
    assert out.o.dtype == dtype and out.o.shape == (1, T, H, D)
    assert out.final_state.shape == (len(lengths), H, D, D)
    fla_assert_close("o", torch.cat(o_ref, 1), out.o, RATIO[dtype])
    fla_assert_close("final state", torch.stack(S_ref), out.final_state, RATIO[dtype])
