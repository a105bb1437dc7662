"""End to end through the `recurscope` command on a tiny random model with the word tokenizer."""
import json

import pandas as pd
import pytest

from recurscope.interp.cli import main

SMALL = ["--n-facts", "2", "--presentations", "2", "--filler", "12", "--batch-size", "8"]
# The capability gate off: these models have random weights and the tests check the plumbing, not a finding.
GATE_OFF = ["--gate-threshold", "0"]


#: {figure name: Figure} of the study's `run` (the scan heatmap and the effects figure), caught as they are saved.
DRAWN = {}


@pytest.fixture(scope="module")
def study(tmp_path_factory, tiny_checkpoint):
    from tests.cli.test_protocol_verbs import catch_figures

    root = tmp_path_factory.mktemp("cli")
    ckpt = tiny_checkpoint(root / "ckpt")
    out = root / "study"
    with pytest.MonkeyPatch.context() as mp:
        drawn = catch_figures(mp)
        assert main(["run", str(ckpt), "--n-dev", "3", "--n-heldout", "4", "--out", str(out), *SMALL,
                     *GATE_OFF]) == 0
        DRAWN.update(drawn)
    return root, ckpt, out


@pytest.mark.slow
def test_run_figures_read_cleanly_on_a_random_model(study):
    """The figures `run` writes, on random weights (shifts of 1e-6 logits, recall at 0%): no text overlaps at the
    saved size, no multiplier left at the end of an axis, every title says n."""
    from recurscope.interp.plots import overlapping_text

    assert sorted(DRAWN) == ["effects", "scan_heatmap"]
    for name, figure in DRAWN.items():
        assert overlapping_text(figure) == [], name
        assert "n = " in figure.get_suptitle(), name
        for ax in figure.axes:
            for axis in (ax.xaxis, ax.yaxis):
                assert not (axis.get_offset_text().get_visible() and axis.get_offset_text().get_text()), name


@pytest.mark.slow
def test_run_writes_scan_confirmation_and_report(study):
    root, ckpt, out = study
    report = (out / "report.md").read_text()
    assert "Head selection" in report and "Confirmation on held-out sources" in report
    assert (out / "scan_heatmap.png").is_file() and (out / "effects.png").is_file()
    heads = pd.read_csv(out / "scan" / "scan_heads.csv")
    assert len(heads) == 4                               # 2 layers x 2 heads
    summary = pd.read_csv(out / "confirm" / "confirm_summary.csv")
    from recurscope.interp.confirm import ARMS

    assert set(summary["intervention"]) == set(ARMS)
    manifest = json.loads((out / "confirm" / "manifest.json").read_text())
    assert manifest["split"] == "heldout" and manifest["checkpoint_hash"].startswith("sha256:")
    scan_sources = json.loads((out / "scan" / "manifest.json").read_text())["sources"]
    assert manifest["sources"] and scan_sources  # ids are per split; the generator keeps the splits disjoint
    assert manifest["args"]["pairs_per_source"] == 4 and "4 pair(s) per source" in report
    assert "- filler: generated filler (recurscope's grammar, seed 0); 0.0% of its" in report
    # the all-readouts restore is clean by construction, and the report says so instead of citing it as evidence
    assert "the clean margin on every row by construction" in report and "as in the paper" not in report.split(
        "by construction")[0].rsplit("\n", 1)[-1]
    assert "95% intervals: margins by source bootstrap" in report
    # rates never get a zero-width "95%" interval (0% and 100% included)
    rates = summary[summary["metric"].isin(["donor_answer", "clean_accuracy", "intervened_accuracy"])].dropna()
    assert len(rates) and (rates["high"] > rates["low"]).all(), rates[["intervention", "metric", "low", "high", "method"]]


@pytest.mark.slow
def test_rerun_resumes_without_duplicates(study):
    root, ckpt, out = study
    before = pd.read_json(out / "scan" / "scan_rows.jsonl", lines=True)
    assert main(["run", str(ckpt), "--n-dev", "3", "--n-heldout", "4", "--out", str(out), *SMALL, *GATE_OFF]) == 0
    after = pd.read_json(out / "scan" / "scan_rows.jsonl", lines=True)
    assert len(after) == len(before)


@pytest.mark.slow
def test_confirm_refuses_a_scan_from_another_model(study, tiny_checkpoint, tmp_path, capsys):
    root, ckpt, out = study
    other = tiny_checkpoint(tmp_path / "other", seed=1)
    code = main(["confirm", str(other), *GATE_OFF, "--from-scan", str(out / "scan"), "--n-sources", "2", "--out",
                 str(tmp_path / "c"), *SMALL])
    assert code == 2
    assert "made on another model" in capsys.readouterr().err


@pytest.mark.slow
def test_patch_prints_the_intervention_table(study, capsys):
    root, ckpt, out = study
    assert main(["patch", str(ckpt), "--layer", "1", "--head", "0", *SMALL]) == 0
    text = capsys.readouterr().out
    for arm in ("write_block", "donor_write", "state_swap", "output_patch", "output_restore"):
        assert arm in text


@pytest.mark.slow
def test_bad_head_is_reported(study, capsys):
    root, ckpt, out = study
    assert main(["patch", str(ckpt), "--layer", "1", "--head", "9", *SMALL]) == 2
    assert "head 9 is out of range" in capsys.readouterr().err


def test_models_lists_every_bundled_checkpoint_and_nothing_else(capfd):
    """Standard output and error together hold the table alone: no loading bar or library warning between its rows
    (transformers' "Loading weights" bar and fla's CPU warning did, issue 39)."""
    from recurscope.interp.loading import bundled_names

    assert main(["models"]) == 0
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert lines[0].startswith("name") and len(lines) == 1 + len(bundled_names()), lines
    for line, name in zip(lines[1:], bundled_names()):
        assert line.split()[0] == name, line
