"""`--lengths natural` on scan, confirm and run: each source keeps its natural token length and rows of different
lengths run packed (cu_seqlens). On a random Qwen3.5 with the real Qwen3.5 tokenizer the rows are ragged, and the
scan's and the confirmation's rows equal each row run alone at its own length; on a bundled model (a word tokenizer,
whose prompts already have the planned length) natural equals equal; the manifest names the choice, so a resume with
the other is refused; a bad value, the attribution scan, --ray and a model that cannot pack are one line, exit 2."""
from __future__ import annotations

import argparse
import json

import pandas as pd
import pytest
import torch

from recurscope.interp.cli import main

GATE_OFF = ["--gate-threshold", "0"]
SIZES = ["--pairs-per-source", "2", "--filler", "40", "--gap", "12", "--presentations", "2", "--batch-size", "3",
         *GATE_OFF]


ATOL = 1e-5     # float32 margins of a random model: packed vs one row alone


def _pair_args(model, **kw):
    """The namespace cli._pairs reads, as `recurscope scan` parses it (defaults of _pair_args / _layout_args)."""
    base = dict(model=model, sources="dev", n_sources=2, pairs_per_source=2, corpus=None, allow_unk=False,
                layout=None, n_facts=None, presentations=2, filler=40, gap=12, template=None, vocab="cities",
                keys=None, values=None, on_multitoken="filter", seed=0, lengths="natural")
    return argparse.Namespace(**{**base, **kw})


def _rows(out, table):
    from recurscope.interp.results import RunDir

    return RunDir.open(out).table(table).read()


def _sorted(frame, key):
    return frame.sort_values(list(key)).reset_index(drop=True)


def _slow_forgetting(ckpt):
    """Decays near 1 (A_log of 0.01..0.1, as trained models forget slowly), so that a state swap at the boundary
    still moves the query's margins well above float noise after the filler; saved back in place."""
    import transformers as tf

    hf = tf.Qwen3_5ForCausalLM.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "A_log" in name:
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.1, generator=g).log())
    hf.save_pretrained(ckpt)


@pytest.mark.slow
def test_natural_lengths_on_a_random_qwen35_with_the_qwen_tokenizer(real_tokenizer_dir, tmp_path, capsys):
    from test_real_checkpoint import _checkpoint

    from recurscope.interp import cli, cli_checks, scan
    from recurscope.interp.confirm import confirm_arm
    from recurscope.interp.loading import load_model

    ckpt = _checkpoint(tmp_path / "random-qwen35", real_tokenizer_dir("qwen35"))
    _slow_forgetting(ckpt)
    assert main(["scan", str(ckpt), "--lengths", "natural", "--n-sources", "2", *SIZES,
                 "--out", str(tmp_path / "scan")]) == 0
    # the confirmation on the dev pairs (a warning says it is no confirmation): the ones this tokenizer makes ragged
    assert main(["confirm", str(ckpt), "--lengths", "natural", "--sources", "dev", "--n-sources", "2", *SIZES,
                 "--from-scan", str(tmp_path / "scan"), "--out", str(tmp_path / "confirm")]) == 0
    manifest = json.loads((tmp_path / "scan" / "manifest.json").read_text())
    assert manifest["args"]["lengths"] == "natural"

    m = load_model(ckpt)
    pairs = cli._pairs(m, _pair_args(str(ckpt)))
    lengths = pairs.row_lengths()
    assert pairs.is_ragged() and lengths.unique().numel() > 1, lengths
    key = ("source", "pair", "layer", "head")
    got = _sorted(_rows(tmp_path / "scan", "scan_rows"), key)
    want = _sorted(pd.concat([scan.scan_rows(m, pairs.select([i]).trimmed()) for i in range(len(pairs))]), key)
    assert len(got) == len(want) and got[list(key)].equals(want[list(key)].astype(got[list(key)].dtypes))
    for col in ("clean_margin", "margin", "shift"):
        assert (got[col] - want[col]).abs().max() <= ATOL, col
    assert got["shift"].abs().max() > 100 * ATOL           # the swaps move the margins
    size = cli_checks.size_run(argparse.Namespace(model=str(ckpt), fn=main, command="scan", n_sources=2,
                                                  pairs_per_source=2, n_facts=None, presentations=2, gap=12,
                                                  filler=40, layout=None, batch_size=3))
    assert int(lengths.max()) <= size.sequence_tokens        # the size estimate bounds every natural row

    held = pairs
    from recurscope.interp.confirm import heads_from_scan

    heads = heads_from_scan(tmp_path / "scan", m)
    rows = _rows(tmp_path / "confirm", "confirm_rows")
    for arm in ("state_swap", "write_block"):
        got = rows[rows["intervention"] == arm].sort_values("row").reset_index(drop=True)
        want = pd.concat([confirm_arm(m, held.select([i]).trimmed(), heads, arm, row_ids=[i])
                          for i in range(len(held))]).reset_index(drop=True)
        assert got["row"].tolist() == want["row"].tolist()
        for col in ("clean_margin", "margin", "donor_margin_shift"):
            assert (got[col] - want[col]).abs().max() <= ATOL, (arm, col)

    # the same directory with the other choice is other work: refused, its rows kept
    capsys.readouterr()
    assert main(["scan", str(ckpt), "--n-sources", "2", *SIZES, "--out", str(tmp_path / "scan")]) == 2
    _one_error_line(capsys, "lengths")


