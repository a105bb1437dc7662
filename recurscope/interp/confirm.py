"""Confirmatory patching on held-out sources: the heads come from a scan's result directory (never re-chosen), and
all five interventions plus both controls run on them; per-source rows, bootstrap summaries and figures.

Protocol of "How Linear Attention Remembers", sections 2.2-3.2: write_block, donor_write, state_swap, output_patch,
output_restore; controls (CONTROLS) for each causal arm: for the state swap an equal-norm random update and the
control head; for the donor write an equal-norm random write (value and rank-one forms) and the control head; for the
output patch an equal-norm random output patch and the control head (chosen by the documented rule in
`interventions.choose_control_heads`). The write block also runs on the fact spans widened by the short
convolution's reach (`interventions.spans_with_conv_tail`). Two restore variants:
`output_restore` restores every readout of the swapped heads after the boundary (exactly the clean run, by
construction) and `output_restore_last` only the readout at the answer position. The arms, their order and
their controls come from `interventions.REGISTRY`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd
import torch

from recurscope.interp import interventions as iv
from recurscope.interp.metrics import example_metrics, summarise_metrics
from recurscope.interp.results import check_run_dir

CONFIRM_TABLE = "confirm_rows"
CONFIRM_KEY = ("intervention", "row")
ARMS = iv.INTERVENTION_NAMES   # the registry, in protocol order
#: The controls of each causal arm, from the registry: {arm: (control names...)}.
CONTROLS = {main: tuple(c.name for c in iv.controls_of(main)) for main in iv.INTERVENTIONS if iv.controls_of(main)}


@dataclass
class ConfirmResult:
    rows: pd.DataFrame        # one per (intervention, example)
    summary: pd.DataFrame     # per intervention and metric: estimate, low, high (source bootstrap)
    heads: list               # the confirmed heads [(layer, head)]
    control_heads: list


#: the columns of scan_heads.csv that confirm and the protocols read
SCAN_HEAD_COLUMNS = ("layer", "head", "J")


def heads_from_scan(scan_dir, model=None, top_k: int = 1) -> list[tuple[int, int]]:
    """The top-k heads by J from a scan result directory. With `model`, refuses a scan made on another checkpoint."""
    from recurscope.interp.results import check_input_run, checkpoint_hash

    scan_dir = Path(scan_dir)
    heads_path = scan_dir / "scan_heads.csv"
    here = checkpoint_hash(model.checkpoint_dir) if getattr(model, "checkpoint_dir", None) else None
    check_input_run(scan_dir, option="--from-scan", kinds=("scan",), tables={"scan_heads": SCAN_HEAD_COLUMNS},
                    checkpoint=here)
    heads = pd.read_csv(heads_path)
    bad = [c for c in SCAN_HEAD_COLUMNS if not pd.api.types.is_numeric_dtype(heads[c]) or heads[c].isna().any()]
    if bad:
        raise ValueError(f"--from-scan {scan_dir}: scan_heads.csv has non-numeric or empty {bad} values (damaged); "
                         "rerun `recurscope scan` to rewrite it")
    heads = heads.sort_values("J", ascending=False, kind="stable")
    if len(heads) < top_k:
        raise ValueError(f"the scan has {len(heads)} heads; cannot take the top {top_k}")
    return [(int(r.layer), int(r.head)) for r in heads.head(top_k).itertuples()]


def confirm_arm(model, pairs, heads: Sequence, arm: str, *, scan_heads: Optional[pd.DataFrame] = None,
                seed: int = 0, batch_size: int = 16, row_ids: Optional[Sequence[int]] = None) -> pd.DataFrame:
    """One arm of the confirmation (a name in interventions.REGISTRY) jointly on `heads` over `pairs`: one row per
    example (interp.metrics columns).

    row_ids: when `pairs` is a subset of a larger batch (a distributed work unit), each row's index in that batch;
    it fills the "row" column and seeds the random control, so a subset gives the rows the whole batch would."""
    entry = iv.named_intervention(arm)
    ids = list(range(len(pairs))) if row_ids is None else [int(i) for i in row_ids]
    metric = lambda p, result: example_metrics(p, result, intervention=arm)  # noqa: E731
    lengths = pairs.row_lengths() if hasattr(pairs, "row_lengths") else None
    if lengths is not None and pairs.is_ragged() and \
            isinstance(entry.spec(model, pairs, heads, seed=seed, scan=scan_heads, row_ids=ids), iv.WriteSpec):
        # Rows of different lengths: a write arm's full forwards run each length's rows as one batch of that length
        # (the rows' padding cut off), so no padding is computed; the query-time arms run their prefixes packed
        # (interventions.clean_runs.run_prefixes). row_ids keep each row's seed and index.
        parts = []
        for length in torch.unique(lengths).tolist():
            group = torch.nonzero(lengths == length)[:, 0].tolist()
            sub = entry.run(model, pairs.select(group).trimmed(), heads, batch_size=batch_size, seed=seed,
                            scan=scan_heads, row_ids=[ids[i] for i in group], metric=metric)
            sub.index = group
            parts.append(sub)
        frame = pd.concat(parts).sort_index().reset_index(drop=True)
    else:
        frame = entry.run(model, pairs, heads, batch_size=batch_size, seed=seed, scan=scan_heads, row_ids=row_ids,
                          metric=metric)
    frame["row"] = ids
    return frame


def run_confirm(model, pairs, heads: Sequence, run_dir=None, *, scan_heads: Optional[pd.DataFrame] = None,
                seed: int = 0, batch_size: int = 16, arms: Sequence[str] = ARMS,
                progress: Optional[Callable[[str], None]] = None, n_resamples: int = 9999,
                share_runs: bool = True) -> ConfirmResult:
    """Runs every arm jointly on `heads` over the held-out `pairs`; rows are appended per arm, so an interrupted
    run resumes at the first arm whose rows are incomplete (an arm a distributed run left half done is rerun and
    only its missing rows are written).

    share_runs: the arms share their unpatched runs (clean logits, prefix caches; interventions.reuse_clean_runs),
    which leaves every row as it is and saves most of the forwards; False runs each arm from scratch."""
    check_run_dir(run_dir, "run_confirm")
    entries = [iv.named_intervention(arm) for arm in arms]
    heads = iv.normalise_heads(model, heads)
    controls = iv.choose_control_heads(model, heads, scan=scan_heads)
    log = None if run_dir is None else run_dir.table(CONFIRM_TABLE, key=list(CONFIRM_KEY))
    done = set() if log is None else log.done_keys()
    frames = []
    with iv.reuse_clean_runs(model) if share_runs else contextlib.nullcontext():
        for entry in entries:
            arm = entry.name
            missing = [i for i in range(len(pairs)) if (arm, i) not in done]
            if not missing:
                continue
            if progress:
                progress(arm)
            frame = confirm_arm(model, pairs, heads, arm, scan_heads=scan_heads, seed=seed, batch_size=batch_size)
            if log is not None:
                log.append(frame[frame["row"].isin(missing)].to_dict("records"))
            frames.append(frame)
    rows = log.read() if log is not None else pd.concat(frames, ignore_index=True)
    summary = summarise_confirm(rows, n_resamples=n_resamples, seed=seed)
    if run_dir is not None:
        run_dir.write_table("confirm_summary", summary)
        run_dir.write_table(CONFIRM_TABLE, rows)         # the row log's finished copy, CSV and parquet
    return ConfirmResult(rows, summary, heads, controls)


def summarise_confirm(rows: pd.DataFrame, n_resamples: int = 9999, seed: int = 0) -> pd.DataFrame:
    """Source-bootstrap 95% CIs per intervention, with clean and intervened accuracy for the figure's right panel."""
    rows = rows.copy()
    rows["clean_accuracy"] = rows["clean_correct"].astype(float)
    rows["intervened_accuracy"] = rows["correct"].astype(float)
    metrics = ["donor_margin_shift", "donor_specific_shift", "distractor_shift", "donor_answer", "target_margin_change",
               "clean_accuracy", "intervened_accuracy"]
    target = rows[rows["is_target"]] if "is_target" in rows.columns else rows
    return summarise_metrics(target, metrics, by=("intervention",), n_resamples=n_resamples, seed=seed)
