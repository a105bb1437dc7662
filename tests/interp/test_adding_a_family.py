"""docs/adding_a_family.md's steps, followed alone: a throwaway family (a retention-style mixer with a fixed
per-head decay and no erase) whose mixer and spec exist only in this file, registered in FAMILIES, then built from a
config.json dict, run, hooked, saved and loaded, and state-swapped (the swap continues its prefix cache), with
nothing else in recurscope touched.

The independent reference: the states the family's hook_state reports equal a plain loop of its recurrence,
S_t = exp(g) S_{t-1} + k_t v_t^T, over the q, k, v and g its own hooks saw."""
import dataclasses
import math

import pytest
import torch
import torch.nn as nn

from recurscope.hooks.points import hook_name, names_for
from recurscope.interp import interventions as iv
from recurscope.interp.data import build_pairs
from recurscope.interp.loading import load_model, save_model
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.models.families import FAMILIES, FLA_WEIGHTS, FamilySpec
from recurscope.interp.models.layers import RMSNorm
from recurscope.interp.models.mixers import RecurrentMixer


# ---- step 1: the mixer, by the mixer contract ----------------------------------------------------------------------
class ToyRetentionMixer(RecurrentMixer):
    """Per head: g = log(1 - retention_base^(h + 1)) at every step, no erase, x = v, no output gate."""

    def __init__(self, cfg, layer=0):
        super().__init__(layer)
        del self.hook_erase                       # the family has no erase term
        d, H = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.head_dim = H, d // H
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.o_proj = nn.Linear(d, d, bias=False)
        decay = [math.log(1 - cfg.retention_base ** (h + 1)) for h in range(H)]
        self.register_buffer("log_decay", torch.tensor(decay), persistent=False)

    def forward(self, h, layer_cache=None, state_positions=None):
        B, T, _ = h.shape
        split = lambda t: t.reshape(B, T, self.num_heads, self.head_dim)  # noqa: E731
        q, k = self.hook_q(split(self.q_proj(h))), self.hook_k(split(self.k_proj(h)))
        v = self.hook_v(split(self.v_proj(h)))
        g = self.hook_decay(self.log_decay.expand(B, T, self.num_heads).float())
        init = None if layer_cache is None else layer_cache.state
        o, S = self._recur(q, k, v, g, None, init, state_positions, self.head_dim ** -0.5)
        return self._finish(o, None, layer_cache, S, {})


# ---- step 2: the spec ----------------------------------------------------------------------------------------------
TOY = FamilySpec(
    name="toy_retention", title="a throwaway retention-style family (tests only)", weights=FLA_WEIGHTS,
    config_keys=frozenset({"retention_base"}),
    kernel_inputs={"q": "q_proj", "k": "k_proj", "x": "v = v_proj", "g": "log(1 - base^(h+1)), per head",
                   "a": "none (no erase)"},
    mixer="ToyRetentionMixer", mixer_module=__name__,
    state_shape=lambda cfg: (cfg.hidden_size // cfg.num_heads,) * 2, state_heads=lambda cfg: cfg.num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
    validate=lambda cfg: [] if 0 < cfg.retention_base < 1 else [f"retention_base={cfg.retention_base} (in (0, 1))"],
    option_defaults={"retention_base": 0.5},
)
RAW = dict(model_type="toy_retention", vocab_size=2960, hidden_size=32, num_hidden_layers=2, num_heads=2,
           retention_base=0.25)


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, TOY.name, TOY)
    return TOY


@pytest.fixture
def toy(toy_family, word_tok):
    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig.from_dict(dict(RAW, vocab_size=len(word_tok)))).eval()
    model.tokenizer = word_tok
    return model