def test_natural_lengths_on_a_bundled_model_equal_the_default(tmp_path, capsys):
    """The bundled word tokenizer never merges across filler borders, so natural prompts have the planned length:
    the rows are not ragged and the scan's rows are the default's. The manifest names the choice only when natural."""
    small = ["--n-sources", "2", "--pairs-per-source", "1", "--filler", "16", "--gap", "4", "--presentations", "1",
             *GATE_OFF]
    assert main(["run", "tiny-gla", "--lengths", "natural", "--n-dev", "2", "--n-heldout", "2", *small[2:],
                 "--out", str(tmp_path / "run")]) == 0
    assert main(["scan", "tiny-gla", *small, "--out", str(tmp_path / "equal")]) == 0
    key = ["source", "pair", "layer", "head"]
    natural = _sorted(_rows(tmp_path / "run" / "scan", "scan_rows"), key)
    equal = _sorted(_rows(tmp_path / "equal", "scan_rows"), key)
    pd.testing.assert_frame_equal(natural, equal)
    for sub in ("scan", "confirm"):
        assert json.loads((tmp_path / "run" / sub / "manifest.json").read_text())["args"]["lengths"] == "natural"
    assert "lengths" not in json.loads((tmp_path / "equal" / "manifest.json").read_text())["args"]
    assert (tmp_path / "run" / "report.md").is_file()
    patch = ["patch", "tiny-gla", "--layer", "0", "--head", "0", "--filler", "16", "--gap", "4",
             "--presentations", "1"]
    capsys.readouterr()
    assert main([*patch, "--lengths", "natural"]) == 0
    natural_table = capsys.readouterr().out
    assert main(patch) == 0
    assert natural_table == capsys.readouterr().out and "state_swap" in natural_table


def _one_error_line(capsys, *needles):
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_bad_lengths_options_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["scan", "tiny-gla", "--lengths", "ragged", "--out", str(tmp_path / "a")])
    assert exit_.value.code == 2
    _one_error_line(capsys, "--lengths", "invalid choice", "'natural'")
    assert main(["scan", "tiny-gla", "--lengths", "natural", "--method", "attribution",
                 "--out", str(tmp_path / "b")]) == 2
    _one_error_line(capsys, "--lengths natural", "--method exact")
    assert not (tmp_path / "b" / "manifest.json").exists()


def test_a_model_that_cannot_pack_is_refused_before_any_work(tmp_path, capsys):
    """RWKV-7 (native) refuses packed sequences in its forward; --lengths natural surfaces that as one line before
    any pair is built or a manifest written."""
    from tests.interp.helpers_models import tiny_model

    from recurscope.interp.loading import save_model

    save_model(tiny_model("rwkv7", layers=1), tmp_path / "ckpt")
    assert main(["scan", str(tmp_path / "ckpt"), "--lengths", "natural", "--out", str(tmp_path / "out")]) == 2
    line = _one_error_line(capsys, "--lengths natural", "rwkv7", "--lengths equal")
    assert line.startswith("error: ")
    assert not (tmp_path / "out" / "manifest.json").exists()     # no work started


def test_the_gates_clean_run_of_ragged_rows_equals_each_row_alone(word_tok):
    """The capability gate's clean forwards (interventions.clean_run) on rows of different lengths: each row's clean
    logits are those of the row run alone at its own length, not of its left-padded row."""
    import dataclasses

    from tests.interp.helpers_models import tiny_model

    from recurscope.interp.data.recall import PairBatch, iter_pairs
    from recurscope.interp.interventions import clean_run

    made = []
    for j, filler in enumerate((0, 60)):
        for p in iter_pairs(word_tok, "dev", 2, filler_tokens=filler, gap_tokens=4, presentations=1, seed=j):
            made.append(dataclasses.replace(p, source_id=p.source_id + 10 * j, group=p.group + 10 * j))
    pairs = PairBatch.collate(made, 0)
    assert pairs.is_ragged()
    m = tiny_model("gdn", layers=2, vocab_size=len(word_tok), use_short_conv=True)
    got = clean_run(m, pairs, batch_size=3)
    for i in range(len(pairs)):
        alone = clean_run(m, pairs.select([i]).trimmed())
        for side in ("recipient", "donor"):
            torch.testing.assert_close(got[side][i], alone[side][0], atol=1e-5, rtol=0)
