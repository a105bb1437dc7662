"""The controls that isolate the donor: equal-norm random writes (value and rank-one), the write block widened by
the short convolution's reach, and the confirmation arms that run them."""
import dataclasses

import pytest
import torch

from helpers_models import tiny_model
from recurscope.hooks.patches import patch_hooks
from recurscope.hooks.points import hook_name
from recurscope.interp import interventions as iv
from recurscope.interp.confirm import ARMS, CONTROLS, run_confirm
from recurscope.interp.data import build_pairs, build_word_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_word_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("gla_conv", layers=2, vocab_size=len(tok))


@pytest.fixture(scope="module")
def pairs(tok):
    return build_pairs(tok, split="dev", n_sources=3, n_facts=2, filler_tokens=12, gap_tokens=4)


def test_random_value_write_is_zero_where_donor_and_recipient_agree(model, pairs):
    same = dataclasses.replace(pairs, donor_ids=pairs.recipient_ids.clone())
    r = iv.random_write(model, same, [(0, 1)], variant="value")
    torch.testing.assert_close(r.logits, r.clean, atol=0, rtol=0)
    moved = iv.random_write(model, pairs, [(0, 1)], variant="value")
    assert (moved.logits - moved.clean).abs().max() > 1e-6


@pytest.mark.parametrize("variant", iv.RANDOM_WRITE_VARIANTS)
def test_random_write_does_not_depend_on_batching_and_seed_matters(model, pairs, variant):
    a = iv.random_write(model, pairs, [(0, 1)], variant=variant, batch_size=1)
    b = iv.random_write(model, pairs, [(0, 1)], variant=variant, batch_size=3)
    torch.testing.assert_close(a.logits, b.logits, atol=2e-5, rtol=0)
    c = iv.random_write(model, pairs, [(0, 1)], variant=variant, seed=1)
    assert (a.logits - c.logits).abs().max() > 1e-7


def test_rank_one_random_write_has_the_donor_write_norms(model, pairs):
    """Captured after the patch: on the spans, ||u'|| = ||u_donor|| and ||x'|| = ||x_donor|| per position and head."""
    seen = {}

    def keep(t, hook):
        seen[hook.name] = t.detach().clone()
    names = [hook_name("hook_write_key", 0), hook_name("hook_write_value", 0)]
    donor = {}
    with model.hooks(fwd_hooks=[(n, lambda t, hook: donor.__setitem__(hook.name, t.detach().clone())) for n in names]):
        model(pairs.donor_ids)
    # the spec's patches for the whole batch, our capture hooks added after them, so that they see the patched write
    spec = iv.random_write_spec(model, pairs, [(0, 1)], variant="rank_one")
    mask = iv.span_mask(spec.spans, pairs.recipient_ids.shape[1])
    patches = spec.patches(torch.arange(len(pairs)), mask, pairs.recipient_ids.device)
    with model.hooks(fwd_hooks=patch_hooks(model, patches) + [(n, keep) for n in names]):
        model(pairs.recipient_ids)
    assert torch.equal(mask, iv.span_mask(iv.resolve_spans(pairs, "fact"), pairs.recipient_ids.shape[1]))
    for name in names:
        got = seen[name][:, :, 1].norm(dim=-1)[mask]
        want = donor[name][:, :, 1].norm(dim=-1)[mask]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_spans_with_conv_tail(model, pairs, tok):
    fact = iv.resolve_spans(pairs, "fact")
    wide = iv.spans_with_conv_tail(model, pairs)
    reach = model.cfg.conv_size - 1
    assert torch.equal(wide[..., 0], fact[..., 0])
    assert torch.equal(wide[..., 1], torch.minimum(fact[..., 1] + reach, pairs.query_start[:, None]))
    no_conv = tiny_model("gla", layers=2, vocab_size=len(tok))
    assert torch.equal(iv.spans_with_conv_tail(no_conv, pairs), fact)
    # blocking the wider span is write_block on that span
    torch.testing.assert_close(iv.write_block(model, pairs, [(0, 1)], spans=wide).logits,
                               iv.write_block(model, pairs, [(0, 1)], spans=wide.clone()).logits, atol=0, rtol=0)


def test_confirm_runs_every_control(model, pairs):
    result = run_confirm(model, pairs, [(0, 1)], n_resamples=200)
    assert set(result.rows["intervention"]) == set(ARMS)
    assert all(c in ARMS for controls in CONTROLS.values() for c in controls)
    metrics = set(result.summary["metric"])
    assert {"donor_specific_shift", "distractor_shift"} <= metrics