def test_the_config_reads_the_familys_own_option_and_refuses_it_elsewhere(toy_family):
    cfg = ModelConfig.from_dict(RAW)
    assert cfg.retention_base == 0.25 and cfg.family is TOY
    assert ModelConfig.from_dict({k: v for k, v in RAW.items() if k != "retention_base"}).retention_base == 0.5
    assert cfg.to_dict()["retention_base"] == 0.25 and ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"retention_base=2 \(in \(0, 1\)\)"):
        ModelConfig.from_dict(dict(RAW, retention_base=2))
    with pytest.raises(ValueError, match=r"retention_base=0.25 \(a toy_retention option\)"):
        ModelConfig.from_dict(dict(RAW, model_type="gla"))
    ModelConfig.from_dict(dict(RAW, model_type="gla", retention_base=0.5))   # another family's default: accepted
    with pytest.raises(ValueError, match="unrecognised config options"):
        ModelConfig.from_dict(dict(RAW, model_type="gla", retention_bass=0.5))


def test_the_model_runs_with_the_familys_hooks_and_its_states_are_its_recurrence(toy, word_tok):
    assert toy.recurrent_layers == [0, 1] and all(isinstance(b.mixer, ToyRetentionMixer) for b in toy.blocks)
    names = names_for(toy)
    assert names <= set(toy.hook_dict) and not any(n.endswith("hook_erase") for n in toy.hook_dict)
    tokens = torch.randint(0, len(word_tok), (2, 12), generator=torch.Generator().manual_seed(1))
    positions = [3, 11]
    with torch.no_grad():
        logits, cache = toy.run_with_cache(tokens, state_positions=positions)
    assert logits.shape == (2, 12, len(word_tok)) and torch.isfinite(logits).all()
    for layer in toy.recurrent_layers:
        q, k, v, g = (cache[hook_name(p, layer)].double() for p in ("hook_q", "hook_k", "hook_v", "hook_decay"))
        S = torch.zeros(2, 2, 16, 16, dtype=torch.float64)
        want = []
        for t in range(12):
            S = g[:, t, :, None, None].exp() * S + k[:, t, :, :, None] * v[:, t, :, None, :]
            if t in positions:
                want.append(S.clone())
        got = cache[hook_name("hook_state", layer)].double()
        torch.testing.assert_close(got, torch.stack(want, 1), atol=1e-5, rtol=1e-5)
        assert g[0, 0].tolist() == pytest.approx([math.log(0.75), math.log(1 - 0.25 ** 2)], abs=1e-6)


def test_save_and_load_round_trip_through_the_spec(toy, tmp_path):
    save_model(toy, tmp_path / "toy")
    back = load_model(tmp_path / "toy")
    assert back.cfg == toy.cfg and back.cfg.retention_base == 0.25
    tokens = torch.arange(20)[None] % toy.cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(back(tokens), toy(tokens))


def test_a_state_swap_on_the_family(toy, word_tok):
    pairs = build_pairs(word_tok, split="dev", n_sources=2, n_facts=2, filler_tokens=12, gap_tokens=4)
    heads = [(0, 0), (1, 1)]
    same = iv.state_swap(toy, dataclasses.replace(pairs, donor_ids=pairs.recipient_ids.clone()), heads)
    torch.testing.assert_close(same.logits, same.clean, atol=2e-5, rtol=0)
    swap = iv.state_swap(toy, pairs, heads)
    assert (swap.logits - swap.clean).abs().max() > 1e-4
    # the swap is the suffix run from the recipient's prefix cache with the donor's state put in by hand
    b = int(pairs.query_start[0]) - 1
    row = pairs.select([0])
    with torch.no_grad():
        rec = toy.run_prefix(row.recipient_ids[:, :b + 1])
        don = toy.run_prefix(row.donor_ids[:, :b + 1])
        for layer, head in heads:
            rec.set_head_state(layer, head, don.head_state(layer, head))
        logits, _ = toy.run_suffix(row.recipient_ids[:, b + 1:], rec)
    by_hand = logits[0, int(row.query_pos[0]) - b - 1].gather(0, row.candidate_ids[0])
    torch.testing.assert_close(swap.logits[0], by_hand, atol=1e-5, rtol=0)
