"""Tiny random models of every family, shared by the model tests."""
import torch

from recurscope.interp.models import ModelConfig, RecurrentLM

FAMILIES = {
    "gla": dict(model_type="gla", expand_k=0.5, expand_v=1.0),
    "gla_conv": dict(model_type="gla", use_short_conv=True),
    "gdn": dict(model_type="gated_deltanet", head_dim=16, expand_v=2),
    "gdn2": dict(model_type="gated_deltanet2", head_dim=16, expand_v=1),
    "qed": dict(model_type="gated_deltanet2", head_dim=16, expand_v=1, erase_arm="full"),
    "gdn_hybrid": dict(model_type="gated_deltanet", head_dim=16, attn={"layers": [1], "num_heads": 2}),
    # 8 heads of 8 channels (expand 2 x 32 / 8) in 2 groups of B and C, each state 8 x 8 (N x P)
    # dt in [0.5, 1] and A in [0.01, 0.1] (fla: dt in [0.001, 0.1], A in [1, 16]): a random model writes visibly
    # into its states and remembers for tens of steps, so that a state swap moves the logits
    "mamba2": dict(model_type="mamba2", head_dim=8, num_heads=8, state_size=8, expand=2, n_groups=2, dt_min=0.5,
                   dt_max=1.0, A_init_range=[0.01, 0.1]),
    # 2 heads of 16 channels, small LoRAs; every weight is moved off its init in tiny_model (fla's init zeroes
    # o_proj and the feed-forward's value, which would make a random model ignore its states)
    "rwkv7": dict(model_type="rwkv7", head_dim=16, hidden_act="sqrelu", decay_low_rank_dim=8, gate_low_rank_dim=8,
                  a_low_rank_dim=8, v_low_rank_dim=8),
}


def tiny_model(family: str, layers: int = 2, seed: int = 0, **overrides) -> RecurrentLM:
    torch.manual_seed(seed)
    raw = dict(vocab_size=61, hidden_size=32, num_hidden_layers=layers, num_heads=2)
    raw.update(FAMILIES[family])
    raw.update(overrides)
    model = RecurrentLM(ModelConfig.from_dict(raw)).eval()
    if raw["model_type"] == "rwkv7":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
    if raw["model_type"] == "gated_deltanet2" and raw.get("erase_arm", "gdn2") != "gdn2":
        with torch.no_grad():  # a visible lam, so QED differs from GDN-2 in the tests
            for b in model.blocks:
                if hasattr(b.mixer, "qed_theta"):
                    b.mixer.qed_theta.uniform_(-1, 1)
    return model


def assert_steps_equal_the_full_run(model, tokens, atol: float = 1e-5):
    """Token by token through the model's cache == one forward over all of `tokens`: the logits, and every layer's
    final state."""
    with torch.no_grad():
        full, full_cache = model(tokens, use_cache=True)
        cache, steps = None, []
        for t in range(tokens.shape[1]):
            step, cache = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(step)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=atol, rtol=atol)
    for a, b in zip(cache.layers, full_cache.layers):
        torch.testing.assert_close(a.state, b.state, atol=atol, rtol=atol)


def assert_write_block_is_the_state_edit_that_removes_it(model, layer: int, head: int, p: int):
    """Blocking head h's write at step p (WriteScale 0) == replacing S_p by S_p - hook_write_key_p
    hook_write_value_p^T there: the write is exactly that outer product, and the block carries forward (and moves
    the logits)."""
    from recurscope.hooks import StateReplace, WriteScale, hook_name, run_with_patches

    tokens = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, c = model.run_with_cache(tokens, state_positions=[p])
        S = c[hook_name("hook_state", layer)][:, 0, head]
        write = torch.einsum("bk,bv->bkv", c[hook_name("hook_write_key", layer)][:, p, head],
                             c[hook_name("hook_write_value", layer)][:, p, head])
        blocked = run_with_patches(model, tokens, [WriteScale(layer, [head], [p], 0.0)])
        edited = run_with_patches(model, tokens, [StateReplace(layer, [head], p, S - write)])
    torch.testing.assert_close(blocked, edited, atol=1e-5, rtol=1e-5)
    assert (blocked - model(tokens)).abs().max() > 1e-4


def output_of(module, model, tokens):
    """What `module` (a projection inside `model`) returns in a forward of `tokens`: the model's own value."""
    got = {}
    handle = module.register_forward_hook(lambda m, args, out: got.setdefault("out", out.detach()))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        handle.remove()
    return got["out"]
