"""Golden outputs of the interventions, the scan and the confirmation on the bundled tiny-qed checkpoint, stored
beside this file before the interventions became spec builders run by one driver (issue 26): every registry arm's
candidate logits, clean logits, by-products and name; the public functions with their options (full logits
included); the scan's rows; the confirmation's rows. Regenerate only on purpose:
`PYTHONPATH=$PWD python -m tests.interp.test_golden_rows --write`.

Numbers are compared with one stated tolerance, GOLDEN_ATOL + GOLDEN_RTOL * |stored|, on every machine: float32
rounding depends on the CPU's vector width, the BLAS build and the thread count (a machine with the same torch and
the same reported CPU capability differed by 9.5e-7), and 1e-5 logits is far below any intervention's effect
(the smallest stored arm moves the logits by more than 1e-3, checked below).
"""
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

REFERENCE = Path(__file__).with_name("golden_rows_tiny_qed.json")
CHECKPOINT = "tiny-qed"
HEADS = [(0, 1), (1, 0)]
SEED = 3
GOLDEN_ATOL = 1e-5
GOLDEN_RTOL = 1e-6


def _platform() -> dict:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def _public_calls():
    from recurscope.interp import interventions as iv

    return {
        "write_block_value_full": lambda m, p: iv.write_block(m, p, HEADS, spans="value", return_full=True),
        "donor_write_batch2": lambda m, p: iv.donor_write(m, p, HEADS, batch_size=2),
        "state_swap_row_boundary": lambda m, p: iv.state_swap(
            m, p, HEADS, boundary=p.query_start - 1 - torch.arange(len(p)) % 3),
        "output_patch_full": lambda m, p: iv.output_patch(m, p, HEADS, return_full=True),
        "output_restore_last": lambda m, p: iv.output_restore(m, p, HEADS, positions="last", batch_size=5),
        "random_update_state_row_ids": lambda m, p: iv.random_update(m, p, HEADS, "state_swap", seed=SEED,
                                                                     row_ids=torch.arange(len(p)) + 7),
        "random_update_output": lambda m, p: iv.random_update(m, p, HEADS, "output_patch", seed=SEED),
        "random_write_rank_one": lambda m, p: iv.random_write(m, p, HEADS, variant="rank_one", seed=SEED),
        "control_head_output_restore": lambda m, p: iv.control_head(m, p, HEADS, "output_restore"),
        "clean_run": lambda m, p: iv.clean_run(m, p, batch_size=4),
    }


def _result_dict(r) -> dict:
    if isinstance(r, dict):                       # clean_run
        return {k: v.tolist() for k, v in r.items()}
    out = {"name": r.name, "heads": [list(h) for h in r.heads], "logits": r.logits.tolist(),
           "clean": r.clean.tolist(), "extra": {}}
    for key, value in r.extra.items():
        out["extra"][key] = value.tolist() if isinstance(value, torch.Tensor) else [list(h) for h in value]
    if r.full is not None:
        out["full"] = r.full.tolist()
    return out


def _frame_dict(frame: pd.DataFrame) -> dict:
    def plain(v):
        return v.item() if isinstance(v, np.generic) else v
    return {"columns": [str(c) for c in frame.columns],
            "data": [[plain(v) for v in row] for row in frame.itertuples(index=False)]}


def compute() -> dict:
    from recurscope.interp.confirm import run_confirm
    from recurscope.interp.data import build_pairs
    from recurscope.interp.interventions import REGISTRY
    from recurscope.interp.loading import load_model
    from recurscope.interp.scan import run_scan

    torch.set_num_threads(1)
    model = load_model(CHECKPOINT)
    dev = build_pairs(model.tokenizer, split="dev", n_sources=3, filler_tokens=24, gap_tokens=6)
    heldout = build_pairs(model.tokenizer, split="heldout", n_sources=3, filler_tokens=24, gap_tokens=6)
    with torch.no_grad():
        scan = run_scan(model, dev, batch_size=3, prefix_batch=2)
        arms = {e.name: _result_dict(e.run(model, heldout, HEADS, batch_size=4, seed=SEED, scan=scan.heads,
                                           row_ids=list(range(10, 10 + len(heldout)))))
                for e in REGISTRY}
        public = {name: _result_dict(call(model, heldout)) for name, call in _public_calls().items()}
        confirm = run_confirm(model, heldout, HEADS, scan_heads=scan.heads, seed=SEED, batch_size=4,
                              n_resamples=200)
    return {"platform": _platform(), "arms": arms, "public": public, "scan_rows": _frame_dict(scan.rows),
            "confirm_rows": _frame_dict(confirm.rows)}


def _numeric(value):
    """value as a float64 array when it is a number or a rectangular nest of numbers, else None."""
    if isinstance(value, str) or (isinstance(value, list) and not value):
        return None
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None


def _same(now, stored, where: str) -> None:
    if isinstance(stored, dict):
        assert isinstance(now, dict) and set(now) == set(stored), f"{where}: keys differ"
        for key in stored:
            _same(now[key], stored[key], f"{where}.{key}")
        return
    b = _numeric(stored)
    if b is not None and not isinstance(stored, bool):
        a = _numeric(now)
        assert a is not None and a.shape == b.shape, f"{where}: {now!r:.80} is not like {stored!r:.80}"
        np.testing.assert_allclose(a, b, atol=GOLDEN_ATOL, rtol=GOLDEN_RTOL, equal_nan=True, err_msg=where)
    elif isinstance(stored, list):
        assert isinstance(now, list) and len(now) == len(stored), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(now, stored)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert now == stored, f"{where}: {now!r} != {stored!r}"


def test_interventions_scan_and_confirm_rows_equal_the_stored_golden_outputs():
    stored = json.loads(REFERENCE.read_text())
    now = json.loads(json.dumps(compute()))            # through JSON, as stored
    now.pop("platform"), stored.pop("platform")     # recorded for the reader; the tolerance is the same everywhere
    _same(now, stored, "golden")
    # not vacuous: the stored arms move the logits, and the tables have rows
    moved = [n for n, r in stored["arms"].items()
             if np.abs(np.asarray(r["logits"]) - np.asarray(r["clean"])).max() > 1e-3]
    assert len(moved) >= len(stored["arms"]) - 1          # all but the exact restore
    assert len(stored["scan_rows"]["data"]) > 0 and len(stored["confirm_rows"]["data"]) > 0


if __name__ == "__main__" and "--write" in sys.argv:
    REFERENCE.write_text(json.dumps(compute()) + "\n")
    print(f"wrote {REFERENCE} ({REFERENCE.stat().st_size} bytes)")
