"""Hook points exist as documented, and each patch means what the vocabulary says, checked against the kernel
reference run on the mixer's own cached inputs."""
import pytest
import torch

from recurscope import kernels
from recurscope.hooks import StateReplace, WriteReplace, WriteScale, hook_name, names_for, run_with_patches
from tests.interp.helpers_models import FAMILIES, tiny_model

T = 21


def _tokens(model, T=T, B=2, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.vocab_size, (B, T), generator=g)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_documented_hook_exists_and_nothing_else(family):
    model = tiny_model(family)
    assert set(model.hook_dict) == names_for(model)


@pytest.mark.parametrize("family", ["gla", "gdn", "qed", "gdn_hybrid"])
def test_run_with_cache_shapes_and_no_unrequested_states(family):
    model = tiny_model(family)
    tokens = _tokens(model)
    with torch.no_grad():
        plain = model(tokens)
        logits, cache = model.run_with_cache(tokens)
        assert torch.equal(plain, logits)
        assert not any(k.endswith("hook_state") for k in cache.keys())
        _, cache = model.run_with_cache(tokens, state_positions=[0, 7, T - 1])
    layer = model.recurrent_layers[0]
    K, V = model.cfg.state_shape()
    H = model.n_state_heads
    assert cache[hook_name("hook_state", layer)].shape == (2, 3, H, K, V)
    assert cache[hook_name("hook_head_out", layer)].shape == (2, T, H, V)
    assert cache["blocks.0.hook_resid_post"].shape == (2, T, model.cfg.hidden_size)


def _mixer_inputs(model, tokens, layer=0):
    names = [hook_name(f"hook_{n}", layer) for n in ("q", "k", "decay", "write_key", "write_value")]
    if model.cfg.model_type != "gla":
        names.append(hook_name("hook_erase", layer))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names or n.endswith("hook_head_out"))
    get = lambda n: cache[hook_name(f"hook_{n}", layer)].double()  # noqa: E731
    a = get("erase") if model.cfg.model_type != "gla" else None
    return get("q"), get("k"), get("write_value"), get("decay"), a, cache


def _scale(model):
    return model.cfg.state_shape()[0] ** -0.5


@pytest.mark.parametrize("family", ["gla", "gdn", "qed"])
def test_write_block_equals_reference_with_zero_write_scale(family):
    model = tiny_model(family)
    tokens = _tokens(model)
    q, k, x, g, a, _ = _mixer_inputs(model, tokens)
    ws = torch.ones(q.shape[:3], dtype=torch.float64)
    ws[:, 4:9, 1] = 0.0
    ref = kernels.recurrence(q, k, x, g, a, scale=_scale(model), write_scale=ws, backend="reference").o
    with torch.no_grad():
        patched = {}

        def grab(o, hook):
            patched["o"] = o
        model.run_with_hooks(tokens, fwd_hooks=WriteScale(0, 1, slice(4, 9)).fwd_hooks()
                             + [(hook_name("hook_head_out", 0), grab)])
    assert (patched["o"].double() - ref).abs().max().item() < 1e-5
    # the block carries forward: later readouts of head 1 move, head 0 is untouched
    clean = _mixer_inputs(model, tokens)[5][hook_name("hook_head_out", 0)]
    assert (patched["o"][:, 9:, 1] - clean[:, 9:, 1]).abs().max() > 1e-4
    assert torch.allclose(patched["o"][:, :, 0], clean[:, :, 0], atol=1e-6)


