"""The chunked kernel stage by stage (kernels/chunked.py: decay sums, pairwise products, triangular solve, WY/erase
stage, state pass, output pass, captures), each intermediate against its definition worked in float64 by a step
loop that records what the stage should produce: the residuals r_t, the chunk start states and the outputs."""
from __future__ import annotations

import pytest
import torch

from recurscope.kernels import chunked
from recurscope.kernels.inputs import family_inputs


def step_loop(q, k, x, g, a, scale):
    """float64 step loop, B = 1 rows flattened with heads: returns (residuals r (T, H, V), states after each step
    (T, H, K, V), o (T, H, V)), with r_t = x_t - (D_t S_{t-1})^T a_t, the value step t writes along k_t."""
    q, k, x, g = (t[0].double() for t in (q, k, x, g))
    a = None if a is None else a[0].double()
    T, H, K = q.shape
    V = x.shape[-1]
    S = torch.zeros(H, K, V, dtype=torch.float64)
    rs, Ss, os = [], [], []
    for t in range(T):
        D = g[t].exp()
        S = (D[..., None] if D.dim() == 2 else D[:, None, None]) * S
        r = x[t] if a is None else x[t] - torch.einsum("hk,hkv->hv", a[t], S)
        S = S + k[t][..., None] * r[:, None, :]
        rs.append(r)
        Ss.append(S)
        os.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(rs), torch.stack(Ss), torch.stack(os)


def chunk_major(t, N, C):
    """(T, H, D) float64 -> (N, H, C, D), zero past T."""
    T, H, D = t.shape
    out = torch.zeros(N * C, H, D, dtype=t.dtype)
    out[:T] = t
    return out.view(N, C, H, D).transpose(1, 2)


def close(mine, expect, tol, what):
    err = float((mine.detach().double() - expect).abs().max() / expect.abs().max().clamp_min(1e-30))
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("grad", [False, True], ids=["no graph", "autograd"])
@pytest.mark.parametrize("family", ["gla", "gdn", "gdn2", "qed"])
def test_every_stage_matches_its_float64_definition(family, grad):
    B, T, H, K, V = 1, 100, 2, 16, 8
    C = 32
    N = -(-T // C)
    q, k, x, g, a = family_inputs(family, B, T, H, K, V, dtype=torch.float32, seed=4, decay=(0.0, 0.1)).args()
    scale = K ** -0.5
    r_ref, S_ref, o_ref = step_loop(q, k, x, g, a, scale)
    new = lambda *shape, dtype: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731  every entry is written
    channel = g.dim() == 4
    if grad:
        q, k, x = (t.clone().requires_grad_() for t in (q, k, x))
    with torch.set_grad_enabled(grad):
        # stage 0: the in-chunk cumulative log decay
        G, base2, span = chunked._decay_sums(g, B, T, H, N, C, torch.float32, grad, new)
        G_ref = chunk_major(g[0].double() if channel else g[0].double()[..., None], N, C).cumsum(2)
        G_nat = G * (chunked.LN2 if base2 else 1.0)
        close(G_nat if channel else G_nat[..., None], G_ref, 1e-6, "decay sums")
        assert abs(span - float(G_ref.abs().max())) < 1e-5
        # stage 1: the operands and pairwise terms, A_xy[t, s] = sum_k x_t y_s e^{G_t - G_s} (s <= t)
        if grad:
            ops = chunked._pivoted_operands(q, k, x, a, None, None, G, channel, scale, True, grad,
                                            B, T, H, N, C, torch.float32, new)
        else:
            ops = chunked._lifted_operands(q, k, x, a, None, None, G, base2, channel, scale,
                                           B, T, H, N, C, torch.float32, new)
        dec = (G_ref[..., :, None, :] - G_ref[..., None, :, :]).exp() * torch.ones(C, C).tril()[..., None]
        qc, kc = chunk_major(q[0].detach().double(), N, C), chunk_major(k[0].detach().double(), N, C)
        A_qk = torch.einsum("nhtk,nhsk,nhtsk->nhts", qc, kc, dec)
        close(ops.A_qk, A_qk * (scale if grad else 1.0), 1e-5, "A_qk")   # the general route scales q first
        if a is not None:
            ac = chunk_major(a[0].double(), N, C)
            A_ak = torch.einsum("nhtk,nhsk,nhtsk->nhts", ac, kc, dec)
            close(ops.A_ak.tril(-1), A_ak.tril(-1), 1e-5, "A_ak")
        # stages 2 and 3: the triangular solve and the WY right side
        rhs, L_inv, R0, M = chunked._wy_stage(ops, C, grad, new)
        if a is not None:
            eye = torch.eye(C, dtype=torch.float64)
            close(L_inv, torch.linalg.inv(eye + A_ak.tril(-1)), 1e-5, "triangular inverse")
        # stage 4: the state pass gives every step's residual and every chunk's start state
        segments = [chunked._Segment(0, N, None)]
        want = set(range(N))
        if grad:
            R, terms, finals, starts = chunked._state_pass_graph(ops, R0, M, segments, want, torch.float32)
            O, within = terms, True
        elif L_inv is None:
            R = ops.xc
            O = torch.matmul(ops.A_qk, R)
            finals, starts = chunked._state_pass_no_erase(ops, O, segments, False, want, True, B, H, new)
            within = False
        else:
            R, O, finals, starts = chunked._state_pass_erase(ops, rhs, L_inv, segments, False, want, True, B, H, new)
            within = True
        close(R.transpose(1, 2).reshape(N * C, H, V)[:T], r_ref, 1e-5, "residuals")
        for n in range(1, N):
            close(starts[n], S_ref[n * C - 1], 1e-5, f"start state of chunk {n}")
        close(finals[0], S_ref[-1], 1e-5, "final state")
        # stage 5: the output pass
        o = chunked._output_pass(O, ops, R, B, H, N, C, torch.float32, grad, add_within=within)
        close(o[0, :T], o_ref, 1e-5, "output")
        # stage 6: captures at chunk boundaries and inside chunks
        capture = [0, C - 1, C, T - 1]
        caps = chunked._capture_states(capture, C, starts, R, ops.cap_keys, ops.cap_extra, ops.yc, ops.cap_factors)
        close(caps.transpose(0, 1), S_ref[capture], 1e-5, "captured states")
    if grad:                                             # the graph reaches every input through the stages
        torch.autograd.grad(o.sum() + finals[0].sum() + caps.sum(), [q, k, x])
