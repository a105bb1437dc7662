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