@pytest.mark.parametrize("family", ["gdn", "qed"])
def test_write_key_patch_moves_only_the_write_not_the_erase(family):
    model = tiny_model(family)
    tokens = _tokens(model)
    q, k, x, g, a, _ = _mixer_inputs(model, tokens)
    new_key = torch.nn.functional.normalize(torch.randn_like(k), dim=-1)
    new_value = torch.randn_like(x)
    span = slice(3, 6)
    # reference: recipient erase everywhere; at the span, the k x^T write is replaced by u y^T
    ws = torch.ones(q.shape[:3], dtype=torch.float64)
    ws[:, span, 0] = 0
    u, y = torch.zeros_like(k), torch.zeros_like(x)
    u[:, span, 0], y[:, span, 0] = new_key[:, span, 0], new_value[:, span, 0]
    ref = kernels.recurrence(q, k, x, g, a, scale=_scale(model), write_scale=ws, extra_write=(u, y),
                             backend="reference").o
    got = {}
    hooks = WriteReplace(0, 0, span, new_key.float(), new_value.float()).fwd_hooks()
    hooks.append((hook_name("hook_head_out", 0), lambda o, hook: got.setdefault("o", o)))
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks)
    assert (got["o"].double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["gla", "gdn", "qed", "gdn_hybrid"])
def test_state_patch_carries_forward_from_the_patched_position(family):
    model = tiny_model(family)
    tokens = _tokens(model)
    q, k, x, g, a, cache = _mixer_inputs(model, tokens)
    t = 9
    K, V = model.cfg.state_shape()
    new_state = torch.randn(2, K, V, dtype=torch.float64)
    with torch.no_grad():
        _, clean_cache = model.run_with_cache(tokens, state_positions=[t])
    S_t = clean_cache[hook_name("hook_state", 0)][:, 0].double().clone()
    S_t[:, 1] = new_state
    # reference: outputs up to t-1 unchanged; o_t read from the patched state; then continue from it
    sl = slice(t + 1, T)
    o_t = _scale(model) * torch.einsum("bhkv,bhk->bhv", S_t, q[:, t])
    rest = kernels.recurrence(q[:, sl], k[:, sl], x[:, sl], g[:, sl], None if a is None else a[:, sl],
                              scale=_scale(model), initial_state=S_t, backend="reference").o
    got = {}
    hooks = StateReplace(0, 1, t, new_state.float()).fwd_hooks()
    hooks.append((hook_name("hook_head_out", 0), lambda o, hook: got.setdefault("o", o)))
    with torch.no_grad():
        patched_logits = model.run_with_hooks(tokens, fwd_hooks=hooks, state_positions=[t])
    o = got["o"].double()
    clean_o = cache[hook_name("hook_head_out", 0)].double()
    assert (o[:, :t] - clean_o[:, :t]).abs().max().item() < 1e-6
    assert (o[:, t] - o_t).abs().max().item() < 1e-5
    assert (o[:, t + 1:] - rest).abs().max().item() < 1e-5
    # the same state put back changes nothing at all
    same = StateReplace(0, 1, t, clean_cache[hook_name("hook_state", 0)][:, 0, 1])
    with torch.no_grad():
        assert torch.allclose(run_with_patches(model, tokens, [same]), model(tokens), atol=1e-6)
        assert not torch.allclose(patched_logits[:, t:], model(tokens)[:, t:], atol=1e-4)


