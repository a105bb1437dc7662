"""The unpatched runs that interventions share: the clean candidate logits of a full forward, the recipient and
donor prefix caches of the query-time interventions, and the memo (`reuse_clean_runs`) that lets consecutive
interventions on the same pairs reuse them chunk for chunk."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from recurscope.interp.interventions.common import candidate_logits, check_pairs, chunks, logit_dtype, model_device
from recurscope.interp.models.cache import LayerCache, RecurrentCache

__all__ = ["reuse_clean_runs", "memoised", "prefix_caches", "run_prefixes", "clean_recipient_logits", "clean_run"]


class _CleanRunMemo:
    """Unpatched runs that consecutive interventions on the same pairs repeat chunk for chunk: the recipient's clean
    candidate logits of the write interventions, and the recipient and donor prefix caches of the query-time ones.
    A confirmation runs 14 arms over the same chunks, so keeping them saves most of its forwards. Entries are kept
    until `max_bytes` is reached and then no more are added (arms walk the chunks in the same order, so a full memo
    keeps serving its first chunks, where an evicting one would serve none)."""

    def __init__(self, model, max_bytes: int):
        self.model, self.max_bytes, self.used = model, int(max_bytes), 0
        self.entries: dict = {}
        self.hits = self.misses = 0

    def get(self, model, pairs, key, compute: Callable, nbytes: Callable):
        if model is not self.model:
            return compute()
        full_key = (id(pairs),) + key
        hit = self.entries.get(full_key)
        if hit is not None and hit[0] is pairs:       # the same PairBatch object, not a new one at a reused id
            self.hits += 1
            return hit[1]
        self.misses += 1
        value = compute()
        size = nbytes(value)
        if self.used + size <= self.max_bytes:
            self.entries[full_key] = (pairs, value)
            self.used += size
        return value


_MEMO: Optional[_CleanRunMemo] = None


class reuse_clean_runs:
    """Context manager: inside it, interventions on `model` share their unpatched runs (see _CleanRunMemo), up to
    `max_bytes` of kept tensors. Results are the same as without it (tested arm by arm); hooks a caller adds around
    an intervention must not change the unpatched runs while it is active (run_confirm adds none)."""

    def __init__(self, model, max_bytes: int = 1 << 30):
        self.memo = _CleanRunMemo(model, max_bytes)

    def __enter__(self) -> _CleanRunMemo:
        global _MEMO
        if _MEMO is not None and _MEMO.model is self.memo.model:
            self.memo = _MEMO                      # nested on the same model: keep sharing the outer memo
        self._outer, _MEMO = _MEMO, self.memo
        return self.memo

    def __exit__(self, *exc) -> None:
        global _MEMO
        _MEMO = self._outer


def memoised(model, pairs, key: tuple, compute: Callable, nbytes: Callable):
    """compute(), or its kept value inside reuse_clean_runs."""
    return compute() if _MEMO is None else _MEMO.get(model, pairs, key, compute, nbytes)


def _cache_bytes(cache: RecurrentCache) -> int:
    return sum(t.numel() * t.element_size() for lc in cache.layers
               for t in (lc.state, lc.keys, lc.values, *lc.conv.values()) if t is not None)


def _shallow(cache: RecurrentCache) -> RecurrentCache:
    """New cache and layer objects over the same tensors: an edit that reassigns a layer's tensor (set_head_state)
    cannot reach the memo's copy."""
    return RecurrentCache([LayerCache(lc.kind, lc.state, dict(lc.conv), lc.keys, lc.values) for lc in cache.layers],
                          cache.seen_tokens, cache.lengths)


def run_prefixes(model, pairs, rows: torch.Tensor, b: int, device) -> RecurrentCache:
    """The cache after tokens [0, b] of the recipients `rows` (cache rows 0..n-1) then their donors (n..2n-1), one
    prefix pass. Rows of different lengths (left-padded, PairBatch.lengths) run packed (cu_seqlens), each from its
    own first token, so their padding is never computed; the cache then holds each row's length."""
    rec, don = pairs.recipient_ids[rows, :b + 1], pairs.donor_ids[rows, :b + 1]
    pad = pairs.recipient_ids.shape[1] - pairs.row_lengths()[rows.cpu()]
    if not bool((pad > 0).any()):
        return model.run_prefix(torch.cat([rec, don]).to(device))
    if bool((pad > b).any()):
        raise ValueError(f"boundary {b} lies inside the left padding of a shorter row; choose boundaries after "
                         "every row's first token")
    from recurscope.interp.models.protocol import pack_rows

    ids = torch.cat([rec, don])
    tokens, cu = pack_rows([ids[i, p:] for i, p in enumerate(pad.repeat(2).tolist())])
    return model.run_prefix(tokens.to(device), cu_seqlens=cu)


def prefix_caches(model, pairs, rows: torch.Tensor, b: int, device) -> tuple[RecurrentCache, RecurrentCache]:
    """Recipient and donor caches after the prefix [0, b], from one batched (or packed: run_prefixes) forward."""
    def compute():
        cache = run_prefixes(model, pairs, rows, b, device)
        n = len(rows)
        return cache.select(torch.arange(n)), cache.select(torch.arange(n, 2 * n))
    R, D = memoised(model, pairs, ("prefix", tuple(rows.tolist()), int(b), str(device)), compute,
                    lambda rd: _cache_bytes(rd[0]) + _cache_bytes(rd[1]))
    return _shallow(R), _shallow(D)


def clean_recipient_logits(model, pairs, rows: torch.Tensor, rec: torch.Tensor, qp: torch.Tensor,
                           device) -> torch.Tensor:
    """The recipient rows' clean candidate logits from a full forward (logits at the answer position only)."""
    return memoised(model, pairs, ("clean", tuple(rows.tolist()), str(device)),
                    lambda: candidate_logits(model(rec, logit_positions=qp), pairs.candidate_ids[rows]),
                    lambda t: t.numel() * t.element_size())


def clean_run(model, pairs, batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Clean candidate logits (N, C) of recipient and donor from full forwards: {"recipient": ..., "donor": ...}.
    Rows of different lengths (PairBatch.lengths) run each length's rows as one batch of that length, so no row
    reads padding."""
    check_pairs(model, pairs)
    n = len(pairs)
    C = pairs.candidate_ids.shape[1]
    dtype = logit_dtype(model)       # float64 logits stay float64
    out = {"recipient": torch.empty(n, C, dtype=dtype), "donor": torch.empty(n, C, dtype=dtype)}
    if hasattr(pairs, "is_ragged") and pairs.is_ragged():
        lengths = pairs.row_lengths()
        for length in torch.unique(lengths).tolist():
            group = torch.nonzero(lengths == length)[:, 0]
            sub = clean_run(model, pairs.select(group.tolist()).trimmed(), batch_size=batch_size)
            out["recipient"][group], out["donor"][group] = sub["recipient"], sub["donor"]
        return out
    device = model_device(model)
    with torch.no_grad():
        for rows in chunks(torch.arange(n), batch_size):
            m = len(rows)
            qp = pairs.query_pos[rows].to(device).repeat(2)
            last = model(torch.cat([pairs.recipient_ids[rows], pairs.donor_ids[rows]]).to(device), logit_positions=qp)
            cand = pairs.candidate_ids[rows].repeat(2, 1)
            z = candidate_logits(last, cand)
            out["recipient"][rows], out["donor"][rows] = z[:m], z[m:]
    return out
