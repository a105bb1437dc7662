"""The hybrid cache factorial (`recurscope hybrid`, Sec. 4.1): the full swap is the donor's own run, chunks of sources
compute as the whole batch does, the shares are ratios of source means, the Reading judges them against the paper's
bounds on both sides, a non-hybrid is refused in one line, and the verb runs on every hybrid layout the project
loads: tiny-gdn-hybrid, tiny-qwen35 and tiny random checkpoints of eight bridged layouts (among them Falcon-H1 and
Zamba2, whose layers hold a recurrent state and a KV cache in one cache layer, swapped separately)."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

from recurscope.interp.cli import main
from recurscope.interp.data import build_pairs
from recurscope.interp.interventions import clean_run
from recurscope.interp.loading import load_model
from recurscope.interp.protocols import hybrid
from recurscope.interp.verdicts import AGREES, DIFFERS, NO_EVIDENCE, NOT_INFORMATIVE

TINY = ["--n-sources", "3", "--filler", "12", "--presentations", "2", "--gap", "4",
        "--gate-threshold", "0", "--resamples", "100",
        "--batch-size", "4"]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-gdn-hybrid")


@pytest.fixture(scope="module")
def pairs(model):
    return build_pairs(model.tokenizer, split="heldout", n_sources=4, n_facts=2, presentations=2, filler_tokens=12)


def test_full_swap_is_the_donors_own_run(model, pairs):
    b = pairs.query_start - 1
    assert all(torch.equal(pairs.recipient_ids[i, b[i] + 1:], pairs.donor_ids[i, b[i] + 1:]) for i in range(len(pairs)))
    rows = hybrid.cache_factorial(model, pairs)
    clean = clean_run(model, pairs)
    idx = torch.arange(len(pairs))
    d_ans, r_ans = pairs.donor_answer_index, pairs.recipient_answer_index
    margin = lambda z: (z[idx, d_ans] - z[idx, r_ans]).numpy()  # noqa: E731
    full = rows[rows.arm == "both"].sort_values("row")["donor_margin_shift"].to_numpy()
    assert np.abs(full - (margin(clean["donor"]) - margin(clean["recipient"]))).max() < 1e-4


def test_chunks_of_sources_compute_as_the_whole_batch(model, pairs):
    whole = hybrid.cache_factorial(model, pairs, batch_size=64)
    chunked = hybrid.factorial_rows(model, pairs, batch_size=2)
    assert len(hybrid.source_chunks(pairs, 2)) > 1
    key = ["arm", "row"]
    a = whole.sort_values(key).reset_index(drop=True)
    b = chunked.sort_values(key).reset_index(drop=True)
    assert a[key + ["source"]].equals(b[key + ["source"]])
    assert np.allclose(a["donor_margin_shift"], b["donor_margin_shift"], atol=1e-4)


def test_shares_are_ratios_of_source_means():
    rows = pd.DataFrame({"arm": ["recurrent", "kv", "both"] * 4, "row": np.repeat(range(4), 3),
                         "source": np.repeat([0, 0, 1, 1], 3),
                         "donor_margin_shift": [1, 3, 4, 2, 2, 4, 0, 6, 6, 1, 5, 6]})
    s = hybrid.shares(rows, n_resamples=200).set_index("arm")
    assert s.loc["both", "estimate"] == 1 and s.loc["both", "low"] == 1 and s.loc["both", "high"] == 1
    # source 0: recurrent 1.5, kv 2.5, both 4; source 1: 0.5, 5.5, 6 -> 1.0 / 5 and 4.0 / 5
    assert s.loc["recurrent", "estimate"] == pytest.approx(0.2) and s.loc["kv", "estimate"] == pytest.approx(0.8)


def _summary(recurrent, kv, full=(20.0, 15.0, 25.0), n=16):
    rec = lambda arm, metric, v: {"arm": arm, "metric": metric, "estimate": v[0], "low": v[1], "high": v[2],  # noqa
                                  "n_sources": n}
    return pd.DataFrame([rec("recurrent", "share_of_full", recurrent), rec("kv", "share_of_full", kv),
                         rec("both", "share_of_full", (1, 1, 1)), rec("both", "donor_margin_shift", full)])


@pytest.mark.parametrize("recurrent, kv, expected", [
    ((0.01, 0.0, 0.03), (0.99, 0.97, 1.0), (AGREES, AGREES)),        # the paper's KV-dominated hybrid
    ((0.88, 0.85, 0.90), (0.12, 0.10, 0.15), (DIFFERS, DIFFERS)),    # tiny-gdn-hybrid's recurrent memory
    # intervals across the bounds: the recurrent one is more than twice as wide as the paper's 3.6%
    ((0.02, -0.01, 0.10), (0.98, 0.90, 1.01), (NOT_INFORMATIVE, NO_EVIDENCE)),
    ((0.02, -0.01, 0.05), (0.98, 0.90, 1.01), (NO_EVIDENCE, NO_EVIDENCE)),
])
def test_reading_judges_the_shares_against_the_papers_bounds(recurrent, kv, expected):
    sentences = hybrid.reading(_summary(recurrent, kv))
    rec = next(s for s in sentences if s.startswith("The recurrent caches' share"))
    kv_s = next(s for s in sentences if s.startswith("The attention KV's share"))
    assert f": {expected[0]} (" in rec and f": {expected[1]} (" in kv_s
    assert "n = 16" in rec and "[" in rec


@pytest.mark.parametrize("family", ["mamba2", "nemotron_h", "falcon_h1"])
def test_a_hybrid_of_a_family_the_paper_did_not_measure_gets_its_shares_without_a_verdict(family):
    """The paper's hybrids are Gated DeltaNet hybrids: a Mamba-2 hybrid's shares, even the paper's own KV-dominated
    ones, are reported with no agreement stated, while the full swap (a sign, any hybrid) is still judged."""
    from recurscope.interp.verdicts import NOT_COMPARED

    sentences = hybrid.reading(_summary((0.01, 0.0, 0.03), (0.99, 0.97, 1.0)), family=family)
    for start in ("The recurrent caches' share", "The attention KV's share"):
        sentence = next(s for s in sentences if s.startswith(start))
        assert NOT_COMPARED in sentence and AGREES not in sentence and "Gated DeltaNet hybrids" in sentence
    assert any(s.startswith("The full swap's donor-margin shift") and AGREES in s for s in sentences)


def test_reading_says_when_there_is_no_full_swap_effect():
    sentences = hybrid.reading(_summary((0.5, -3, 4), (0.5, -3, 4), full=(0.1, -0.5, 0.6)))
    assert any("attribute nothing" in s for s in sentences)


def test_a_non_hybrid_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "gla"
    assert main(["hybrid", "tiny-gla", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a hybrid" in err[0] and "tiny-gdn-hybrid" in err[0]
    assert not (out / "manifest.json").exists()   # refused before the result directory is opened


def test_an_interrupted_run_resumes_at_the_first_source_without_rows(tmp_path, capsys):
    out = tmp_path / "h"
    args = ["hybrid", "tiny-gdn-hybrid", *TINY, "--batch-size", "1", "--out", str(out)]
    assert main(args) == 0
    whole = pd.read_csv(out / "hybrid_rows.csv")
    log = out / "hybrid_rows.jsonl"
    lines = log.read_text().splitlines()
    keep = [i for i, line in enumerate(lines) if "__batch_end__" in line][0]   # the first source's chunk only
    log.write_text("\n".join(lines[:keep + 1]) + "\n")
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "chunk 1/3" not in printed and "chunk 2/3" in printed and "chunk 3/3" in printed
    again = pd.read_csv(out / "hybrid_rows.csv")
    pd.testing.assert_frame_equal(whole, again)


def _bridged(layout, tmp_path_factory):
    """A tiny random checkpoint of a bridged layout, built by the bridge test module that lists it (each
    tests/interp/test_bridge*.py module's LAYOUTS and _build), so that a new architecture's module is found here."""
    import importlib
    from pathlib import Path

    import test_bridge

    modules = [importlib.import_module(p.stem) for p in sorted(Path(__file__).parent.glob("test_bridge*.py"))]
    build = next(m._build for m in modules if layout in getattr(m, "LAYOUTS", ()))
    return str(test_bridge.tiny_checkpoint(layout, build, tmp_path_factory)[1])


BRIDGED = ("qwen3_5_dense", "qwen3_5_moe", "qwen3_5_multimodal", "qwen3_next", "olmo_hybrid", "kimi_linear",
           "falcon_h1", "zamba2", "minimax")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gdn-hybrid", "tiny-qwen35", *BRIDGED])
def test_verb_runs_on_every_hybrid_layout(name, tmp_path, tmp_path_factory, capsys):
    model = name if name.startswith("tiny-") else _bridged(name, tmp_path_factory)
    out = tmp_path / "hybrid"
    assert main(["hybrid", model, *TINY, "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "hybrid"
    summary = pd.read_csv(out / "hybrid_summary.csv")
    shares = summary[summary.metric == "share_of_full"].set_index("arm")
    assert list(shares.index) == ["recurrent", "kv", "both"] and shares.loc["both", "estimate"] == pytest.approx(1)
    assert {"donor_answer", "donor_margin_shift"} <= set(summary.metric)
    assert (out / "figures" / "hybrid.png").is_file() and (out / "figures" / "hybrid.svg").is_file()
    report = (out / "report.md").read_text()
    assert "### Reading" in report and "share of the full swap" in report


# ---- Table 2's tasks: entity update and RULER single-NIAH on the same factorial ---------------------------------

def test_niah_pairs_differ_only_in_the_needles_value(model):
    pairs = hybrid.build_niah_pairs(model.tokenizer, n_sources=6, total_length=96, seed=1)
    diff = (pairs.recipient_ids != pairs.donor_ids)
    assert diff.sum(1).tolist() == [1] * 6
    value_pos = pairs.value_spans[:, 0, 0, 0]
    assert torch.equal(diff.float().argmax(1), value_pos)
    idx = torch.arange(6)
    assert torch.equal(pairs.candidate_ids[idx, pairs.recipient_answer_index], pairs.recipient_ids[idx, value_pos])
    assert torch.equal(pairs.candidate_ids[idx, pairs.donor_answer_index], pairs.donor_ids[idx, value_pos])
    assert (pairs.query_pos == 95).all() and (pairs.query_start > value_pos).all()
    text = model.tokenizer.decode(pairs.recipient_ids[0, pairs.query_start[0]:].tolist())
    assert "special magic number" in text


def _table2_summary(clean, kv_share, rec_donor, kv_donor, n=64):
    rec = lambda arm, metric, v: {"arm": arm, "metric": metric, "estimate": v[0], "low": v[1], "high": v[2],  # noqa
                                  "n_sources": n}
    return pd.DataFrame([rec("both", "clean_correct", clean), rec("both", "donor_margin_shift", (9.0, 8.0, 10.0)),
                         rec("kv", "share_of_full", kv_share), rec("recurrent", "share_of_full", (0.0, 0.0, 0.01)),
                         rec("recurrent", "donor_answer", rec_donor), rec("kv", "donor_answer", kv_donor)])


@pytest.mark.parametrize("task", ["update", "niah"])
def test_table2_reading_on_both_sides_of_the_papers_numbers(task):
    paper_like = _table2_summary((0.95, 0.9, 0.99), (0.97, 0.95, 0.99), (0.0, 0.0, 0.03), (0.9, 0.85, 1.0))
    tiny_like = _table2_summary((0.95, 0.9, 0.99), (0.12, 0.10, 0.15), (0.84, 0.77, 0.90), (0.05, 0.02, 0.11))
    for summary, kind in ((paper_like, AGREES), (tiny_like, DIFFERS)):
        sentences = hybrid.reading(summary, task, chance=0.25)
        compared = [s for s in sentences if s.startswith(("The attention KV's share", "The recurrent swap's",
                                                          "The KV swap's"))]
        assert len(compared) == 3 and all(f": {kind} (" in s for s in compared), compared
    assert "Table 2" in hybrid.reading(paper_like, task)[0]


def test_table2_reading_compares_nothing_when_clean_recall_is_at_chance():
    at_chance = _table2_summary((0.125, 0.02, 0.47), (-0.01, -0.35, 0.0), (0.5, 0.2, 0.8), (0.5, 0.2, 0.8), n=8)
    sentences = hybrid.reading(at_chance, "niah", chance=0.25)
    assert any("not above chance" in s for s in sentences)
    compared = [s for s in sentences if s.startswith(("The attention KV's share", "The recurrent swap's",
                                                      "The KV swap's"))]
    assert len(compared) == 3 and not any(DIFFERS in s or AGREES in s for s in compared)
    assert sum("(not compared; paper:" in s for s in sentences) == 3


@pytest.mark.slow
@pytest.mark.parametrize("task, extra", [("update", []), ("niah", ["--total-length", "96"])])
def test_table2_tasks_run_as_modes_of_the_verb(task, extra, tmp_path):
    out = tmp_path / task
    assert main(["hybrid", "tiny-gdn-hybrid", *TINY, "--task", task, *extra, "--out", str(out)]) == 0
    assert json.loads((out / "manifest.json").read_text())["args"]["task"] == task
    report = (out / "report.md").read_text()
    assert "Table 2" in report and TASKS_LABEL[task] in report
    rows = pd.read_csv(out / "hybrid_rows.csv")
    assert set(rows.variant) == {"update" if task == "update" else "niah"}


TASKS_LABEL = {"update": "entity update", "niah": "RULER single-NIAH (one needle in a haystack), 96 tokens"}
