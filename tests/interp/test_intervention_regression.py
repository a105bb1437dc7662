"""Every intervention gives the same logits as before the patch/mask refactor (commit d7997da, where
interp.interventions still had its own mask implementation): candidate logits on the bundled tiny-qed checkpoint
were computed on that commit by `python -m tests.interp.test_intervention_regression --write` and stored beside
this file. The refactor only moved where the masks are built, so anything beyond float rounding is a regression.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

REFERENCE = Path(__file__).with_name("intervention_logits_d7997da.json")
CHECKPOINT = "tiny-qed"
HEADS = [(0, 1), (1, 0)]
ATOL = 1e-4   # float32 logits of magnitude ~10; interventions move them by 0.1-10


def _arms():
    from recurscope.interp import interventions as iv

    return {
        "write_block": lambda m, p: iv.write_block(m, p, HEADS),
        "write_block_value": lambda m, p: iv.write_block(m, p, HEADS, spans="value"),
        "donor_write": lambda m, p: iv.donor_write(m, p, HEADS),
        "state_swap": lambda m, p: iv.state_swap(m, p, HEADS),
        "state_swap_per_row_boundary": lambda m, p: iv.state_swap(m, p, HEADS,
                                                                  boundary=p.query_start - 1 - torch.arange(len(p))),
        "output_patch": lambda m, p: iv.output_patch(m, p, HEADS),
        "output_restore": lambda m, p: iv.output_restore(m, p, HEADS),
        "output_restore_last": lambda m, p: iv.output_restore(m, p, HEADS, positions="last"),
        "random_update:state_swap": lambda m, p: iv.random_update(m, p, HEADS, "state_swap", seed=3),
        "random_update:output_patch": lambda m, p: iv.random_update(m, p, HEADS, "output_patch", seed=3),
        "control_head": lambda m, p: iv.control_head(m, p, HEADS, "donor_write"),
    }


def compute() -> dict:
    from recurscope.interp.data import build_pairs
    from recurscope.interp.loading import load_model

    torch.set_num_threads(1)
    model = load_model(CHECKPOINT)
    pairs = build_pairs(model.tokenizer, split="heldout", n_sources=3, filler_tokens=24, gap_tokens=6)
    out = {}
    with torch.no_grad():
        for name, arm in _arms().items():
            r = arm(model, pairs)
            out[name] = {"logits": r.logits.tolist(), "clean": r.clean.tolist()}
    return out


@pytest.mark.skipif(not REFERENCE.is_file(), reason="reference logits not generated")
def test_interventions_reproduce_the_logits_of_the_old_mask_implementation():
    stored = json.loads(REFERENCE.read_text())
    now = compute()
    assert set(now) == set(stored)
    for name in stored:
        for key in ("logits", "clean"):
            torch.testing.assert_close(torch.tensor(now[name][key]), torch.tensor(stored[name][key]), atol=ATOL,
                                       rtol=0, msg=f"{name} {key} differs from the stored reference")
        # not vacuous: every arm except the exact restore moves the logits
        if name != "output_restore":
            assert (torch.tensor(stored[name]["logits"]) - torch.tensor(stored[name]["clean"])).abs().max() > 1e-3


if __name__ == "__main__" and "--write" in sys.argv:
    REFERENCE.write_text(json.dumps(compute()) + "\n")
    print(f"wrote {REFERENCE}")
