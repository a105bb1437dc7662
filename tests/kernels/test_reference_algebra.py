"""The reference step loop against algebra derived by hand from the QED paper ("The Query Knows What to Forget",
arXiv:2608.13668, Sec. 3 and eq. 6), in float64."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from recurscope import kernels

DT = torch.float64


def _unit(*shape, gen):
    return F.normalize(torch.randn(*shape, generator=gen, dtype=DT), dim=-1)


def _qed_inputs(B=2, T=7, H=3, K=6, V=4, seed=0, arm="full"):
    """Random QED (or GDN-2 for arm="gdn2") inputs with per-channel decay."""
    gen = torch.Generator().manual_seed(seed)
    q, k = _unit(B, T, H, K, gen=gen), _unit(B, T, H, K, gen=gen)
    v = torch.randn(B, T, H, V, generator=gen, dtype=DT)
    b = torch.rand(B, T, H, K, generator=gen, dtype=DT)
    w = torch.rand(B, T, H, V, generator=gen, dtype=DT)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=DT)
    lam = 0.05 + 0.2 * torch.rand(H, generator=gen, dtype=DT)
    z = _unit(H, K, gen=gen)
    a = kernels.erase_vector(k, q, b, lam, arm, z=z)
    return dict(q=q, k=k, v=v, b=b, w=w, g=g, lam=lam, z=z, a=a)


def _run(q, k, x, g, a, **kw):
    return kernels.recurrence(q, k, x, g, a, backend="reference", **kw)


@pytest.mark.parametrize("arm", ["gdn2", "full", "nogate_noproj"])
@pytest.mark.parametrize("t", [1, 4, 6])
def test_response_to_probe_orthogonal_to_k_only_decays(arm, t):
    """S_t^T p = (D_t S_{t-1})^T p for p ⟂ k_t, whatever a_t is, because the step's change is k_t r_t^T."""
    d = _qed_inputs(arm=arm, seed=t)
    q, k, g, a = d["q"], d["k"], d["g"], d["a"]
    x = d["w"] * d["v"]
    _, _, states = _run(q, k, x, g, a, capture=[t - 1, t])
    S_prev, S_t = states[:, 0], states[:, 1]                      # (B, H, K, V)
    gen = torch.Generator().manual_seed(100 + t)
    probes = kernels.project_out(k[:, t], torch.randn(k[:, t].shape, generator=gen, dtype=DT))
    assert (probes * k[:, t]).sum(-1).abs().max() < 1e-14
    decayed = g[:, t].exp()[..., None] * S_prev                    # D_t S_{t-1}
    resp_t = torch.einsum("bhkv,bhk->bhv", S_t, probes)
    resp_decayed = torch.einsum("bhkv,bhk->bhv", decayed, probes)
    torch.testing.assert_close(resp_t, resp_decayed, rtol=0, atol=1e-12)
    # The probe along k_t does change beyond the decay, so the check above is not vacuous.
    along = torch.einsum("bhkv,bhk->bhv", S_t - decayed, k[:, t])
    assert along.abs().max() > 1e-3


