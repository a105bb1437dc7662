"""The scan by attribution patching (issue 28.3): each head's estimate is the derivative, along the swap's direction,
of the exact scan's patched margin, checked by finite differences of full patched forwards through the hook points;
the CLI writes the exact scan's result directory with its method in the manifest, and --confirm-top scans the K best
candidates exactly."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from helpers_models import tiny_model
from recurscope.hooks import ReadoutReplace, StateReplace, hook_name, run_with_patches
from recurscope.interp import scan
from recurscope.interp.data import build_pairs
from recurscope.interp.results import RunDir
from recurscope.interp.scan_attribution import attribution_shifts


@pytest.fixture(scope="module")
def pairs(word_tok):
    return build_pairs(word_tok, split="dev", n_sources=2, pairs_per_source=2, n_facts=2, filler_tokens=16,
                       gap_tokens=4)


def _margin_along_swap(model, pairs, i, layer, head, alpha):
    """The exact scan's margin (naive form: a full recipient forward, S_b of (layer, head) replaced, the readout at
    b kept) with S_b = S_recipient + alpha (S_donor - S_recipient)."""
    b, qp = int(pairs.query_start[i]) - 1, int(pairs.query_pos[i])
    rec, don = pairs.recipient_ids[i:i + 1], pairs.donor_ids[i:i + 1]
    states = lambda n: n.endswith("hook_state") or n.endswith("hook_head_out")  # noqa: E731
    with torch.no_grad():
        _, rc = model.run_with_cache(rec, state_positions=[b], names_filter=states)
        _, dc = model.run_with_cache(don, state_positions=[b], names_filter=states)
        s_rec, s_don = rc[hook_name("hook_state", layer)][:, 0], dc[hook_name("hook_state", layer)][:, 0]
        patches = [StateReplace(layer, [head], b, s_rec + alpha * (s_don - s_rec)),
                   ReadoutReplace(layer, [head], b, rc[hook_name("hook_head_out", layer)])]
        z = run_with_patches(model, rec, patches)[0, qp].double()
    cand = pairs.candidate_ids[i]
    d, r = cand[int(pairs.donor_answer_index[i])], cand[int(pairs.recipient_answer_index[i])]
    return float(z[d] - z[r])


def _granite(factory):
    """test_bridge_mamba's random Granite-4.0-H (logits_scaling 2, every multiplier away from 1), in float64."""
    from test_bridge import tiny_checkpoint
    from test_bridge_mamba import _build, _float64

    return _float64(tiny_checkpoint("granitemoehybrid", _build, factory)[1])


@pytest.mark.parametrize("family", ["gla", "gdn", "qed", "gdn_hybrid", "qwen35", "granitemoehybrid"])
def test_estimate_is_the_derivative_of_the_exact_swap_along_its_direction(word_tok, pairs, family, tmp_path_factory):
    if family in ("qwen35", "granitemoehybrid"):
        from recurscope.interp.loading import load_model

        model = (load_model("tiny-qwen35", dtype=torch.float64) if family == "qwen35"
                 else _granite(tmp_path_factory))
        bridged = build_pairs(model.tokenizer, split="dev", n_sources=2, pairs_per_source=1, n_facts=2,
                              filler_tokens=16, gap_tokens=4)
        use, step, rel = bridged, 5e-2, 1e-3   # transformers' norms and softmax are float32 inside (see gradients)
        if family == "granitemoehybrid":   # shifts of ~1e-3 (logits / 2): a longer step keeps that float32
            step = 0.4                     # rounding below the tolerance, the curvature over it is smaller still
    else:
        model = tiny_model(family, layers=2, vocab_size=len(word_tok)).double()
        use, step, rel = pairs, 1e-4, 1e-6
    rows = attribution_shifts(model, use, prefix_batch=3).set_index(list(scan.SCAN_KEY)).sort_index()
    assert len(rows) == len(scan._target_rows(use)) * len(scan.all_heads(model))
    scale = float(rows["shift"].abs().max())
    checked = 0
    for (source, pair, layer, head), row in rows.iterrows():
        i = int(row["row"])
        central = lambda h: (_margin_along_swap(model, use, i, layer, head, h)  # noqa: E731
                             - _margin_along_swap(model, use, i, layer, head, -h)) / (2 * h)
        numeric = (4 * central(step / 2) - central(step)) / 3
        assert row["shift"] == pytest.approx(numeric, rel=rel, abs=rel * scale), (source, pair, layer, head)
        # the scan reads its margins from float32 logits (interventions.candidate_logits)
        assert row["clean_margin"] == pytest.approx(_margin_along_swap(model, use, i, layer, head, 0.0), rel=1e-6)
        checked += abs(numeric) > 1e-6
    assert checked >= len(rows) // 2          # the heads move the margin, so the comparison has teeth


