"""The hybrid cache factorial: swapping every part of the donor's cache at b reproduces the donor's own answer."""
import torch

from experiments.hybrid_factorial import cache_factorial, shares
from recurscope.interp.data import build_pairs
from recurscope.interp.interventions import clean_run
from recurscope.interp.loading import load_model


def test_full_swap_gives_the_donor_margin_and_shares_are_reported():
    model = load_model("tiny-gdn-hybrid")
    pairs = build_pairs(model.tokenizer, split="heldout", n_sources=4, n_facts=2, presentations=2, filler_tokens=12)
    b = pairs.query_start - 1
    rows = torch.arange(len(pairs))
    same_suffix = all(torch.equal(pairs.recipient_ids[i, b[i] + 1:], pairs.donor_ids[i, b[i] + 1:]) for i in rows)
    assert same_suffix   # the query tokens are shared, so the full swap is the donor's own run
    table = cache_factorial(model, pairs)
    clean = clean_run(model, pairs)
    idx = torch.arange(len(pairs))
    d_ans, r_ans = pairs.donor_answer_index, pairs.recipient_answer_index
    margin = lambda z: (z[idx, d_ans] - z[idx, r_ans]).numpy()  # noqa: E731
    full = table[table.arm == "both"].sort_values("row")["donor_margin_shift"].to_numpy()
    expected = margin(clean["donor"]) - margin(clean["recipient"])
    assert abs(full - expected).max() < 1e-4
    s = shares(table, n_resamples=200)
    assert list(s.arm) == ["recurrent", "kv", "both"] and abs(float(s[s.arm == "both"].share_of_full.iloc[0]) - 1) < 1e-12