@pytest.mark.parametrize("family", ["gdn", "gla"])
def test_state_patch_lands_on_its_own_position_among_several_requested(family):
    # Issue 10 item 2: with state_positions=[5, 12], StateReplace(position=12) used to patch position 5.
    model = tiny_model(family)
    tokens = _tokens(model)
    K, V = model.cfg.state_shape()
    patch = StateReplace(0, 1, 12, torch.randn(2, K, V, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        clean = model(tokens)
        both = model.run_with_hooks(tokens, fwd_hooks=patch.fwd_hooks(), state_positions=[5, 12])
        alone = run_with_patches(model, tokens, [patch])
    assert torch.equal(both[:, :12], clean[:, :12])                 # nothing before position 12 moves
    assert (both[:, 12:] - clean[:, 12:]).abs().max() > 1e-3
    torch.testing.assert_close(both, alone, rtol=0, atol=1e-5)


def test_state_patch_without_its_position_captured_is_refused():
    model = tiny_model("gdn")
    K, V = model.cfg.state_shape()
    patch = StateReplace(0, 1, 12, torch.zeros(2, K, V))
    with pytest.raises(ValueError, match="state_positions"):
        model.run_with_hooks(_tokens(model), fwd_hooks=patch.fwd_hooks(), state_positions=[5])


def test_two_state_patches_each_carry_forward():
    model = tiny_model("gdn")
    tokens = _tokens(model)
    q, k, x, g, a, _ = _mixer_inputs(model, tokens)
    K, V = model.cfg.state_shape()
    s1, s2 = torch.randn(2, K, V), torch.randn(2, K, V)
    got = {}
    hooks = StateReplace(0, 0, 5, s1).fwd_hooks()

    def second(states, hook):
        states = states.clone()
        states[:, 1, 1] = s2
        return states
    hooks += [(hook_name("hook_state", 0), second),
              (hook_name("hook_head_out", 0), lambda o, hook: got.setdefault("o", o))]
    with torch.no_grad():
        model.run_with_hooks(tokens, fwd_hooks=hooks, state_positions=[5, 12])
    # reference: head 0 continues from s1 after step 5; head 1 from s2 after step 12
    sc = _scale(model)
    full = kernels.recurrence(q, k, x, g, a, scale=sc, capture=[5, 12], backend="reference")
    S5 = full.states[:, 0].clone()
    S5[:, 0] = s1.double()
    mid = kernels.recurrence(q[:, 6:13], k[:, 6:13], x[:, 6:13], g[:, 6:13], a[:, 6:13], scale=sc, initial_state=S5,
                             backend="reference")
    S12 = mid.final_state.clone()
    S12[:, 1] = s2.double()
    tail = kernels.recurrence(q[:, 13:], k[:, 13:], x[:, 13:], g[:, 13:], a[:, 13:], scale=sc, initial_state=S12,
                              backend="reference")
    o = got["o"].double()
    assert (o[:, 6:12] - mid.o[:, :6]).abs().max() < 1e-5
    assert (o[:, 12] - sc * torch.einsum("bhkv,bhk->bhv", S12, q[:, 12])).abs().max() < 1e-5
    assert (o[:, 13:] - tail.o).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["gla", "gdn"])
def test_head_out_patch_changes_only_that_readout(family):
    model = tiny_model(family, layers=1)
    tokens = _tokens(model)
    t = 8
    with torch.no_grad():
        _, clean = model.run_with_cache(tokens, state_positions=[t, T - 1])

        def zero_head(o, hook):
            o = o.clone()
            o[:, t, 0] = 0
            return o
        hooks = [(hook_name("hook_head_out", 0), zero_head)]
        logits_patched = model.run_with_hooks(tokens, fwd_hooks=hooks, state_positions=[t, T - 1])
        logits_clean = model(tokens)
    # one layer: a readout patch at t moves only position t's logits, and the state is untouched
    diff = (logits_patched - logits_clean).abs().amax(-1)
    assert diff[:, t].min() > 0
    assert torch.allclose(torch.cat([diff[:, :t], diff[:, t + 1:]], 1), torch.zeros_like(diff[:, 1:]), atol=1e-6)
    seen = {}
    with torch.no_grad():
        model.run_with_hooks(tokens, state_positions=[t, T - 1], fwd_hooks=hooks + [
            (hook_name("hook_state", 0), lambda s, hook: seen.setdefault("s", s))])
    assert torch.equal(seen["s"], clean[hook_name("hook_state", 0)])


def test_state_hook_rejects_a_wrong_shape():
    model = tiny_model("gla")
    with pytest.raises(ValueError, match="hook_state hook must return shape"):
        model.run_with_hooks(_tokens(model), fwd_hooks=[(hook_name("hook_state", 0), lambda s, hook: s[:, :, :1])],
                             state_positions=[3])


def test_bad_head_and_layer_are_named():
    model = tiny_model("gdn_hybrid")
    with pytest.raises(ValueError, match="head 5 is out of range"):
        model.check_head(0, 5)
    with pytest.raises(ValueError, match="full-attention layer"):
        model.check_head(1, 0)
    with pytest.raises(ValueError, match="layer 7 is out of range"):
        model.check_head(7, 0)
    with pytest.raises(ValueError, match="token ids must lie"):
        model(torch.tensor([[0, 999]]))


@pytest.mark.parametrize("family", ["gla", "qed"])
def test_per_row_masks_equal_the_simple_form_row_by_row(family):
    # Row 0 patches head 0 at positions 3-5, row 1 head 1 at position 9: one masked run against one simple-form
    # run per row.
    from recurscope.hooks import ReadoutReplace, head_mask

    model = tiny_model(family)
    tokens = _tokens(model)
    H = model.n_state_heads
    where = [(0, slice(3, 6)), (1, [9])]
    pos = torch.zeros(2, T, dtype=torch.bool)
    pos[0, 3:6] = True
    pos[1, 9] = True
    mask = head_mask(pos, H, [0]) & torch.tensor([True, False])[:, None, None] | \
        head_mask(pos, H, [1]) & torch.tensor([False, True])[:, None, None]
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens.flip(0))
    key, value = cache[hook_name("hook_write_key", 1)], cache[hook_name("hook_write_value", 1)]
    readout = cache[hook_name("hook_head_out", 1)]
    masked = [WriteScale(0, scale=0.5, mask=mask), WriteReplace(1, key=key, value=value, mask=mask),
              ReadoutReplace(1, value=readout, mask=mask)]
    with torch.no_grad():
        got = run_with_patches(model, tokens, masked)
        for row, (head, p) in enumerate(where):
            simple = [WriteScale(0, head, p, scale=0.5, batch=[row]), WriteReplace(1, head, p, key, value),
                      ReadoutReplace(1, head, p, readout)]
            ref = run_with_patches(model, tokens, simple)
            torch.testing.assert_close(got[row], ref[row], rtol=0, atol=1e-6)
        assert (got - model(tokens)).abs().amax(-1)[1, 9] > 1e-4   # the masks act


