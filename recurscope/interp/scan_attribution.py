"""Attribution patching of the head scan (issue 28.3): every head's state-swap effect estimated at once, to first
order, from the clean run, the donor's states and one backward pass per batch of pairs.

The exact scan (interp.scan) swaps one head's state S_b of the recipient's cache, after its prefix [0, b] with
b = query_start - 1, for the donor's, runs the query tokens on, and scores the donor-margin shift
m = z_donor_answer - z_recipient_answer at the query position. The state after step b feeds only the steps after b
(the readout at b is the recipient's), so the margin is a function m(S_b^(l)) of every recurrent layer's cached
state, and to first order

    shift(l, h) ~ < S_b,donor^(l,h) - S_b,recipient^(l,h) , dm/dS_b^(l,h) >      (the Frobenius inner product)

with the gradient taken on the clean run: the recipient's cache states are leaves, the suffix runs layer by layer
through the model protocol (as the exact scan's clean suffix does, so native and bridged models share it), and one
backward pass of the summed margins gives dm/dS_b for every layer, head and pair in the batch (the pairs' margins
do not share a path). The estimate is exact where m is linear in the head's state over the swap; it fails where
the exact effect saturates (a swap that already flips the answer moves the margin less than its slope says).

Results go where the exact scan's go: the "scan_rows" table with the same columns (margin = clean_margin +
estimate, shift = estimate) and "scan_heads". With `confirm_top=K`, the estimates of every head go to
"attribution_rows" / "attribution_heads" instead, and the exact scan of the K heads with the largest estimated J
fills "scan_rows" / "scan_heads".
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from recurscope.interp.interventions.common import check_pairs, model_device, normalise_heads
from recurscope.interp.models.cache import RecurrentCache
from recurscope.interp.results import check_run_dir
from recurscope.interp.scan import (SCAN_KEY, SCAN_TABLE, ScanResult, _margins, _outputs_only, _prefix_cache,
                                    _query_logits, _target_rows, all_heads, check_scan_sizes, run_scan,
                                    summarise_scan)

__all__ = ["METHODS", "ATTRIBUTION_TABLE", "attribution_shifts", "run_attribution_scan"]

METHODS = ("exact", "attribution")
ATTRIBUTION_TABLE = "attribution_rows"


@contextmanager
def _weights_frozen(model):
    """The weights take no part in the graph meanwhile: only the cached states' gradient is wanted."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        for p in params:
            p.requires_grad_(False)
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _state_gradients(model, cache: RecurrentCache, n: int, suffix: torch.Tensor, qp, cand, d, r, layers):
    """The clean margins of the n recipients (cache rows 0..n-1) and dm/dS_b of each layer in `layers`, (n, H, K, V),
    by one backward pass through the suffix."""
    leaves = {}
    own = []
    for i, lc in enumerate(cache.layers):
        rows = lc.map(lambda t: t[:n])
        if i in layers:
            rows.state = lc.state[:n].detach().clone().requires_grad_(True)
            leaves[i] = rows.state
        own.append(rows)
    with torch.enable_grad(), _weights_frozen(model), _outputs_only(model):
        resid, context = model.embed_suffix(suffix, cache)
        for i, lc in enumerate(own):
            resid = model.run_layer(i, resid, lc, context)
        margin = _margins(_query_logits(model, resid, qp, cand), d, r)
        grads = torch.autograd.grad(margin.sum(), [leaves[i] for i in layers])
    return margin.detach(), dict(zip(layers, grads))


