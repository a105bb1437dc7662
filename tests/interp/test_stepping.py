"""Stepping is exact: prefix then suffix from the cache, and token-by-token decoding, equal the full run;
editing one head's cached state changes only what depends on it."""
import pytest
import torch

from tests.interp.helpers_models import FAMILIES, tiny_model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("split", [1, 7, 16])
def test_prefix_then_suffix_equals_full(family, split):
    model = tiny_model(family)
    tokens = torch.randint(0, 61, (2, 23), generator=torch.Generator().manual_seed(split))
    with torch.no_grad():
        full, full_cache = model(tokens, use_cache=True)
        a, cache = model(tokens[:, :split], use_cache=True)
        b, cache = model(tokens[:, split:], cache=cache, use_cache=True)
    assert (torch.cat([a, b], 1) - full).abs().max() < 1e-5
    for mine, ref in zip(cache.layers, full_cache.layers):
        if mine.state is not None:
            assert (mine.state - ref.state).abs().max() < 1e-5


@pytest.mark.parametrize("family", ["gla_conv", "gdn", "qed", "gdn_hybrid"])
def test_token_by_token_equals_full(family):
    model = tiny_model(family)
    tokens = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache, steps = None, []
        for t in range(tokens.shape[1]):
            out, cache = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5


def test_editing_one_head_changes_only_that_head():
    model = tiny_model("gdn", layers=2)
    tokens = torch.randint(0, 61, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = model(tokens[:, :9], use_cache=True)
        edited = cache.clone()
        edited.set_head_state(1, 0, torch.zeros_like(edited.head_state(1, 0)))
        # the clone is independent of the original
        assert not torch.equal(cache.head_state(1, 0), edited.head_state(1, 0))
        _, c_clean = model(tokens[:, 9:], cache=cache, use_cache=True)
        _, c_edit = model(tokens[:, 9:], cache=edited, use_cache=True)
    # layer 0 never sees layer 1's state; in layer 1, head 1 keeps its own (unedited) state history
    assert torch.equal(c_clean.layers[0].state, c_edit.layers[0].state)
    assert not torch.allclose(c_clean.layers[1].state[:, 0], c_edit.layers[1].state[:, 0])


def test_swap_from_takes_only_the_chosen_heads_and_parts():
    model = tiny_model("gla_conv")
    g = torch.Generator().manual_seed(2)
    a_tok, b_tok = torch.randint(0, 61, (1, 8), generator=g), torch.randint(0, 61, (1, 8), generator=g)
    with torch.no_grad():
        _, ca = model(a_tok, use_cache=True)
        _, cb = model(b_tok, use_cache=True)
    swapped = ca.swap_from(cb, layers=[1], heads=[0])
    assert torch.equal(swapped.head_state(1, 0), cb.head_state(1, 0))
    assert torch.equal(swapped.head_state(1, 1), ca.head_state(1, 1))
    assert torch.equal(swapped.layers[0].state, ca.layers[0].state)
    assert all(torch.equal(swapped.layers[1].conv[n], ca.layers[1].conv[n]) for n in ca.layers[1].conv)
    with_conv = ca.swap_from(cb, layers=[1], parts=("state", "conv"))
    assert all(torch.equal(with_conv.layers[1].conv[n], cb.layers[1].conv[n]) for n in cb.layers[1].conv)
    with pytest.raises(ValueError, match="head 9 is out of range"):
        ca.swap_from(cb, layers=[0], heads=[9])
    short = model(a_tok[:, :5], use_cache=True)[1]
    with pytest.raises(ValueError, match="same batch size and length"):
        ca.swap_from(short)


def test_batched_cache_rows_match_single_runs():
    model = tiny_model("gdn_hybrid")
    tokens = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = model(tokens[:, :6], use_cache=True)
        rep = cache.select([2, 2, 0])
        out, _ = model(tokens[[2, 2, 0], 6:], cache=rep, use_cache=True)
        full = model(tokens)
    assert (out - full[[2, 2, 0], 6:]).abs().max() < 1e-5
