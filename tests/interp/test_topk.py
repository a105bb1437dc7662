"""The App. E.2 top-k test in two formats (protocols.topk; issue 31, item 6): the formats' prompts, the Reading on
constructed summaries on both sides of the gate and of the paper's numbers, and runs on a random RWKV-7 and a random
GLA with query groups (which recall at chance, so nothing is judged)."""
import numpy as np
import pandas as pd
import pytest

from helpers_models import tiny_model
from recurscope.interp.data import build_pairs
from recurscope.interp.protocols import topk
from recurscope.interp.verdicts import AGREES, DIFFERS, SAME_SIGN

SMALL = dict(filler=32, presentations=3, gap=4)


def _text(tok, ids):
    return tok.decode([int(i) for i in ids]) if hasattr(tok, "decode") else " ".join(tok.convert_ids_to_tokens(ids))


@pytest.mark.parametrize("fmt", list(topk.FORMATS))
def test_the_formats_keep_app_b_bindings_and_differ_only_in_wording(word_tok, fmt):
    """App. B (the notes): four bindings, each presented three times, filler before the query. compact: "KEY VALUE."
    and the query is the key itself, one token, whose next token is the answer; naturalized: "KEY is in VALUE." and
    the question "where is KEY? KEY is in"."""
    spec = topk.format_layout(fmt, **SMALL)
    assert spec.layout.n_facts == 4 and spec.layout.presentations == 3
    assert topk.format_layout(fmt).layout.filler_tokens == 512       # the paper's 512 filler tokens by default
    p = build_pairs(word_tok, split="heldout", n_sources=2, **spec.kwargs())
    for i in range(len(p)):
        key = p.keys[i][int(p.queried_fact[i])]
        spans = p.fact_spans[i]
        assert int((spans[..., 0] >= 0).sum()) == 12                 # 4 facts x 3 presentations
        value = p.recipient_values[i][int(p.queried_fact[i])]
        a, b = (int(x) for x in spans[int(p.queried_fact[i]), 0])
        fact = word_tok.convert_ids_to_tokens(p.recipient_ids[i, a:b].tolist())
        query = word_tok.convert_ids_to_tokens(p.recipient_ids[i, int(p.query_start[i]):int(p.query_pos[i]) + 1]
                                               .tolist())
        if fmt == "compact":
            assert fact[:2] == [key, value] and query == [key]
        else:
            assert fact[:4] == [key, "is", "in", value]
            assert query == ["where", "is", key, "?", key, "is", "in"]
        # the filler before the query: 32 tokens after the last presentation
        last_end = int(spans[..., 1].max())
        assert int(p.query_start[i]) - last_end == 32


def _summary(recovery, recall, n=16, fmt="compact"):
    """A constructed summary: the top-1 recovery interval and the recipient/donor clean-recall interval."""
    rows = []
    for side in ("recipient", "donor"):
        rows.append({"analysis": "gate", "format": fmt, "unit": side, "metric": "clean_recall", "estimate": recall[0],
                     "low": recall[1], "high": recall[2], "n_sources": n, "k": np.nan})
    if recovery is not None:
        rows.append({"analysis": "recovery", "format": fmt, "unit": "top1", "metric": "recovery",
                     "estimate": recovery[0], "low": recovery[1], "high": recovery[2], "n_sources": n, "k": 1})
    return pd.DataFrame(rows)


def _reading(summary, info):
    return [str(sentence) for sentence in topk.reading(summary, info)]     # sentences and Verdicts, as rendered


def _info(passed, checkpoint="RWKV7-13.3B", group=1, gate=0.8, fmt="compact"):
    return {"formats": [fmt], "gate": gate, "gates": {fmt: passed}, "chance": 0.25, "query_group": group,
            "checkpoint": checkpoint, "claims": {fmt: topk.PAPER.get((checkpoint, fmt))}}


def test_reading_judges_a_gated_model_on_both_sides_of_the_paper_number():
    near = _reading(_summary((0.08, 0.05, 0.11), (0.95, 0.9, 1.0)), _info(True))
    assert AGREES in near[-1] and "7.5%" in near[-1]
    far = _reading(_summary((0.40, 0.30, 0.50), (0.95, 0.9, 1.0)), _info(True))
    assert DIFFERS in far[-1] and SAME_SIGN not in far[-1]    # a recovery is a share: it differs, never "agrees"
    nat = _reading(_summary((0.50, 0.45, 0.60), (0.95, 0.9, 1.0), fmt="naturalized"),
                       _info(True, fmt="naturalized"))
    assert AGREES in nat[-1] and "54.8%" in nat[-1]


def test_reading_refuses_to_judge_under_the_gate_and_says_when_recall_is_at_chance():
    chance = _reading(_summary(None, (0.27, 0.15, 0.40)), _info(False))
    assert "not judged" in chance[-1] and "chance" in chance[-1] and AGREES not in chance[-1]
    above = _reading(_summary(None, (0.70, 0.60, 0.78)), _info(False))   # refused, but not at chance
    assert "not judged" in above[-1] and "chance" not in above[-1]
    passes = _reading(_summary((0.08, 0.05, 0.11), (0.81, 0.80, 0.9)), _info(True))
    assert "not judged" not in passes[-1]
    ungated = _reading(_summary((0.08, 0.05, 0.11), (0.26, 0.1, 0.4)), _info(None, gate=None))
    assert "not compared" in ungated[-1] and "chance" in ungated[-1] and AGREES not in ungated[-1]


def test_reading_names_a_query_group_and_the_gla_7b_number():
    out = _reading(_summary((0.12, 0.08, 0.16), (0.9, 0.85, 0.95)), _info(True, "GLA-7B", group=4))
    assert any("a state group read by 4 query heads" in s for s in out)
    assert AGREES in out[-1] and "12.3%" in out[-1]
    none = _reading(_summary((0.5, 0.4, 0.6), (0.9, 0.85, 0.95), fmt="naturalized"),
                        _info(True, "GLA-7B", group=4, fmt="naturalized"))
    assert "gives no number" in none[-1]


def test_the_paper_checkpoint_follows_the_family(word_tok):
    assert topk.paper_checkpoint(tiny_model("rwkv7", vocab_size=len(word_tok))) == "RWKV7-13.3B"
    assert topk.paper_checkpoint(tiny_model("gla", vocab_size=len(word_tok), num_heads=4, num_kv_heads=2)) == "GLA-7B"
    assert topk.paper_checkpoint(tiny_model("gla", vocab_size=len(word_tok))) == "GLA-340M"
    assert topk.paper_checkpoint(tiny_model("gdn", vocab_size=len(word_tok))) is None


@pytest.mark.parametrize("family,extra", [("rwkv7", {}), ("gla_conv", dict(num_heads=4, num_kv_heads=2))])
def test_runs_on_random_models_and_judges_nothing(word_tok, family, extra):
    model = tiny_model(family, vocab_size=len(word_tok), **extra)
    model.tokenizer = word_tok
    r = topk.run_topk(model, n_dev=2, n_sources=3, filler=12, presentations=2, gap=4, n_resamples=200,
                      gate_threshold=None)
    s = r.summary
    for fmt in topk.FORMATS:
        rec = s[(s.analysis == "recovery") & (s.metric == "recovery") & (s.format == fmt)].set_index("k")
        assert list(rec.index) == [1, 2, 4] and rec.loc[4, "estimate"] == 1.0
    assert AGREES not in r.section and DIFFERS not in r.section
    if extra:
        assert r.info["n_components"] == 4 and "state group read by 2 query heads" in r.section
