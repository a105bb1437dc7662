"""GLA with query groups (GLA-7B: num_kv_heads < num_heads, one state read by m query heads; issue 31, item 3): the
intervenable "head" is the state group. Each intervention on a group is checked against a hand edit written here
with plain forward hooks and the cache, not through the patch classes it uses."""
import pytest
import torch

from helpers_models import tiny_model
from recurscope.hooks.points import hook_name
from recurscope.interp import interventions as iv
from recurscope.interp.data import build_pairs

GROUP = 2


@pytest.fixture(scope="module")
def pairs(word_tok):
    return build_pairs(word_tok, split="dev", n_sources=3, n_facts=2, filler_tokens=12, gap_tokens=4)


@pytest.fixture(scope="module")
def model(word_tok):
    # 4 query heads in 2 state groups of 2 (head_k 4, head_v 8)
    return tiny_model("gla_conv", layers=2, vocab_size=len(word_tok), num_heads=4, num_kv_heads=2)


def cand(pairs, i, logits_row):
    return logits_row.gather(0, pairs.candidate_ids[i])


def test_the_heads_are_state_groups_and_the_hooks_say_which(model, pairs):
    assert model.n_state_heads == 2 and model.query_group == GROUP and model.heads() == [(0, 0), (0, 1), (1, 0),
                                                                                          (1, 1)]
    assert model.query_heads(1) == [2, 3]
    _, cache = model.run_with_cache(pairs.recipient_ids[:1], state_positions=[5])
    assert cache[hook_name("hook_state", 0)].shape[2] == 2             # state groups
    assert cache[hook_name("hook_k", 0)].shape[2] == 2
    assert cache[hook_name("hook_write_scale", 0)].shape[2] == 2
    assert cache[hook_name("hook_q", 0)].shape[2] == 4                 # query heads
    assert cache[hook_name("hook_head_out", 0)].shape[2] == 4
    assert cache[hook_name("hook_z", 0)].shape[2] == 4
    # the two query heads of a group read one state: o = scale S^T q for each, from the one captured state
    S = cache[hook_name("hook_state", 0)][0, 0].double()               # (H, K, V) after step 5
    q = cache[hook_name("hook_q", 0)][0, 5].double()                   # (H_q, K)
    o = cache[hook_name("hook_head_out", 0)][0, 5].double()
    scale = model.blocks[0].mixer.head_k ** -0.5
    for qh in range(4):
        torch.testing.assert_close(o[qh], scale * S[qh // GROUP].T @ q[qh], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", [(0, 1), (1, 0)])
def test_a_group_state_swap_equals_a_hand_edit_of_the_shared_state(model, pairs, head):
    layer, h = head
    r = iv.state_swap(model, pairs, [head])
    for i in range(len(pairs)):
        b, qp = int(pairs.query_start[i]) - 1, int(pairs.query_pos[i])
        rec, don = pairs.recipient_ids[i:i + 1], pairs.donor_ids[i:i + 1]
        with torch.no_grad():
            _, rc = model(rec[:, :b + 1], use_cache=True)
            _, dc = model(don[:, :b + 1], use_cache=True)
            state = rc.layers[layer].state.clone()
            state[:, h] = dc.layers[layer].state[:, h]                 # the group's one state, read by both queries
            rc.layers[layer].state = state
            logits, _ = model(rec[:, b + 1:qp + 1], cache=rc, use_cache=True)
        torch.testing.assert_close(r.logits[i], cand(pairs, i, logits[0, -1]), atol=2e-5, rtol=0)
    assert (r.logits - r.clean).abs().max() > 1e-4                   # not vacuous


def test_a_group_output_patch_replaces_all_its_query_heads(model, pairs):
    layer, h = 1, 1
    r = iv.output_patch(model, pairs, [(layer, h)])
    name = hook_name("hook_head_out", layer)
    for i in range(len(pairs)):
        lo, qp = int(pairs.query_start[i]), int(pairs.query_pos[i])
        rec, don = pairs.recipient_ids[i:i + 1], pairs.donor_ids[i:i + 1]
        _, dc = model.run_with_cache(don, names_filter=name)
        donor_o = dc[name]

        def hook(o, hook):
            o = o.clone()
            o[:, lo:qp + 1, h * GROUP:(h + 1) * GROUP] = donor_o[:, lo:qp + 1, h * GROUP:(h + 1) * GROUP]
            return o
        with torch.no_grad(), model.hooks(fwd_hooks=[(name, hook)]):
            logits = model(rec)
        torch.testing.assert_close(r.logits[i], cand(pairs, i, logits[0, qp]), atol=2e-5, rtol=0)


def test_a_group_write_block_zeroes_the_groups_write_on_the_span(model, pairs):
    layer, h = 0, 0
    r = iv.write_block(model, pairs, [(layer, h)])
    spans = iv.resolve_spans(pairs, "fact")
    for i in range(len(pairs)):
        T = pairs.recipient_ids.shape[1]
        mask = iv.span_mask(spans[i:i + 1], T)[0]

        def hook(ws, hook):
            ws = ws.clone()
            ws[0, mask, h] = 0.0
            return ws
        with torch.no_grad(), model.hooks(fwd_hooks=[(hook_name("hook_write_scale", layer), hook)]):
            logits = model(pairs.recipient_ids[i:i + 1])
        torch.testing.assert_close(r.logits[i], cand(pairs, i, logits[0, int(pairs.query_pos[i])]), atol=2e-5, rtol=0)


def test_a_group_output_restore_undoes_its_state_swap(model, pairs):
    r = iv.output_restore(model, pairs, [(0, 1)])
    torch.testing.assert_close(r.logits, r.clean, atol=2e-5, rtol=0)


def test_readout_analyses_refuse_query_groups(model, pairs):
    from recurscope.interp.attribution import attribute_readout
    from recurscope.interp.protocols.reuse import edit_deltas

    with pytest.raises(ValueError, match="read by 2 query heads"):
        attribute_readout(model, pairs.recipient_ids[0], 0, 0, 5)
    with pytest.raises(ValueError, match="read by 2 query heads"):
        edit_deltas(model, pairs, (0, 0))


def test_the_scan_ranks_state_groups_and_matches_the_naive_scan(model, pairs):
    """The growing-batch scan against one full patched forward per group (scan.naive_head_shifts, whose readout
    restore now covers the group's query heads): one row per (example, state group)."""
    import numpy as np

    from recurscope.interp import scan

    fast = scan.run_scan(model, pairs, batch_size=3).rows.set_index(["row", "layer", "head"]).sort_index()
    slow = scan.naive_head_shifts(model, pairs).set_index(["row", "layer", "head"]).sort_index()
    assert fast.index.equals(slow.index) and sorted(set(h for _, _, h in fast.index)) == [0, 1]
    np.testing.assert_allclose(fast["shift"], slow["shift"], atol=2e-5, rtol=0)
    assert fast["shift"].abs().max() > 1e-4


def test_the_report_says_a_head_is_a_group_of_query_heads(model):
    """The run records the loaded model's query group in the manifest's extra; the report reads that record only."""
    from recurscope.interp.report import recorded_query_group

    assert model.query_group == 2 and recorded_query_group({"query_group": model.query_group}) == 2
    assert recorded_query_group({}) == 1 and recorded_query_group({"query_group": 1}) == 1
    for crafted in (0, -3, 2.5, "4", True, None):     # not a positive integer: no group is claimed
        assert recorded_query_group({"query_group": crafted}) == 1, crafted


def test_readout_labels_name_the_group_and_the_query(model, pairs):
    _, cache = model.run_with_cache(pairs.recipient_ids[:1])
    per_head, labels = cache.stack_head_readouts(return_labels=True)
    assert labels[:4] == ["L0H0q0", "L0H0q1", "L0H1q0", "L0H1q1"] and per_head.shape[0] == 8
