"""kernels.inputs.family_inputs: each family's (q, k, x, g, a) has the structure the kernels' table gives it."""
import pytest
import torch

from recurscope import kernels
from recurscope.kernels.inputs import FAMILIES, family_inputs

B, T, H, K, V = 2, 5, 3, 4, 6


@pytest.mark.parametrize("family", FAMILIES)
def test_structure_of_each_family(family):
    d = family_inputs(family, B, T, H, K, V, seed=1)
    assert d.q.shape == d.k.shape == (B, T, H, K) and d.x.shape == (B, T, H, V)
    assert d.g.shape == ((B, T, H) if family in ("gdn", "deltanet") else (B, T, H, K))
    assert bool((d.g <= 0).all()) and bool((d.g >= -1).all())
    if family == "gla":
        assert d.a is None and torch.equal(d.x, d.v)
        return
    torch.testing.assert_close(d.k.norm(dim=-1), torch.ones(B, T, H, dtype=torch.float64))
    if family in ("gdn", "deltanet", "kda"):
        torch.testing.assert_close(d.a, d.beta[..., None] * d.k)
        torch.testing.assert_close(d.x, d.beta[..., None] * d.v)
        assert family != "deltanet" or bool((d.g == 0).all())
    else:
        torch.testing.assert_close(d.x, d.w * d.v)
        want = d.b * d.k if family == "gdn2" else kernels.erase_vector(d.k, d.q, d.b, d.lam, "full")
        torch.testing.assert_close(d.a, want)


def test_one_seed_shares_q_k_v_and_decays_across_families_and_dtypes():
    gdn2, qed = family_inputs("gdn2", B, T, H, K, V, seed=4), family_inputs("qed", B, T, H, K, V, seed=4)
    assert torch.equal(gdn2.q, qed.q) and torch.equal(gdn2.v, qed.v) and torch.equal(gdn2.g, qed.g)
    half = family_inputs("qed", B, T, H, K, V, seed=4, dtype=torch.bfloat16)
    assert half.q.dtype == torch.bfloat16 and torch.equal(half.q, qed.q.to(torch.bfloat16))
    rand = family_inputs("qed", B, T, H, K, V, seed=4, arm="rand", decay=(0.5, 0.5))
    torch.testing.assert_close(rand.a, kernels.erase_vector(rand.k, rand.q, rand.b, rand.lam, "rand", rand.z))
    assert bool((rand.g == -0.5).all())
    out = kernels.recurrence(*qed.args(), backend="reference")
    assert out.o.shape == (B, T, H, V)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="family must be one of"):
        family_inputs("mamba", B, T, H, K, V)
    with pytest.raises(ValueError, match="arm must be one of"):
        family_inputs("qed", B, T, H, K, V, arm="half")
    with pytest.raises(ValueError, match="decay must be"):
        family_inputs("gla", B, T, H, K, V, decay=(1.0, 0.5))
