"""Rows of different lengths run packed (cu_seqlens) through the model, the head scan and the confirmation, and give
what each row gives alone: the packed forward against one forward per sequence (native families and the bridged
Qwen3.5), a state patch next to a sequence boundary carrying forward within its own sequence only, a cache of
per-row lengths continuing each row as its own, and the scan's and confirmation's rows against a loop over rows, each
run alone at its natural length (lengths 5.6x apart, on a hybrid with attention too)."""
from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
import torch
from helpers_models import tiny_model

from recurscope.hooks import StateReplace, run_with_patches
from recurscope.interp import scan
from recurscope.interp.confirm import confirm_arm
from recurscope.interp.data.recall import PairBatch, iter_pairs
from recurscope.interp.models.protocol import pack_rows

LENGTHS = (5, 13, 2, 9)
NATIVE = [("gdn", dict(use_short_conv=True)), ("gdn_hybrid", {}), ("gla", dict(num_kv_heads=1, use_short_conv=True)),
          ("mamba2", {})]


def _rows(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g) for n in LENGTHS]


def _check_packed_forward(m, vocab, atol):
    rows = _rows(vocab)
    tokens, cu = pack_rows(rows)
    logits, cache = m(tokens, cu_seqlens=cu, use_cache=True)
    assert cache.lengths.tolist() == list(LENGTHS) and cache.batch_size == len(rows)
    suffix = torch.randint(4, vocab, (len(rows), 3), generator=torch.Generator().manual_seed(1))
    after, _ = m(suffix, cache=cache, use_cache=True)      # every row continues from its own length
    for i, r in enumerate(rows):
        alone, own = m(r[None], use_cache=True)
        torch.testing.assert_close(logits[0, cu[i]:cu[i + 1]], alone[0], atol=atol, rtol=0)
        for lc, mine in zip(cache.layers, own.layers):
            if lc.state is not None:
                torch.testing.assert_close(lc.state[i], mine.state[0], atol=atol, rtol=0)
            for key in lc.conv:
                torch.testing.assert_close(lc.conv[key][i], mine.conv[key][0], atol=atol, rtol=0)
        whole = m(torch.cat([r, suffix[i]])[None])
        torch.testing.assert_close(after[i], whole[0, -3:], atol=atol, rtol=0)


@pytest.mark.parametrize("family,kw", NATIVE, ids=[f for f, _ in NATIVE])
def test_packed_forward_equals_each_sequence_alone(family, kw):
    _check_packed_forward(tiny_model(family, layers=2, **kw).double(), 61, 1e-9)


def test_packed_attention_with_a_pattern_hook_is_block_diagonal():
    """Without a hook the native attention runs each packed sequence apart; a hook on hook_pattern sees the whole
    row's block-diagonal pattern (zero across sequences) and the logits are the same."""
    m = tiny_model("gdn_hybrid", layers=2).double()
    tokens, cu = pack_rows(_rows(61))
    seen = {}

    def keep(pattern, hook):
        seen["p"] = pattern
        return pattern

    plain = m(tokens, cu_seqlens=cu)
    hooked = m.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mixer.hook_pattern", keep)], cu_seqlens=cu)
    torch.testing.assert_close(hooked, plain, atol=1e-12, rtol=0)
    p = seen["p"][0, 0]
    assert p.shape == (cu[-1], cu[-1]) and float(p[cu[1]:, :cu[1]].abs().max()) == 0.0


@pytest.mark.parametrize("family,kw", NATIVE[:2], ids=[f for f, _ in NATIVE[:2]])
def test_a_state_patch_at_a_boundary_stays_in_its_sequence(family, kw):
    """Patches at the last step of sequence 0 and the first of sequence 1: sequence 0's outputs after it are
    unchanged (it is its last step), sequence 1 continues from its patched state, sequences 2 and 3 are untouched;
    each equals the same patch on the sequence alone."""
    m = tiny_model(family, layers=2, **kw).double()
    rows = _rows(61)
    tokens, cu = pack_rows(rows)
    layer = m.recurrent_layers[0]
    H, (K, V) = m.n_state_heads, m.cfg.state_shape()
    g = torch.Generator().manual_seed(3)
    s0, s1 = (torch.randn(1, K, V, generator=g, dtype=torch.float64) for _ in range(2))
    packed = run_with_patches(m, tokens, [StateReplace(layer, [1], cu[1] - 1, s0), StateReplace(layer, [0], cu[1], s1)],
                              cu_seqlens=cu)
    alone = [run_with_patches(m, rows[0][None], [StateReplace(layer, [1], LENGTHS[0] - 1, s0)]),
             run_with_patches(m, rows[1][None], [StateReplace(layer, [0], 0, s1)]),
             m(rows[2][None]), m(rows[3][None])]
    for i, want in enumerate(alone):
        torch.testing.assert_close(packed[0, cu[i]:cu[i + 1]], want[0], atol=1e-9, rtol=0)
    clean = m(tokens, cu_seqlens=cu)
    assert not torch.allclose(clean[0, cu[1]:cu[2]], packed[0, cu[1]:cu[2]])      # the patch moved sequence 1


def ragged_pairs(tok):
    """Four target rows from two layouts, 43 and 243 tokens long: a batch whose rows are left-padded by 200."""
    made = []
    for j, filler in enumerate((0, 200)):
        for p in iter_pairs(tok, "dev", 2, filler_tokens=filler, gap_tokens=4, presentations=1, seed=j):
            made.append(dataclasses.replace(p, source_id=p.source_id + 10 * j, group=p.group + 10 * j))
    return PairBatch.collate(made, 0)