def test_estimate_equals_the_exact_shift_for_a_swap_of_vanishing_size(word_tok, pairs):
    """The exact scan of a donor whose state differs from the recipient's by a small multiple of the swap
    shifts the margin by that multiple of the estimate, to second order."""
    model = tiny_model("gdn2", layers=2, vocab_size=len(word_tok)).double()
    rows = attribution_shifts(model, pairs).set_index(list(scan.SCAN_KEY)).sort_index()
    (source, pair, layer, head), row = next(iter(rows.iterrows()))
    alpha = 1e-3
    exact = _margin_along_swap(model, pairs, int(row["row"]), layer, head, alpha) - row["clean_margin"]
    assert exact / alpha == pytest.approx(row["shift"], rel=1e-2, abs=1e-6)


@pytest.mark.slow
def test_cli_attribution_scan_writes_the_scan_directory_and_confirms_the_top_heads(tiny_checkpoint, tmp_path,
                                                                                    capsys):
    from recurscope.interp.cli import main

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    small = ["--n-sources", "2", "--pairs-per-source", "1", "--filler", "16", "--n-facts", "2",
             "--gate-threshold", "0"]   # a random-weight model: the plumbing, past the capability gate
    est = tmp_path / "est"
    assert main(["scan", str(ckpt), "--method", "attribution", "--out", str(est), *small]) == 0
    manifest = json.loads((est / "manifest.json").read_text())
    assert manifest["args"]["method"] == "attribution" and manifest["args"]["confirm_top"] is None
    heads = pd.read_csv(est / "scan_heads.csv")
    rows = RunDir.open(est).table("scan_rows").read()
    assert set(rows.columns) >= {*scan.SCAN_KEY, "clean_margin", "margin", "shift"}
    np.testing.assert_allclose(rows["margin"] - rows["clean_margin"], rows["shift"], atol=1e-9)

    top = tmp_path / "top"
    assert main(["scan", str(ckpt), "--method", "attribution", "--confirm-top", "2", "--out", str(top), *small]) == 0
    estimated = pd.read_csv(top / "attribution_heads.csv")
    pd.testing.assert_frame_equal(estimated, heads)
    exact = pd.read_csv(top / "scan_heads.csv")
    assert sorted(map(tuple, exact[["layer", "head"]].to_numpy())) == \
        sorted(map(tuple, estimated[["layer", "head"]].head(2).to_numpy()))
    assert main(["scan", str(ckpt), "--out", str(tmp_path / "exact"), *small]) == 0
    reference = pd.read_csv(tmp_path / "exact" / "scan_heads.csv").set_index(["layer", "head"])["J"]
    # The K heads run in a smaller suffix batch than the full scan's, so float32 rounds differently (the kernel
    # picks float64 decay sums per call from the batch's decays): equal to float32 rounding, as scan rows elsewhere.
    np.testing.assert_allclose(exact.set_index(["layer", "head"])["J"], reference.loc[exact.set_index(
        ["layer", "head"]).index], rtol=0, atol=1e-6)
    assert "method" not in json.loads((tmp_path / "exact" / "manifest.json").read_text())["args"]


def test_cli_refuses_confirm_top_without_attribution(tiny_checkpoint, tmp_path, capsys):
    from recurscope.interp.cli import main

    assert main(["scan", str(tiny_checkpoint(tmp_path / "ckpt")), "--confirm-top", "3", "--out", str(tmp_path / "x")]) == 2
    assert "--method attribution" in capsys.readouterr().err
