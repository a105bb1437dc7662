"""Tests for interp.scan: the batched scan equals one full patched forward per head, J is the mean over sources of
per-source mean shifts, and an interrupted scan resumes from its row log without duplicates or lost rows."""
import numpy as np
import pandas as pd
import pytest

from helpers_models import FAMILIES, tiny_model
from recurscope.interp import scan
from recurscope.interp.data import build_pairs
from recurscope.interp.results import RunDir

ATOL = 2e-5


@pytest.fixture(scope="module")
def pairs(word_tok):
    return build_pairs(word_tok, split="dev", n_sources=3, pairs_per_source=2, n_facts=2, filler_tokens=16,
                       gap_tokens=4)


def keyed(frame):
    return frame.set_index(list(scan.SCAN_KEY)).sort_index()


@pytest.mark.parametrize("family", ["gla_conv", "qed", "gdn_hybrid"])
def test_batched_scan_equals_one_full_forward_per_head(word_tok, pairs, family):
    m = tiny_model(family, layers=3, vocab_size=len(word_tok), use_short_conv=True) if family != "gla_conv" else \
        tiny_model(family, layers=3, vocab_size=len(word_tok))
    fast = scan.run_scan(m, pairs, batch_size=5)
    slow = scan.naive_head_shifts(m, pairs)
    assert len(fast.rows) == len(slow) == len(pairs) * len(scan.all_heads(m))
    a, b = keyed(fast.rows), keyed(slow)
    assert a.index.equals(b.index)
    np.testing.assert_allclose(a["shift"], b["shift"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(a["clean_margin"], b["clean_margin"], atol=ATOL, rtol=0)
    assert a["shift"].abs().max() > 1e-4            # the heads do something, so the comparison has teeth


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_growing_batch_scan_equals_naive_scan_on_every_family(word_tok, pairs, family):
    """The growing batch (rows join at their patched layer, logits at the query position only) against one full
    patched forward per head, to 1e-5, on every bundled family, hybrids included; batch_size splits layers."""
    m = tiny_model(family, layers=3, vocab_size=len(word_tok))
    fast = keyed(scan.run_scan(m, pairs, batch_size=4, prefix_batch=2).rows)
    slow = keyed(scan.naive_head_shifts(m, pairs))
    assert fast.index.equals(slow.index)
    np.testing.assert_allclose(fast["shift"], slow["shift"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(fast["clean_margin"], slow["clean_margin"], atol=1e-5, rtol=0)
    assert fast["shift"].abs().max() > 1e-4


def test_scores_ranks_wins_and_winner_from_hand_computation(word_tok, pairs):
    m = tiny_model("qed", layers=2, vocab_size=len(word_tok))
    res = scan.run_scan(m, pairs, batch_size=3, prefix_batch=2)
    per_source = res.rows.groupby(["source", "layer", "head"])["shift"].mean()
    J = per_source.groupby(["layer", "head"]).mean()
    got = res.heads.set_index(["layer", "head"])["J"].sort_index()
    np.testing.assert_allclose(got.to_numpy(), J.sort_index().to_numpy(), rtol=0, atol=1e-12)
    assert res.winner == J.idxmax()
    assert list(res.heads["J"]) == sorted(res.heads["J"], reverse=True)
    # ranks per source: 1 for the head with the largest source score
    for source, grp in res.ranks.groupby("source"):
        top = grp.loc[grp["score"].idxmax()]
        assert top["rank"] == 1
    wins = res.ranks[res.ranks["rank"] == 1].groupby(["layer", "head"]).size()
    for (l, h), w in wins.items():
        assert int(res.heads.set_index(["layer", "head"]).loc[(l, h), "wins"]) == w
    assert res.heads["wins"].sum() >= pairs.source_id.unique().numel()
    assert res.loso is not None and res.loso.winner == res.winner and res.loso.n_sources == 3


def test_batch_sizes_and_head_subsets_agree(word_tok, pairs):
    m = tiny_model("gla", layers=2, vocab_size=len(word_tok))
    full = keyed(scan.run_scan(m, pairs, batch_size=96).rows)
    one = keyed(scan.run_scan(m, pairs, batch_size=1, prefix_batch=1).rows)
    np.testing.assert_allclose(full["shift"], one["shift"], atol=ATOL, rtol=0)
    sub = keyed(scan.run_scan(m, pairs, heads=[(1, 0)]).rows)
    np.testing.assert_allclose(sub["shift"], full.xs((1, 0), level=("layer", "head"), drop_level=False)["shift"],
                               atol=ATOL, rtol=0)


class Interrupt(Exception):
    pass


def test_scan_resumes_after_an_interruption_without_duplicates(word_tok, pairs, tmp_path):
    m = tiny_model("qed", layers=2, vocab_size=len(word_tok))
    reference = scan.run_scan(m, pairs, batch_size=3)
    total = len(reference.rows)

    run = RunDir.create(tmp_path / "scan", kind="scan", model_name="tiny-qed")
    seen = []

    def stop_after_three(done, total):
        seen.append(done)
        if len(seen) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        scan.run_scan(m, pairs, run, batch_size=3, progress=stop_after_three)
    table = run.table(scan.SCAN_TABLE, key=list(scan.SCAN_KEY))
    assert len(table.rows()) == 9                     # three committed batches of 3 rows

    resumed_progress = []
    again = RunDir.open(tmp_path / "scan", kind="scan", model_name="tiny-qed")
    res = scan.run_scan(m, pairs, again, batch_size=3, progress=lambda d, t: resumed_progress.append((d, t)))
    rows = table.rows()
    keys = [tuple(r[c] for c in scan.SCAN_KEY) for r in rows]
    assert len(rows) == total and len(set(keys)) == total            # nothing redone, nothing lost
    assert resumed_progress[0][0] == 9 + min(3, total - 9) and resumed_progress[-1] == (total, total)
    np.testing.assert_allclose(keyed(res.rows)["shift"], keyed(reference.rows)["shift"], atol=ATOL, rtol=0)
    assert res.winner == reference.winner
    assert (tmp_path / "scan" / "scan_heads.csv").exists()

    # a finished scan reruns without any model work
    calls = []
    handle = m.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        scan.run_scan(m, pairs, RunDir.open(tmp_path / "scan"), batch_size=3)
    finally:
        handle.remove()
    assert calls == [] and len(table.rows()) == total


def test_scan_errors(word_tok, pairs):
    m = tiny_model("gdn", layers=2, vocab_size=len(word_tok))
    neutral = build_pairs(word_tok, split="dev", n_sources=2, n_facts=2, filler_tokens=16, gap_tokens=4,
                          variant="neutral")
    with pytest.raises(ValueError, match="no target rows with a donor answer"):
        scan.run_scan(m, neutral)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        scan.run_scan(m, pairs, batch_size=0)
    with pytest.raises(ValueError, match="head 7 is out of range"):
        scan.run_scan(m, pairs, heads=[(0, 7)])
    with pytest.raises(ValueError, match="different tokenizer"):
        scan.run_scan(tiny_model("gdn", layers=2), pairs)
    with pytest.raises(ValueError, match="lack columns"):
        scan.summarise_scan(pd.DataFrame({"source": [0], "shift": [1.0]}))
