"""The head-selection scan of How Linear Attention Remembers (Sec. 2.3, appendix B): every recurrent head's
single-head state_swap at the query boundary, scored by the donor-margin shift, batched so that all heads of a pair
cost one prefix forward (recipient and donor) plus short suffixes, with rows logged so an interrupted scan resumes.

Score. With m_i = z_{i,d_i} - z_{i,r_i} over the candidate logits,

    J(l, h) = mean over sources s of [ mean over the pairs i of s of ( m_i^(l,h) - m_i^clean ) ]

i.e. the mean donor-margin shift, sources as the unit. The paper's eq. (6) prints the two margins side by side
without the minus sign, which reads as a product; the text ("mean change in the donor-margin") and figure 9
(signed margin shift) define the difference, which is what is implemented here.

Cost. Per pair: one prefix pass [0, b] of recipient and donor together (b = query_start - 1, no logits), one clean
suffix (the query tokens), then the patched suffixes as a growing batch. A row whose patch enters at layer l computes
exactly the clean suffix below l, so the suffix runs layer by layer from the lowest patched layer: at layer l the
rows patched there join the batch, each starting from the clean residual at l's input with the recipient's prefix
cache and the donor's state in its one head; rows run on through the layers above, and the logits are formed at the
query position only. Rows are chunked by batch_size. No full forward is rerun per head; `naive_head_shifts` is that
slow reference. The layers run through the model protocol's layer-by-layer methods (`embed_suffix`, `run_layer`,
`unembed`; interp.models.protocol), so the native models and the transformers bridge share this one path.

Rows of different lengths (left-padded, PairBatch.lengths; e.g. natural-length prompts of a real tokenizer) never
compute their padding: the prefix pass runs them packed (cu_seqlens), the clean suffix continues a cache that knows
each row's length, and each example's patched rows continue its own rows cut to its length. Rows equal each row
scanned alone (tests/interp/test_packed_rows.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from recurscope.interp.interventions.clean_runs import run_prefixes
from recurscope.interp.interventions.common import candidate_logits, check_pairs, model_device, normalise_heads
from recurscope.interp.models.cache import LayerCache, RecurrentCache
from recurscope.interp.results import check_run_dir

__all__ = ["ScanResult", "SCAN_KEY", "all_heads", "run_scan", "scan_rows", "summarise_scan", "naive_head_shifts"]

SCAN_KEY = ("source", "pair", "layer", "head")
SCAN_TABLE = "scan_rows"


@dataclass
class ScanResult:
    """rows: one per (source, pair, layer, head) with clean_margin, margin, shift.
    scores: one per (source, layer, head): the source's mean shift ("score").
    heads: one per (layer, head): J (mean of scores over sources), wins, n_sources, mean_rank, sorted by J.
    ranks: scores with each head's rank within its source (1 = largest shift).
    loso: leave-one-source-out winner check (None with fewer than 2 sources or heads). winner: argmax J."""

    rows: pd.DataFrame
    scores: pd.DataFrame
    heads: pd.DataFrame
    ranks: pd.DataFrame
    wins: pd.DataFrame
    loso: Optional[stats.LeaveOneSourceOut]
    winner: tuple


def all_heads(model) -> list[tuple[int, int]]:
    """Every (layer, head) with a recurrent state, in (layer, head) order."""
    return model.heads()


def _target_rows(pairs) -> torch.Tensor:
    rows = torch.nonzero(pairs.is_target.cpu() & (pairs.donor_answer_index.cpu() >= 0))[:, 0]
    if len(rows) == 0:
        raise ValueError("pairs has no target rows with a donor answer: the scan needs swap (or update) pairs; "
                         "neutral donors have no donor answer and non-target rows no donor margin")
    keys = list(zip(pairs.source_id[rows].tolist(), pairs.group[rows].tolist()))
    if len(set(keys)) != len(keys):
        raise ValueError("pairs has several target rows with the same (source_id, group): the scan keys rows by "
                         "(source, pair); build the pairs with one build_pairs call")
    return rows


def _margins(z: torch.Tensor, d: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(z.shape[0])
    return (z[idx, d] - z[idx, r]).double()


def _prefix_cache(model, pairs, ex: torch.Tensor, b: int, device) -> RecurrentCache:
    """The cache after tokens [0, b] of the recipients (rows 0..n-1) then the donors (rows n..2n-1), one batched
    prefix pass (run_prefix forms no logits: none are needed there); rows of different lengths run packed, so their
    padding is never computed (interventions.clean_runs.run_prefixes)."""
    return run_prefixes(model, pairs, ex, b, device)


def _example_cache(cache: RecurrentCache, n: int, e: int) -> RecurrentCache:
    """Rows e (recipient) and n + e (donor) of a cache of 2n rows with per-row lengths, as views: a cache of example
    e's own length whose K/V drop the left padding."""
    L = int(cache.lengths[e])
    cut = lambda t: None if t is None else t[e::n][:, cache.seen_tokens - L:]  # noqa: E731
    layers = [LayerCache(lc.kind, None if lc.state is None else lc.state[e::n], {k: v[e::n] for k, v in lc.conv.items()},
                         cut(lc.keys), cut(lc.values)) for lc in cache.layers]
    return RecurrentCache(layers, L)