def attribution_shifts(model, pairs, *, heads: Optional[Sequence] = None, prefix_batch: int = 4, log=None,
                       progress: Optional[Callable[[int, int], None]] = None) -> pd.DataFrame:
    """The first-order estimate of every head's state-swap shift on the target rows of `pairs`, as scan rows
    (source, pair, layer, head, row, boundary, clean_margin, margin, shift). log: a results RowLog keyed by
    SCAN_KEY; pairs whose rows are all there are skipped, and new rows are appended per batch of pairs."""
    check_pairs(model, pairs)
    if not isinstance(prefix_batch, (int, np.integer)) or prefix_batch < 1:
        raise ValueError(f"prefix_batch must be a positive integer, got {prefix_batch!r}")
    head_list = all_heads(model) if heads is None else normalise_heads(model, heads)
    layers = sorted({l for l, _ in head_list})
    rows = _target_rows(pairs)
    device = model_device(model)
    done = set() if log is None else log.done_keys()
    collected: list[dict] = []
    boundary = (pairs.query_start - 1).cpu()
    total, n_done = len(rows), 0
    for b in torch.unique(boundary[rows]).tolist():
        group = rows[boundary[rows] == b]
        for start in range(0, len(group), prefix_batch):
            ex = group[start:start + prefix_batch]
            keys = [(int(pairs.source_id[i]), int(pairs.group[i])) for i in ex.tolist()]
            if all((s, g, l, h) in done for s, g in keys for l, h in head_list):
                n_done += len(ex)
                continue
            n = len(ex)
            with torch.no_grad():
                cache = _prefix_cache(model, pairs, ex, b, device)
            suffix = pairs.recipient_ids[ex, b + 1:].to(device)
            qp = pairs.query_pos[ex] - (b + 1)
            clean, grads = _state_gradients(model, cache, n, suffix, qp, pairs.candidate_ids[ex],
                                            pairs.donor_answer_index[ex], pairs.recipient_answer_index[ex], layers)
            estimate = {}
            for l in layers:
                state = cache.layers[l].state
                delta = (state[n:2 * n] - state[:n]).to(grads[l].dtype)
                estimate[l] = (delta * grads[l]).flatten(2).sum(-1).double().cpu()    # (n, H)
            new_rows = []
            for e, i in enumerate(ex.tolist()):
                for l, h in head_list:
                    if (keys[e][0], keys[e][1], l, h) in done:
                        continue
                    cm, est = float(clean[e]), float(estimate[l][e, h])
                    new_rows.append({"source": keys[e][0], "pair": keys[e][1], "layer": l, "head": h, "row": i,
                                     "boundary": int(b), "clean_margin": cm, "margin": cm + est, "shift": est})
            if log is not None:
                log.append(new_rows)
            collected.extend(new_rows)
            n_done += n
            if progress is not None:
                progress(n_done, total)
    frame = log.read() if log is not None else pd.DataFrame(collected)
    wanted = {(int(pairs.source_id[i]), int(pairs.group[i]), l, h) for i in rows.tolist() for l, h in head_list}
    keys = list(zip(frame["source"], frame["pair"], frame["layer"], frame["head"]))
    return frame[[k in wanted for k in keys]].reset_index(drop=True)


def run_attribution_scan(model, pairs, run_dir=None, batch_size: int = 96, *, heads: Optional[Sequence] = None,
                         prefix_batch: int = 4, confirm_top: Optional[int] = None,
                         progress: Optional[Callable[[int, int], None]] = None) -> ScanResult:
    """The scan by attribution patching (module docstring). Returns the ScanResult of what "scan_rows" holds: the
    estimates of every head, or with confirm_top=K the exact scan (interp.scan.run_scan, batch_size rows per
    suffix run) of the K heads with the largest estimated J."""
    check_run_dir(run_dir, "run_attribution_scan")
    check_scan_sizes(batch_size, prefix_batch)    # batch_size=0 was accepted before (used only with confirm_top)
    if confirm_top is not None and (not isinstance(confirm_top, (int, np.integer)) or confirm_top < 1):
        raise ValueError(f"confirm_top must be a positive integer (heads to scan exactly), got {confirm_top!r}")
    table = SCAN_TABLE if confirm_top is None else ATTRIBUTION_TABLE
    log = None if run_dir is None else run_dir.table(table, key=list(SCAN_KEY))
    frame = attribution_shifts(model, pairs, heads=heads, prefix_batch=prefix_batch, log=log, progress=progress)
    estimated = summarise_scan(frame)
    if confirm_top is None:
        if run_dir is not None:
            run_dir.write_table("scan_heads", estimated.heads)
        return estimated
    if run_dir is not None:
        run_dir.write_table("attribution_heads", estimated.heads)
    top = [(int(l), int(h)) for l, h in estimated.heads[["layer", "head"]].head(int(confirm_top)).to_numpy()]
    return run_scan(model, pairs, run_dir=run_dir, batch_size=batch_size, heads=top, prefix_batch=prefix_batch)
