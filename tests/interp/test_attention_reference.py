"""The attention mixer against an independent reference: rotary by complex multiplication and torch's
scaled_dot_product_attention (fla's attention layer needs flash-attn, which has no CPU build)."""
import torch
import torch.nn.functional as F

from recurscope.hooks.points import hook_name
from tests.interp.helpers_models import tiny_model


def _rope_complex(x, base):
    B, T, H, D = x.shape
    freqs = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    half = torch.complex(x[..., : D // 2].double(), x[..., D // 2:].double()) * rot
    return torch.cat([half.real, half.imag], -1)


def test_attention_mixer_matches_sdpa_with_rope_and_grouped_kv():
    model = tiny_model("gdn_hybrid", attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "rope_theta": 500.0})
    mixer = model.blocks[1].mixer
    h = torch.randn(2, 11, 32, dtype=torch.float64)
    mixer.double()
    with torch.no_grad():
        out, _ = mixer(h)
        q = _rope_complex(mixer.q_proj(h).view(2, 11, 4, 8), 500.0)
        k = _rope_complex(mixer.k_proj(h).view(2, 11, 2, 8), 500.0).repeat_interleave(2, dim=2)
        v = mixer.v_proj(h).view(2, 11, 2, 8).repeat_interleave(2, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        ref = mixer.o_proj(o.transpose(1, 2).reshape(2, 11, 32))
    # float32 angle tables (as fla builds them) bound the agreement to ~1e-7 relative
    assert (out - ref).abs().max() < 1e-6


def test_sliding_window_masks_old_keys():
    model = tiny_model("gdn_hybrid", attn={"layers": [1], "num_heads": 2, "window_size": 3})
    pattern = {}
    model.run_with_hooks(torch.randint(0, 61, (1, 8)),
                         fwd_hooks=[(hook_name("hook_pattern", 1), lambda p, hook: pattern.setdefault("p", p))])
    p = pattern["p"][0, 0]
    for t in range(8):
        assert torch.all(p[t, : max(0, t - 2)] == 0) and torch.all(p[t, t + 1:] == 0)
        assert abs(p[t, max(0, t - 2): t + 1].sum().item() - 1) < 1e-6


def test_cached_and_shared_cache_suffix_equals_the_full_run():
    """A suffix after a K/V cache equals the same positions of one full run, with the cache per row and as one row
    expanded over the batch (stride 0: the head scan's shared prefix, scored in one product for all rows); with
    keep_final_state off the layer returns no K/V."""
    from recurscope.interp.models.cache import LayerCache

    model = tiny_model("gdn_hybrid", attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "window_size": 9})
    mixer = model.blocks[1].mixer
    h = torch.randn(1, 15, 32, dtype=torch.float64).expand(3, 15, 32).clone()
    mixer.double()
    with torch.no_grad():
        full, _ = mixer(h)
        _, lc = mixer(h[:, :11])
        per_row, new = mixer(h[:, 11:], lc, offset=11)
        assert new.keys.shape[1] == 15
        shared = lc.map(lambda t: t[:1].expand(3, *t.shape[1:]))
        mixer.keep_final_state = False
        try:
            expanded, none = mixer(h[:, 11:], shared, offset=11)
        finally:
            mixer.keep_final_state = True
    assert none.keys is None
    torch.testing.assert_close(per_row, full[:, 11:], rtol=0, atol=1e-12)
    torch.testing.assert_close(expanded, full[:, 11:], rtol=0, atol=1e-12)