def _rows_view(cache: RecurrentCache, rows: slice) -> RecurrentCache:
    """A cache of some of `cache`'s rows as views (nothing copied), their lengths with them."""
    return RecurrentCache([lc.map(lambda t: t[rows]) for lc in cache.layers], cache.seen_tokens,
                          None if cache.lengths is None else cache.lengths[rows])


def _rows_of(lc: LayerCache, row: int, count: int) -> LayerCache:
    """Cache row `row` for `count` rows as a batch-expanded view (stride 0): nothing is copied per row, and the
    chunked kernel reads an expanded initial state once per head."""
    return lc.map(lambda t: t[row:row + 1].expand(count, *t.shape[1:]))


def _query_logits(model, resid: torch.Tensor, qp: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Candidate logits at each row's query position only (the LM head runs on one position per row)."""
    h = resid[torch.arange(resid.shape[0], device=resid.device), qp.to(resid.device)]
    return candidate_logits(model.unembed(h), cand)


@contextmanager
def _outputs_only(model):
    """The suffix rows' final states (and K/V caches) are never read, so the mixers that can skip forming them
    (`keep_final_state`: the recurrent mixers, the native attention) do so meanwhile."""
    mixers = [b.mixer for b in model.blocks if hasattr(b.mixer, "keep_final_state")]
    before = [m.keep_final_state for m in mixers]
    try:
        for m in mixers:
            m.keep_final_state = False
        yield
    finally:
        for m, keep in zip(mixers, before):
            m.keep_final_state = keep


def _clean_suffix(model, cache: RecurrentCache, suffix: torch.Tensor):
    """Runs the recipients' suffix (cache rows 0..n-1, read in place) layer by layer; returns each layer's input
    residual, the final residual and the layers' context (model.embed_suffix), which serves the patched rows too."""
    n = suffix.shape[0]
    resid, context = model.embed_suffix(suffix, _rows_view(cache, slice(0, n)))
    inputs = []
    for i in range(len(cache.layers)):
        inputs.append(resid)
        resid = model.run_layer(i, resid, cache.layers[i].map(lambda t: t[:n]), context)
    return inputs, resid, context


def _patched_suffix(model, cache: RecurrentCache, clean_inputs: list, context, n: int, example: torch.Tensor,
                    layer: torch.Tensor, head: torch.Tensor, suffix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The growing batch, one example at a time: row j runs the layers from layer[j] up, entering with the clean
    residual of its example, the recipient's cache, and the donor's (cache row n + example) state in
    (layer[j], head[j]) only. Returns the final residuals and the row order (indices into example/layer/head)."""
    resids, orders = [], []
    for e in torch.unique(example).tolist():
        rows = torch.nonzero(example == e)[:, 0]
        if cache.lengths is None:
            resid, order = _example_suffix(model, cache, clean_inputs, context, n, e, layer[rows], head[rows])
        else:
            # rows of different lengths: example e's rows continue its recipient and donor rows cut to its own
            # length (views; K/V without the padding), as a cache of that length, so they neither read nor mask
            # the padding
            own = _example_cache(cache, n, e)
            ctx = model.embed_suffix(suffix[e:e + 1], _rows_view(own, slice(0, 1)))[1]
            resid, order = _example_suffix(model, own, [t[e:e + 1] for t in clean_inputs], ctx, 1, 0, layer[rows],
                                           head[rows])
        resids.append(resid)
        orders.append(rows[order])
    return torch.cat(resids), torch.cat(orders)


def _example_suffix(model, cache: RecurrentCache, clean_inputs: list, context, n: int, e: int, layer: torch.Tensor,
                    head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The growing batch of one example. Rows already running (patched below this layer) share the recipient's
    cache of the layer: it goes in as a batch-expanded view, so no state is copied per row. Rows entering here get
    their own copy of the recipient's state with the donor's head put in, and run as a second, small batch."""
    order = torch.argsort(layer, stable=True)
    layer, head = layer[order], head[order]
    resid = None
    for i in range(int(layer.min()), len(cache.layers)):
        lc = cache.layers[i]
        parts = []
        if resid is not None:
            parts.append(model.run_layer(i, resid, _rows_of(lc, e, len(resid)), context))
        entering = torch.nonzero(layer == i)[:, 0]
        if len(entering):
            m = len(entering)
            own = _rows_of(lc, e, m)
            h = head[entering].to(lc.state.device)
            own.state = own.state.clone()
            own.state[torch.arange(m, device=h.device), h] = lc.state[n + e, h]
            clean = clean_inputs[i][e:e + 1].expand(m, *clean_inputs[i].shape[1:])
            parts.append(model.run_layer(i, clean, own, context))
        resid = parts[0] if len(parts) == 1 else torch.cat(parts)
    return resid, order


def run_scan(model, pairs, run_dir=None, batch_size: int = 96, *, heads: Optional[Sequence] = None,
             prefix_batch: int = 4, progress: Optional[Callable[[int, int], None]] = None,
             table: str = SCAN_TABLE) -> ScanResult:
    """Scan every recurrent head (or `heads`) over the target rows of `pairs` (dev sources).

    batch_size: (pair, head) rows per suffix run. prefix_batch: pairs per prefix forward.
    run_dir: an interp.results.RunDir; rows go to its "scan_rows" table keyed by (source, pair, layer, head) as each
    suffix batch finishes, so a rerun on the same directory skips what is done and loses nothing; the per-head table
    is written as "scan_heads" at the end. table: the row log's name, for a scan inside another protocol's
    directory (headscan's "read_scan_rows"; its heads table is then "read_scan_heads"). progress(done, total) is
    called after each suffix batch.
    """
    frame = scan_rows(model, pairs, run_dir, batch_size, heads=heads, prefix_batch=prefix_batch, progress=progress,
                      table=table)
    result = summarise_scan(frame)
    if run_dir is not None:
        run_dir.write_table(table.replace("rows", "heads"), result.heads)
        run_dir.write_table(table, frame)                # the row log's finished copy, CSV and parquet
    return result


def check_scan_sizes(batch_size, prefix_batch) -> None:
    for name, value in (("batch_size", batch_size), ("prefix_batch", prefix_batch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def scan_rows(model, pairs, run_dir=None, batch_size: int = 96, *, heads: Optional[Sequence] = None,
              prefix_batch: int = 4, progress: Optional[Callable[[int, int], None]] = None,
              table: str = SCAN_TABLE) -> pd.DataFrame:
    """The rows of run_scan (one per target pair and head: clean margin, patched margin, shift) without the
    per-head summary; what a Ray worker computes for its unit. table: the row log's name (see run_scan)."""
    check_pairs(model, pairs)
    check_run_dir(run_dir, "run_scan")
    check_scan_sizes(batch_size, prefix_batch)
    head_list = all_heads(model) if heads is None else normalise_heads(model, heads)
    rows = _target_rows(pairs)
    device = model_device(model)
    log = None if run_dir is None else run_dir.table(table, key=list(SCAN_KEY))
    done = set() if log is None else log.done_keys()
    collected: list[dict] = []
    total = len(rows) * len(head_list)
    n_done = sum(1 for i in rows.tolist() for l, h in head_list
                 if (int(pairs.source_id[i]), int(pairs.group[i]), l, h) in done)
    heads_t = torch.tensor(head_list, dtype=torch.long)

    boundary = (pairs.query_start - 1).cpu()
    with torch.no_grad():
        for b in torch.unique(boundary[rows]).tolist():
            group = rows[boundary[rows] == b]
            for start in range(0, len(group), prefix_batch):
                ex = group[start:start + prefix_batch]
                # Work left for these pairs: (local example index, head index) not yet in the log.
                todo = [(e, j) for e, i in enumerate(ex.tolist()) for j, (l, h) in enumerate(head_list)
                        if (int(pairs.source_id[i]), int(pairs.group[i]), l, h) not in done]
                if not todo:
                    continue
                suffix = pairs.recipient_ids[ex, b + 1:].to(device)
                qp = pairs.query_pos[ex] - (b + 1)
                cand = pairs.candidate_ids[ex]
                d, r = pairs.donor_answer_index[ex], pairs.recipient_answer_index[ex]
                cache = _prefix_cache(model, pairs, ex, b, device)
                with _outputs_only(model):
                    clean_inputs, clean_out, context = _clean_suffix(model, cache, suffix)
                clean = _margins(_query_logits(model, clean_out, qp, cand), d, r)
                todo_t = torch.tensor(todo, dtype=torch.long)
                for c in range(0, len(todo_t), batch_size):
                    chunk = todo_t[c:c + batch_size]
                    e, j = chunk[:, 0], chunk[:, 1]
                    with _outputs_only(model):
                        resid, order = _patched_suffix(model, cache, clean_inputs, context, len(ex), e,
                                                       heads_t[j, 0], heads_t[j, 1], suffix)
                    e, j = e[order], j[order]
                    layer, head = heads_t[j, 0], heads_t[j, 1]
                    margin = _margins(_query_logits(model, resid, qp[e], cand[e]), d[e], r[e])
                    new_rows = []
                    for k in range(len(e)):
                        i = int(ex[e[k]])
                        cm, mg = float(clean[e[k]]), float(margin[k])
                        new_rows.append({"source": int(pairs.source_id[i]), "pair": int(pairs.group[i]),
                                         "layer": int(layer[k]), "head": int(head[k]), "row": i, "boundary": int(b),
                                         "clean_margin": cm, "margin": mg, "shift": mg - cm})
                    if log is not None:
                        log.append(new_rows)
                    collected.extend(new_rows)
                    n_done += len(new_rows)
                    if progress is not None:
                        progress(n_done, total)

    frame = log.read() if log is not None else pd.DataFrame(collected)
    wanted = {(int(pairs.source_id[i]), int(pairs.group[i]), l, h) for i in rows.tolist() for l, h in head_list}
    keys = list(zip(frame["source"], frame["pair"], frame["layer"], frame["head"]))
    return frame[[k in wanted for k in keys]].reset_index(drop=True)


def summarise_scan(rows: pd.DataFrame) -> ScanResult:
    """Per-source scores, J per head, ranks, wins and the leave-one-source-out winner from scan rows."""
    # scipy (through interp.stats) is imported here, not at module load: Ray workers run units, never this summary
    from recurscope.interp import stats

    missing = [c for c in (*SCAN_KEY, "shift") if c not in rows.columns]
    if missing:
        raise ValueError(f"scan rows lack columns {missing}; they come from run_scan (columns {list(SCAN_KEY)}, shift)")
    rows = rows.sort_values(list(SCAN_KEY), kind="stable").reset_index(drop=True)
    scores = rows.groupby(["source", "layer", "head"], sort=True)["shift"].mean().rename("score").reset_index()
    J = scores.groupby(["layer", "head"], sort=True)["score"].agg(J="mean", n_sources="count").reset_index()
    ranks = stats.rank_per_source(scores, source_col="source", unit_cols=("layer", "head"), score_col="score")
    wins = stats.wins_per_head(scores, source_col="source", unit_cols=("layer", "head"), score_col="score")
    mean_rank = ranks.groupby(["layer", "head"])["rank"].mean().rename("mean_rank").reset_index()
    heads = J.merge(wins[["layer", "head", "wins"]], on=["layer", "head"]).merge(mean_rank, on=["layer", "head"])
    heads = heads.sort_values(["J", "layer", "head"], ascending=[False, True, True], kind="stable")
    heads = heads.reset_index(drop=True)
    n_sources, n_heads = scores["source"].nunique(), len(J)
    loso = None
    if n_sources >= 2 and n_heads >= 2:
        loso = stats.leave_one_source_out_winner(scores, source_col="source", unit_cols=("layer", "head"),
                                                 score_col="score")
    best = J.iloc[int(np.argmax(J["J"].to_numpy()))]          # first in (layer, head) order among ties
    return ScanResult(rows, scores, heads, ranks, wins, loso, (int(best["layer"]), int(best["head"])))


def naive_head_shifts(model, pairs, heads: Optional[Sequence] = None) -> pd.DataFrame:
    """The slow reference: for every target row and head, one full recipient forward with the head's S_b replaced
    by the donor's through hook_state (and the readout at b kept as the recipient's, which is what the cache swap
    means). Same columns as run_scan's rows. For tests and benchmarks."""
    from recurscope.hooks import ReadoutReplace, StateReplace, hook_name, run_with_patches

    check_pairs(model, pairs)
    head_list = all_heads(model) if heads is None else normalise_heads(model, heads)
    device = model_device(model)
    out = []
    with torch.no_grad():
        for i in _target_rows(pairs).tolist():
            b = int(pairs.query_start[i]) - 1
            qp = int(pairs.query_pos[i])
            rec, don = pairs.recipient_ids[i:i + 1].to(device), pairs.donor_ids[i:i + 1].to(device)
            cand = pairs.candidate_ids[i:i + 1]
            d, r = pairs.donor_answer_index[i:i + 1], pairs.recipient_answer_index[i:i + 1]
            clean_logits, rc = model.run_with_cache(rec, names_filter=lambda n: n.endswith("hook_head_out"))
            _, dc = model.run_with_cache(don, state_positions=[b], names_filter=lambda n: n.endswith("hook_state"))
            clean = float(_margins(candidate_logits(clean_logits[:, qp], cand), d, r)[0])
            for l, h in head_list:
                patches = [StateReplace(l, [h], b, dc[hook_name("hook_state", l)][:, 0]),
                           ReadoutReplace(l, model.query_heads(h), b, rc[hook_name("hook_head_out", l)])]
                logits = run_with_patches(model, rec, patches)
                margin = float(_margins(candidate_logits(logits[:, qp], cand), d, r)[0])
                out.append({"source": int(pairs.source_id[i]), "pair": int(pairs.group[i]), "layer": l, "head": h,
                            "row": i, "boundary": b, "clean_margin": clean, "margin": margin,
                            "shift": margin - clean})
    return pd.DataFrame(out)