def _sorted(frame, key):
    return frame.sort_values(list(key)).reset_index(drop=True)


def _check_scan_and_confirm(m, pairs, atol, arms):
    assert pairs.is_ragged() and int(pairs.row_lengths().max()) >= 2 * int(pairs.row_lengths().min())
    key = ("source", "pair", "layer", "head")
    got = _sorted(scan.scan_rows(m, pairs), key)
    want = _sorted(pd.concat([scan.scan_rows(m, pairs.select([i]).trimmed()) for i in range(len(pairs))]), key)
    for col in ("clean_margin", "margin", "shift"):
        assert (got[col] - want[col]).abs().max() <= atol, col
    assert got["shift"].abs().max() > 100 * atol          # the swaps move the margins
    heads = [m.heads()[0], m.heads()[-1]]
    for arm in arms:
        got = confirm_arm(m, pairs, heads, arm)
        want = pd.concat([confirm_arm(m, pairs.select([i]).trimmed(), heads, arm, row_ids=[i])
                          for i in range(len(pairs))]).reset_index(drop=True)
        assert got["row"].tolist() == want["row"].tolist()
        for col in ("clean_margin", "margin", "donor_margin_shift"):
            assert (got[col] - want[col]).abs().max() <= atol, (arm, col)


ARMS = ("state_swap", "output_patch", "random_update", "write_block", "donor_write")


@pytest.mark.parametrize("family", ["gdn", "gdn_hybrid"])
def test_scan_and_confirm_rows_of_different_lengths_equal_each_row_alone(word_tok, family):
    m = tiny_model(family, layers=3, vocab_size=len(word_tok), use_short_conv=True).double()
    _check_scan_and_confirm(m, ragged_pairs(word_tok), 1e-10, ARMS)


def test_packed_rows_on_the_bridged_qwen35(word_tok, tmp_path):
    from test_bridge import _build, _randomise

    from recurscope.interp.data import save_word_tokenizer
    from recurscope.interp.loading import load_model

    torch.manual_seed(0)
    hf, _ = _build("qwen3_5_dense", len(word_tok))      # 3 Gated DeltaNet layers (GVA), then attention
    _randomise(hf, 0)
    hf.save_pretrained(tmp_path)
    save_word_tokenizer(word_tok, tmp_path)
    m = load_model(tmp_path).double()
    # transformers' rotary tables and our attention's softmax are float32 in a float64 model
    _check_packed_forward(m, len(word_tok), 1e-5)
    # a hook on the attention pattern sees the block-diagonal row; without one each sequence is attended apart
    tokens, cu = pack_rows(_rows(len(word_tok)))
    hooked = m.run_with_hooks(tokens, fwd_hooks=[("blocks.3.mixer.hook_pattern", lambda p, hook: p)], cu_seqlens=cu)
    torch.testing.assert_close(hooked, m(tokens, cu_seqlens=cu), atol=1e-5, rtol=0)
    _check_scan_and_confirm(m, ragged_pairs(word_tok), 1e-5, ("state_swap", "write_block"))


def test_packed_calls_refuse_what_they_cannot_run():
    m = tiny_model("gdn", layers=2)
    tokens, cu = pack_rows(_rows(61))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        m(tokens, cu_seqlens=[0, 5, 3, tokens.shape[1]])
    with pytest.raises(ValueError, match=r"shape \(1, T\)"):
        m(tokens.expand(2, -1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="start from no cache"):
        m(tokens, cu_seqlens=cu, cache=m.run_prefix(tokens))
    with pytest.raises(ValueError, match="across sequence boundaries"):
        m(tokens, cu_seqlens=cu, return_type="loss")
    with pytest.raises(ValueError, match="not supported for rwkv7"):
        tiny_model("rwkv7", layers=1)(tokens, cu_seqlens=cu)


def test_natural_length_pairs_from_a_real_tokenizer(real_tok):
    """equal_length=False keeps each prompt at its tokenizer's own length (no filler word added or dropped to reach
    the planned count): here the rows differ (a BPE merges across filler borders), they are left-padded to the
    longest with the pad id and `lengths` says how long each is; a row cut to its length (trimmed) keeps its query
    at its end. The default still gives one length."""
    from recurscope.interp.data import build_pairs
    from recurscope.interp.data.recall import _pad_id

    kw = dict(split="dev", n_sources=6, filler_tokens=40, gap_tokens=12, presentations=2)
    natural = build_pairs(real_tok, equal_length=False, **kw)
    equal = build_pairs(real_tok, **kw)
    assert equal.row_lengths().unique().numel() == 1 and not equal.is_ragged()
    assert natural.is_ragged()
    T = natural.recipient_ids.shape[1]
    for i, length in enumerate(natural.row_lengths().tolist()):
        assert (natural.recipient_ids[i, :T - length] == _pad_id(real_tok)).all()
        alone = natural.select([i]).trimmed()
        assert alone.recipient_ids.shape[1] == length and int(alone.query_pos[0]) == length - 1
        assert torch.equal(alone.recipient_ids[0], natural.recipient_ids[i, T - length:])
        assert int(alone.query_start[0]) == int(natural.query_start[i]) - (T - length)
    with pytest.raises(ValueError, match="equal_length must be True or False"):
        build_pairs(real_tok, equal_length="yes", **kw)