def test_patch_forms_are_checked():
    model = tiny_model("gdn")
    with pytest.raises(ValueError, match="either heads and positions"):
        WriteScale(0, 1, 3, mask=torch.ones(2, T, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="either heads and positions"):
        WriteScale(0)
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        WriteScale(0, mask=torch.ones(2, T, 2))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 5, 2\)"):
        run_with_patches(model, _tokens(model), [WriteScale(0, mask=torch.ones(2, 5, 2, dtype=torch.bool))])


def _patch_with_heads(kind, heads, model):
    """A patch of `kind` on layer 0 with `heads`; tensors sized for the model's real head count."""
    from recurscope.hooks import ReadoutReplace

    B, H = 2, model.n_state_heads
    K, V = model.cfg.state_shape()
    return {"WriteScale": lambda: WriteScale(0, heads, 4),
            "ReadoutReplace": lambda: ReadoutReplace(0, heads, 4, torch.zeros(B, T, H, V)),
            "StateReplace": lambda: StateReplace(0, heads, 4, torch.zeros(B, H, K, V)),
            "WriteReplace": lambda: WriteReplace(0, heads, 4, torch.zeros(B, T, H, K), torch.zeros(B, T, H, V))}[kind]()


@pytest.mark.parametrize("kind", ["WriteScale", "ReadoutReplace", "StateReplace", "WriteReplace"])
@pytest.mark.parametrize("heads, pattern", [([0, 5], "head 5 is out of range"), (-1, "head -1 is out of range"),
                                            ([1, 0, 2], "head 2 is out of range"), ([], "heads is empty"),
                                            (["a"], "must be a head index")])
def test_patch_objects_validate_every_head(kind, heads, pattern):
    # every head is checked, not only the first (StateReplace used to check heads[0]; the others gave IndexError)
    model = tiny_model("gla")
    with pytest.raises(ValueError, match=pattern):
        run_with_patches(model, _tokens(model), [_patch_with_heads(kind, heads, model)])
    run_with_patches(model, _tokens(model), [_patch_with_heads(kind, [1, 0], model)])  # valid heads still run
