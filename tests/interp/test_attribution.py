"""interp.attribution: the adjoint split of o_t against the reference recurrence, a per-token brute force, and models."""
import numpy as np
import pytest
import torch

from recurscope import kernels
from recurscope.hooks.points import hook_name
from recurscope.interp.attribution import Contributions, attribute_readout, readout_contributions
from recurscope.kernels.inputs import family_inputs as kernel_inputs

from helpers_models import output_of, tiny_model

B, T, H, K, V = 2, 10, 3, 5, 4
F64 = torch.float64


def family_inputs(family: str, seed: int = 0) -> dict:
    """The shared kernel-input builder's (q, k, x, g, a) at this file's shapes, as keyword arguments."""
    return dict(zip("qkxga", kernel_inputs(family, B, T, H, K, V, seed=seed).args()))


def reference_o(inp, **kw):
    return kernels.recurrence(inp["q"], inp["k"], inp["x"], inp["g"], inp["a"], backend="reference", **kw).o


FAMILIES = ["gla", "gdn", "qed"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_initial", [False, True])
def test_contributions_sum_to_reference_output(family, with_initial):
    inp = family_inputs(family)
    S0 = torch.randn(B, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(7)) if with_initial else None
    o = reference_o(inp, initial_state=S0)
    for b, h, t in [(0, 0, 0), (1, 2, T - 1), (0, 1, 6)]:
        c = readout_contributions(**inp, t=t, initial_state=S0, head=h, batch=b)
        assert isinstance(c, Contributions) and c.per_token.shape == (t + 1, V) and c.adjoint.shape == (t + 1, K)
        torch.testing.assert_close(c.total(), o[b, t, h], rtol=0, atol=1e-10)
        if not with_initial:
            assert bool((c.initial == 0).all())
        else:
            assert float(c.initial.norm()) > 1e-6  # the initial state is really carried, not dropped


@pytest.mark.parametrize("family", FAMILIES)
def test_each_contribution_equals_a_rerun_with_only_that_write(family):
    inp = family_inputs(family, seed=1)
    S0 = torch.randn(B, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(3))
    b, h, t = 1, 1, 7
    c = readout_contributions(**inp, t=t, initial_state=S0, head=h, batch=b)
    for i in range(t + 1):
        only_i = torch.zeros(B, T, H, dtype=F64)
        only_i[:, i] = 1.0
        brute = reference_o(inp, write_scale=only_i)[b, t, h]
        torch.testing.assert_close(c.per_token[i], brute, rtol=0, atol=1e-12)
    brute_initial = reference_o(inp, initial_state=S0, write_scale=torch.zeros(B, T, H, dtype=F64))[b, t, h]
    torch.testing.assert_close(c.initial, brute_initial, rtol=0, atol=1e-12)
    # c_i = coefficient_i * x_i exactly when there is no extra write.
    torch.testing.assert_close(c.per_token, c.coefficients[:, None] * inp["x"][b, : t + 1, h], rtol=0, atol=1e-14)


def low_rank_inputs(seed: int = 0) -> dict:
    """RWKV-7-like inputs of kernels.recurrence_low_rank: a unit read direction a, the erase b = a * rate (rate in
    (0, 1)), per-channel log-decays."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, dtype=F64, generator=gen)  # noqa: E731
    a = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), x=r(B, T, H, V), g=-torch.rand(B, T, H, K, dtype=F64, generator=gen),
                a=a, b=a * torch.rand(B, T, H, K, dtype=F64, generator=gen))


def low_rank_o(inp, **kw):
    return kernels.recurrence_low_rank(inp["q"], inp["k"], inp["x"], inp["g"], inp["a"], inp["b"],
                                       backend="reference", **kw).o


def test_low_rank_contributions_sum_to_its_reference_and_each_equals_a_rerun_with_only_that_write():
    """The decay-plus-low-rank transition Diag(exp g) - b a^T (RWKV-7): the sweep's adjoint is its own."""
    inp = low_rank_inputs(seed=3)
    S0 = torch.randn(B, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(4))
    o = low_rank_o(inp, initial_state=S0, scale=1.0)
    bt, h, t = 1, 2, 8
    c = readout_contributions(**inp, t=t, scale=1.0, initial_state=S0, head=h, batch=bt)
    torch.testing.assert_close(c.total(), o[bt, t, h], rtol=0, atol=1e-10)
    for i in range(t + 1):
        only_i = torch.zeros(B, T, H, dtype=F64)
        only_i[:, i] = 1.0
        torch.testing.assert_close(c.per_token[i], low_rank_o(inp, write_scale=only_i, scale=1.0)[bt, t, h],
                                   rtol=0, atol=1e-12)
    blocked = low_rank_o(inp, initial_state=S0, write_scale=torch.zeros(B, T, H, dtype=F64), scale=1.0)
    torch.testing.assert_close(c.initial, blocked[bt, t, h], rtol=0, atol=1e-12)
    # the other form's sweep on the same inputs is not this one (the check has teeth)
    other = readout_contributions(**{n: v for n, v in inp.items() if n != "b"}, t=t, scale=1.0, initial_state=S0,
                                  head=h, batch=bt)
    assert float((other.total() - o[bt, t, h]).abs().max()) > 1e-3


def test_write_scale_write_key_and_extra_write_follow_the_kernel():
    """A patched write key u: erase keeps k, the write becomes u x^T (the model's hook_write_key semantics)."""
    inp = family_inputs("qed", seed=2)
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(B, T, H, K, dtype=F64, generator=gen)
    ws = torch.rand(B, T, H, dtype=F64, generator=gen)
    extra = (torch.randn(B, T, H, K, dtype=F64, generator=gen), torch.randn(B, T, H, V, dtype=F64, generator=gen))
    b, h, t = 0, 2, 8
    # The model's patch: k x^T blocked, u (ws x)^T added as the extra write.
    patched = reference_o(inp, write_scale=torch.zeros(B, T, H, dtype=F64), extra_write=(u, ws[..., None] * inp["x"]))
    c = readout_contributions(**inp, t=t, write_scale=ws, write_key=u, head=h, batch=b)
    torch.testing.assert_close(c.total(), patched[b, t, h], rtol=0, atol=1e-10)
    for i in (0, 4, t):
        only_i = torch.zeros(B, T, H, dtype=F64)
        only_i[:, i] = 1.0
        brute = reference_o(inp, write_scale=torch.zeros(B, T, H, dtype=F64),
                            extra_write=(u, (only_i * ws)[..., None] * inp["x"]))[b, t, h]
        torch.testing.assert_close(c.per_token[i], brute, rtol=0, atol=1e-12)
    # A general extra write on top of a scaled k x^T write.
    c2 = readout_contributions(**inp, t=t, write_scale=ws, extra_write=extra, head=h, batch=b)
    torch.testing.assert_close(c2.total(), reference_o(inp, write_scale=ws, extra_write=extra)[b, t, h],
                               rtol=0, atol=1e-10)


def test_one_head_inputs_match_the_batched_selection_and_float32_inputs_are_promoted():
    inp = family_inputs("gdn", seed=4)
    b, h, t = 1, 0, 9
    one = {n: (None if v is None else v[b, :, h]) for n, v in inp.items()}
    c1 = readout_contributions(**one, t=t)
    c2 = readout_contributions(**inp, t=t, head=h, batch=b)
    torch.testing.assert_close(c1.per_token, c2.per_token, rtol=0, atol=0)
    f32 = {n: (None if v is None else v.float()) for n, v in one.items()}
    c3 = readout_contributions(**f32, t=t)
    assert c3.per_token.dtype == F64
    torch.testing.assert_close(c3.total(), reference_o(inp)[b, t, h], rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise_named_value_errors():
    inp = family_inputs("gla")
    with pytest.raises(ValueError, match=r"t = 10 is out of range.*0\.\.9"):
        readout_contributions(**inp, t=T, head=0, batch=0)
    with pytest.raises(ValueError, match=r"t = -1 is out of range"):
        readout_contributions(**inp, t=-1, head=0, batch=0)
    with pytest.raises(ValueError, match=r"head 3 is out of range.*0\.\.2"):
        readout_contributions(**inp, t=0, head=H, batch=0)
    with pytest.raises(ValueError, match=r"pass head=h"):
        readout_contributions(**inp, t=0)
    with pytest.raises(ValueError, match=r"batch size B = 2: pass batch=b"):
        readout_contributions(**inp, t=0, head=0)
    with pytest.raises(ValueError, match=r"g must have shape"):
        readout_contributions(**{**inp, "g": inp["g"][..., :2]}, t=0, head=0, batch=0)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(K, V\)"):
        one = {n: (None if v is None else v[0, :, 0]) for n, v in inp.items()}
        readout_contributions(**one, t=0, initial_state=torch.zeros(V, K, dtype=F64))
    with pytest.raises(ValueError, match=r"b \(the low-rank transition's erase direction\) needs a"):
        readout_contributions(**inp, t=0, head=0, batch=0, b=inp["q"])
    low = low_rank_inputs()
    with pytest.raises(ValueError, match=r"b must have a's shape \(2, 10, 3, 5\), got \(2, 10, 3, 4\)"):
        readout_contributions(**{**low, "b": low["b"][..., :4]}, t=0, head=0, batch=0)


# ---------------------------------------------------------------------------------------------------------------
# Through a model
# ---------------------------------------------------------------------------------------------------------------

TOKENS = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("family", ["gla", "gdn", "mamba2", "rwkv7"])
def test_model_rows_sum_to_hook_head_out(family):
    model = tiny_model(family).double()
    layer, head, pos = 1, 1, 9
    _, cache = model.run_with_cache(TOKENS)
    o_t = cache[hook_name("hook_head_out", layer)][0, pos, head]
    df = attribute_readout(model, TOKENS, layer, head, pos)
    assert list(df.position) == list(range(pos + 1)) and list(df.token_id) == TOKENS[0, : pos + 1].tolist()
    total = np.stack(df.contribution).sum(0)
    np.testing.assert_allclose(total, o_t.numpy(), rtol=0, atol=1e-10 * max(1.0, float(o_t.abs().max())))
    np.testing.assert_allclose(df.norm, np.linalg.norm(np.stack(df.contribution), axis=1), rtol=1e-12)
    # Default direction: the unit o_t, so the projections sum to |o_t|.
    assert df.projection.sum() == pytest.approx(float(o_t.norm()), abs=1e-10)
    e = torch.zeros(o_t.shape[0], dtype=F64)
    e[2] = 1.0
    assert attribute_readout(model, TOKENS, layer, head, pos, direction=e).projection.sum() == \
        pytest.approx(float(o_t[2]), abs=1e-10)


@pytest.mark.parametrize("family", ["gla", "gdn", "qed"])
def test_candidate_projections_sum_to_the_heads_direct_logit_difference(family):
    """With frozen norm scales, sum_i c_i . d = (W_U[a] - W_U[b]) . final_norm_frozen(o_proj_h(z_t)), z_t read
    from hook_z (the model's own norm-and-gate output, not the attribution's reconstruction)."""
    model = tiny_model(family).double()
    layer, head, pos, good, bad = 0, 1, 10, 5, 17
    _, cache = model.run_with_cache(TOKENS)
    mixer = model.blocks[layer].mixer
    Vh = mixer.head_v
    z_t = cache[hook_name("hook_z", layer)][0, pos, head]
    torch.set_grad_enabled(False)  # restored below; the weights require grad
    written = mixer.o_proj.weight[:, head * Vh:(head + 1) * Vh] @ z_t
    resid = cache[hook_name("hook_resid_post", len(model.blocks) - 1)][0, pos]
    frozen = written * torch.rsqrt(resid.pow(2).mean() + model.norm.eps) * model.norm.weight
    expected = float((model.lm_head.weight[good] - model.lm_head.weight[bad]) @ frozen)
    torch.set_grad_enabled(True)
    df = attribute_readout(model, TOKENS, layer, head, pos, candidates=(good, bad))
    assert abs(expected) > 1e-8
    # rel 1e-6, not 1e-10: the model's RMSNorm computes in float32 even for a float64 model (layers.rms_normalise),
    # so hook_z carries float32 rounding while the attribution's frozen scale is float64.
    assert df.projection.sum() == pytest.approx(expected, rel=1e-6, abs=1e-12)


def _direct_logit_difference(model, head_cols, z_o, resid, good, bad):
    """(W_U[a] - W_U[b]) . final_norm_frozen(head's o_proj columns @ z_o), the final norm's statistics frozen at
    resid: an RMSNorm's scale, or a LayerNorm's centring and scale."""
    written = head_cols @ z_o
    norm = model.norm
    if isinstance(norm, torch.nn.LayerNorm):
        frozen = (written - written.mean()) * torch.rsqrt(resid.var(unbiased=False) + norm.eps) * norm.weight
    else:
        frozen = written * torch.rsqrt(resid.pow(2).mean() + norm.eps) * norm.weight
    return float((model.lm_head.weight[good] - model.lm_head.weight[bad]) @ frozen)


@pytest.mark.parametrize("variant", [{}, dict(norm_before_gate=True, D_has_hdim=True), dict(rmsnorm=False)],
                         ids=["default", "norm_before_gate+D_per_channel", "no_norm"])
def test_mamba2_candidate_projections_follow_its_gated_group_norm(variant):
    """Mamba-2: hook_z = gated norm of y = o + D x, the rms taken over the group of heads the norm spans. By hand from
    the model's own in_proj output (the gate), D, norm weight and hooks: with the group rms frozen, the part of z_h
    that o_h writes is s * o_h, s = r * weight_h * silu(gate_h); the D skip is no function of o and drops out."""
    model = tiny_model("mamba2", **variant).double()
    layer, head, pos, good, bad = 1, 5, 10, 5, 17
    mixer = model.blocks[layer].mixer
    H, P, inner = mixer.num_heads, mixer.head_v, mixer.intermediate
    _, cache = model.run_with_cache(TOKENS)
    gate = output_of(mixer.in_proj, model, TOKENS)[0, pos, :inner].view(H, P)
    at = lambda point: cache[hook_name(point, layer)][0, pos].detach()  # noqa: E731
    o, x = at("hook_head_out"), at("hook_v")
    torch.set_grad_enabled(False)  # restored below; the weights require grad
    y = o + mixer.D.reshape(H, -1) * x
    silu = torch.nn.functional.silu
    if variant.get("rmsnorm", True):
        per_group = H // mixer.n_groups
        mates = slice(head // per_group * per_group, (head // per_group + 1) * per_group)
        u = y[mates] if variant.get("norm_before_gate") else y[mates] * silu(gate[mates])
        s = torch.rsqrt(u.pow(2).mean() + mixer.norm.eps) * mixer.norm.weight.view(H, P)[head] * silu(gate[head])
    else:
        s = silu(gate[head])
    torch.testing.assert_close(s * y[head], at("hook_z")[head], rtol=1e-6, atol=1e-12)   # the hand map is hook_z
    cols = mixer.out_proj.weight[:, head * P:(head + 1) * P]
    resid = cache[hook_name("hook_resid_post", len(model.blocks) - 1)][0, pos]
    expected = _direct_logit_difference(model, cols, s * o[head], resid, good, bad)
    with_skip = _direct_logit_difference(model, cols, s * y[head], resid, good, bad)
    torch.set_grad_enabled(True)
    df = attribute_readout(model, TOKENS, layer, head, pos, candidates=(good, bad))
    assert abs(expected) > 1e-9 and abs(with_skip - expected) > 1e-3 * abs(expected)
    assert df.projection.sum() == pytest.approx(expected, rel=1e-6, abs=1e-14)


def test_rwkv7_candidate_projections_follow_its_group_norm_and_gate():
    """RWKV-7: hook_z = (group_norm(o) + bonus) * gate. By hand from the model's own g_lora output (the gate), its
    group norm's weight and bias, r_k and the hooks: with the head's mean subtracted and its variance frozen, the part
    of z that o writes is gate * weight * (o - mean o) / sqrt(var o + eps); the bonus (r * k * r_k).sum() v and the
    norm's bias are no function of o and drop out; the final LayerNorm centres and scales."""
    model = tiny_model("rwkv7").double()
    layer, head, pos, good, bad = 1, 1, 10, 5, 17
    mixer = model.blocks[layer].mixer
    V = mixer.head_v
    cols = slice(head * V, (head + 1) * V)
    _, cache = model.run_with_cache(TOKENS)
    gate = output_of(mixer.g_lora, model, TOKENS)[0, pos, cols]
    at = lambda point: cache[hook_name(point, layer)][0, pos, head].detach()  # noqa: E731
    o = at("hook_head_out")
    torch.set_grad_enabled(False)  # restored below; the weights require grad
    norm = mixer.g_norm
    centred = (o - o.mean()) * torch.rsqrt(o.var(unbiased=False) + norm.eps) * norm.weight[cols]
    bonus = (at("hook_q") * at("hook_k") * mixer.r_k[head]).sum() * at("hook_v")
    torch.testing.assert_close((centred + norm.bias[cols] + bonus) * gate, at("hook_z"), rtol=1e-6, atol=1e-12)
    resid = cache[hook_name("hook_resid_post", len(model.blocks) - 1)][0, pos]
    expected = _direct_logit_difference(model, mixer.o_proj.weight[:, cols], centred * gate, resid, good, bad)
    torch.set_grad_enabled(True)
    df = attribute_readout(model, TOKENS, layer, head, pos, candidates=(good, bad))
    assert abs(expected) > 1e-6
    assert df.projection.sum() == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_model_with_a_patched_write_key_still_sums_to_hook_head_out():
    model = tiny_model("qed").double()
    layer, head, pos = 1, 0, 11
    gen = torch.Generator().manual_seed(2)
    noise = None

    def patch(u, hook):
        nonlocal noise
        if noise is None:
            noise = torch.randn(u.shape, dtype=u.dtype, generator=gen)
        return u + 0.5 * noise

    with model.hooks(fwd_hooks=[(hook_name("hook_write_key", layer), patch)]):
        _, cache = model.run_with_cache(TOKENS)
        df = attribute_readout(model, TOKENS, layer, head, pos)
    o_t = cache[hook_name("hook_head_out", layer)][0, pos, head]
    _, clean = model.run_with_cache(TOKENS)
    assert float((clean[hook_name("hook_head_out", layer)][0, pos, head] - o_t).abs().max()) > 1e-6
    np.testing.assert_allclose(np.stack(df.contribution).sum(0), o_t.numpy(), rtol=0, atol=1e-10)


def test_model_bad_inputs_raise_named_value_errors():
    model = tiny_model("gla")
    with pytest.raises(ValueError, match=r"head 2 is out of range"):
        attribute_readout(model, TOKENS, 0, 2, 3)
    with pytest.raises(ValueError, match=r"layer 5 is out of range"):
        attribute_readout(model, TOKENS, 5, 0, 3)
    with pytest.raises(ValueError, match=r"position 12 is out of range.*0\.\.11"):
        attribute_readout(model, TOKENS, 0, 0, 12)
    with pytest.raises(ValueError, match=r"candidates must be token ids"):
        attribute_readout(model, TOKENS, 0, 0, 3, candidates=(1, 999))
    hybrid = tiny_model("gdn_hybrid")
    with pytest.raises(ValueError, match=r"full-attention layer"):
        attribute_readout(hybrid, TOKENS, 1, 0, 3)


def test_model_with_a_tokenizer_names_the_tokens():
    from recurscope.interp.data.tokenizer import build_word_tokenizer, token_strings

    model = tiny_model("gdn")
    model.tokenizer = build_word_tokenizer()
    df = attribute_readout(model, TOKENS[0], 0, 0, 4)
    assert list(df.token) == token_strings(model.tokenizer, TOKENS[0, :5].tolist())