def test_response_orthogonal_to_k_unchanged_when_step_has_no_decay():
    d = _qed_inputs(seed=3)
    t = 3
    g = d["g"].clone()
    g[:, t] = 0.0                                                  # D_t = I at step t
    _, _, states = _run(d["q"], d["k"], d["w"] * d["v"], g, d["a"], capture=[t - 1, t])
    gen = torch.Generator().manual_seed(7)
    p = kernels.project_out(d["k"][:, t], torch.randn(d["k"][:, t].shape, generator=gen, dtype=DT))
    before = torch.einsum("bhkv,bhk->bhv", states[:, 0], p)
    after = torch.einsum("bhkv,bhk->bhv", states[:, 1], p)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qed_minus_gdn2_one_step_matches_eqs_11_12(seed):
    """From the same S_{t-1}: S^QED - S^GDN2 = -lam k (S̄^T d)^T and o^QED - o^GDN2 = -lam rho S̄^T d."""
    B, H, K, V = 2, 3, 6, 4
    d = _qed_inputs(B=B, T=1, H=H, K=K, V=V, seed=seed)
    gen = torch.Generator().manual_seed(50 + seed)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=DT)
    q, k, b, g, lam = d["q"], d["k"], d["b"], d["g"], d["lam"]
    x = d["w"] * d["v"]
    a_gdn2 = kernels.erase_vector(k, q, b, lam, "gdn2")
    a_qed = kernels.erase_vector(k, q, b, lam, "full")
    o2, S2, _ = _run(q, k, x, g, a_gdn2, initial_state=S0, scale=1.0)
    oq, Sq, _ = _run(q, k, x, g, a_qed, initial_state=S0, scale=1.0)

    k0, q0, b0 = k[:, 0], q[:, 0], b[:, 0]                         # (B, H, K)
    S_bar = g[:, 0].exp()[..., None] * S0
    u = b0 * q0
    dvec = u - k0 * (k0 * u).sum(-1, keepdim=True)                  # P⊥k (b ⊙ q)
    read = torch.einsum("bhkv,bhk->bhv", S_bar, dvec)               # S̄^T d
    rho = (q0 * k0).sum(-1)                                         # q^T k
    lam_h = lam[None, :, None]
    torch.testing.assert_close(Sq - S2, -lam_h[..., None] * k0[..., :, None] * read[..., None, :], rtol=0, atol=1e-12)
    torch.testing.assert_close(oq[:, 0] - o2[:, 0], -lam_h * rho[..., None] * read, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arm", ["full", "nogate", "rand"])
def test_projected_arms_keep_the_gdn2_eigenvalue(arm):
    d = _qed_inputs(seed=11, arm=arm)
    k, b = d["k"], d["b"]
    e_arm = kernels.erase_eigenvalue(k, d["a"])
    e_gdn2 = kernels.erase_eigenvalue(k, kernels.erase_vector(k, d["q"], b, d["lam"], "gdn2"))
    torch.testing.assert_close(e_arm, e_gdn2, rtol=0, atol=1e-13)
    torch.testing.assert_close(e_gdn2, 1 - (b * k * k).sum(-1), rtol=0, atol=1e-13)
    # e is the eigenvalue of I - k a^T that is not 1: det(I - k a^T) = 1 - a^T k.
    M = torch.eye(k.shape[-1], dtype=DT) - k[0, 0, 0][:, None] * d["a"][0, 0, 0][None, :]
    torch.testing.assert_close(torch.linalg.det(M), e_arm[0, 0, 0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("arm", ["nogate_noproj", "noproj"])
def test_unprojected_arms_change_the_eigenvalue(arm):
    d = _qed_inputs(seed=12, arm=arm)
    k, q, b, lam = d["k"], d["q"], d["b"], d["lam"]
    e_arm = kernels.erase_eigenvalue(k, d["a"])
    e_gdn2 = 1 - (b * k * k).sum(-1)
    added = q if arm == "nogate_noproj" else b * q
    # Without the projection the shift is exactly -lam (added^T k), which is generically non-zero.
    torch.testing.assert_close(e_arm - e_gdn2, -lam * (added * k).sum(-1), rtol=0, atol=1e-13)
    assert (e_arm - e_gdn2).abs().min() > 1e-6


def test_each_arm_matches_the_paper_formula():
    """Table 1 of the paper, written with an explicit projector matrix P = I - k k^T."""
    d = _qed_inputs(B=1, T=3, H=2, K=5, seed=21)
    k, q, b, lam, z = d["k"], d["q"], d["b"], d["lam"], d["z"]
    I = torch.eye(5, dtype=DT)
    for t in range(3):
        for h in range(2):
            kk, qq, bb, ll, zz = k[0, t, h], q[0, t, h], b[0, t, h], float(lam[h]), z[h]
            P = I - torch.outer(kk, kk)
            expected = {
                "gdn2": bb * kk,
                "full": bb * kk + ll * (P @ (bb * qq)),
                "nogate": bb * kk + ll * (P @ qq),
                "nogate_noproj": bb * kk + ll * qq,
                "noproj": bb * kk + ll * (bb * qq),
                "rand": bb * kk + ll * (P @ (bb * zz)),
            }
            assert set(expected) == set(kernels.ERASE_ARMS)
            for arm, want in expected.items():
                got = kernels.erase_vector(k, q, b, lam, arm, z=z)[0, t, h]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-14, msg=f"arm {arm}")


def test_gate_then_project_is_not_project_then_gate():
    """The paper gates first: P⊥k(b ⊙ q) differs from b ⊙ P⊥k(q) for a per-channel b."""
    k = torch.tensor([[[0.6, 0.8]]], dtype=DT)
    q = torch.tensor([[[0.8, 0.6]]], dtype=DT)
    b = torch.tensor([[[0.9, 0.1]]], dtype=DT)
    lam = torch.tensor([1.0], dtype=DT)
    d = kernels.erase_vector(k, q, b, lam, "full") - b * k
    assert (d * k).sum().abs() < 1e-14                              # projected: orthogonal to k
    assert not torch.allclose(d, b * kernels.project_out(k, q))


def test_worked_two_dimensional_example():
    """Sec. 2.4: k=(1,0), q=(0.6,0.8), b=(0.5,0.5), S̄=(2,3), w*v=1, lam=0.2 → o 3.6 (GDN-2), 3.456 (QED)."""
    shape = (1, 1, 1, 2)
    k = torch.tensor([1.0, 0.0], dtype=DT).reshape(shape)
    q = torch.tensor([0.6, 0.8], dtype=DT).reshape(shape)
    b = torch.tensor([0.5, 0.5], dtype=DT).reshape(shape)
    lam = torch.tensor([0.2], dtype=DT)
    x = torch.ones(1, 1, 1, 1, dtype=DT)
    g = torch.zeros(shape, dtype=DT)                                # S̄ = S_{t-1}
    S_bar = torch.tensor([2.0, 3.0], dtype=DT).reshape(1, 1, 2, 1)

    a = kernels.erase_vector(k, q, b, lam, "full")
    torch.testing.assert_close(a.flatten(), torch.tensor([0.5, 0.08], dtype=DT), rtol=0, atol=1e-15)  # b⊙k + 0.2*(0, 0.4)
    o_qed, S_qed, _ = _run(q, k, x, g, a, initial_state=S_bar, scale=1.0)
    o_gdn2, S_gdn2, _ = _run(q, k, x, g, b * k, initial_state=S_bar, scale=1.0)
    assert math.isclose(float(o_gdn2), 3.6, abs_tol=1e-13)
    assert math.isclose(float(o_qed), 3.456, abs_tol=1e-13)
    assert math.isclose(float(o_gdn2 - o_qed), 0.2 * 0.6 * 1.2, abs_tol=1e-13)
    torch.testing.assert_close(S_qed.flatten(), torch.tensor([1.76, 3.0], dtype=DT), rtol=0, atol=1e-13)
    torch.testing.assert_close(S_gdn2.flatten(), torch.tensor([2.0, 3.0], dtype=DT), rtol=0, atol=1e-13)


def test_non_normal_erase_factor_can_grow_a_state():
    """Sec. 2.5: M = I - k a^T with spec {0.5, 1} still stretches (0, 1) to norm sqrt(1.01)."""
    shape = (1, 1, 1, 2)
    k = torch.tensor([1.0, 0.0], dtype=DT).reshape(shape)
    q = torch.tensor([0.0, 1.0], dtype=DT).reshape(shape)
    b = torch.tensor([0.5, 0.5], dtype=DT).reshape(shape)
    a = kernels.erase_vector(k, q, b, torch.tensor([0.2], dtype=DT), "full")
    M = torch.eye(2, dtype=DT) - torch.outer(k.flatten(), a.flatten())
    torch.testing.assert_close(M, torch.tensor([[0.5, -0.1], [0.0, 1.0]], dtype=DT), rtol=0, atol=1e-15)
    spec = torch.linalg.eigvals(M)
    torch.testing.assert_close(torch.sort(spec.real).values, torch.tensor([0.5, 1.0], dtype=DT), rtol=0, atol=1e-14)
    assert spec.imag.abs().max() == 0
    # One recurrence step with no decay and no write applies exactly M to the state.
    S0 = torch.tensor([0.0, 1.0], dtype=DT).reshape(1, 1, 2, 1)
    _, S1, _ = _run(q, k, torch.zeros(1, 1, 1, 1, dtype=DT), torch.zeros(shape, dtype=DT), a, initial_state=S0)
    assert math.isclose(float(S1.norm()), math.sqrt(1.01), rel_tol=0, abs_tol=1e-14)
    assert float(S1.norm()) > 1.0
