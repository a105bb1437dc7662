"""Donor/recipient interventions on chosen recurrent heads (How Linear Attention Remembers, Sec. 2.2 and 3.3):
write_block, donor_write, state_swap, output_patch, output_restore, and their controls (equal-norm random update of
the state or the output, equal-norm random write in two forms, control head; a write block widened by the short
convolution's reach). Every function runs batched over a PairBatch and returns the four candidate logits at query_pos.

Conventions shared by every intervention:
- `heads` is one (layer, head) pair or a list of them; a list is intervened on JOINTLY in one run (effects of a
  head set are measured, never summed from single-head runs).
- Each result carries `clean`: the recipient's candidate logits computed along the same numerical path
  (full forward for the write interventions, prefix cache + suffix for the query-time ones), so
  "intervened - clean" contains only the intervention.
- The query boundary b (default query_start - 1) splits a sequence into a prefix [0, b] and a suffix [b+1, T).
  Query-time interventions run the prefix of recipient and donor once (one batch), edit the RecurrentCache, and run
  the suffix. "The state at b" is S_b as it enters step b+1: the readout at b itself is the recipient's.
- Rows whose boundaries differ (left-padded batches) are processed in groups of equal boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from recurscope.hooks.patches import ReadoutReplace, WriteReplace, WriteScale, head_mask, patch_hooks
from recurscope.hooks.points import hook_name
from recurscope.interp.models.cache import LayerCache, RecurrentCache

Head = tuple[int, int]
HeadsArg = Union[Head, Sequence[Head]]
SpansArg = Union[str, torch.Tensor]

__all__ = [
    "InterventionResult", "INTERVENTIONS", "INTERVENTION_NAMES", "NamedIntervention", "REGISTRY",
    "RANDOM_UPDATE_KINDS", "controls_of", "named_intervention", "normalise_heads", "check_pairs",
    "clean_run", "write_block", "donor_write", "state_swap", "output_patch", "output_restore", "random_update",
    "random_write", "RANDOM_WRITE_VARIANTS", "spans_with_conv_tail", "choose_control_heads", "control_head",
    "candidate_logits", "model_device", "prefix_caches", "reuse_clean_runs",
]


@dataclass
class InterventionResult:
    """Candidate logits of one intervention on a PairBatch.

    logits: (N, C) intervened candidate logits at query_pos; clean: (N, C) the recipient's, same numerical path.
    full: (N, vocab) intervened logits over the whole vocabulary at query_pos, when asked for (return_full=True).
    extra: by-products, e.g. output_restore's plain state-swap logits ("state_swap") and every run's donor clean
    candidate logits ("donor_clean") where a donor suffix was run anyway.
    """

    name: str
    heads: list[Head]
    logits: torch.Tensor
    clean: torch.Tensor
    full: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    def heads_label(self) -> str:
        return "+".join(f"L{l}H{h}" for l, h in self.heads)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------


def normalise_heads(model, heads: HeadsArg) -> list[Head]:
    """(layer, head) or a list of them -> sorted unique list, each checked with model.check_head."""
    if heads is None:
        raise ValueError("heads is None: pass a (layer, head) pair or a list of them, e.g. [(21, 3)]")
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(x, (int, np.integer)) for x in heads):
        heads = [heads]
    try:
        items = [tuple(int(x) for x in item) for item in heads]
    except TypeError:
        raise ValueError(f"heads must be a (layer, head) pair or a list of (layer, head) pairs, got {heads!r}; "
                         f"e.g. heads=[(21, 3)]") from None
    if not items:
        raise ValueError("heads is empty: an intervention needs at least one (layer, head) pair, e.g. [(21, 3)]")
    for item in items:
        if len(item) != 2:
            raise ValueError(f"each head must be a (layer, head) pair, got {item!r} in heads={heads!r}")
        model.check_head(*item)
    return sorted(set(items))


def check_pairs(model, pairs) -> None:
    """Raises a ValueError naming the fix if `pairs` cannot run on `model`."""
    for name in ("recipient_ids", "donor_ids", "query_start", "query_pos", "candidate_ids"):
        if not isinstance(getattr(pairs, name, None), torch.Tensor):
            raise ValueError(f"pairs must be an interp.data.PairBatch (from build_pairs); it has no tensor {name!r}")
    n = pairs.recipient_ids.shape[0]
    if n == 0:
        raise ValueError("pairs is empty (0 rows); build at least one pair")
    if pairs.recipient_ids.shape != pairs.donor_ids.shape:
        raise ValueError(f"donor and recipient must have equal length: donor_ids has shape "
                         f"{tuple(pairs.donor_ids.shape)}, recipient_ids {tuple(pairs.recipient_ids.shape)}; "
                         f"build both sides with one build_pairs call, which aligns them token by token")
    vocab = model.cfg.vocab_size
    for name in ("recipient_ids", "donor_ids", "candidate_ids"):
        t = getattr(pairs, name)
        if int(t.max()) >= vocab or int(t.min()) < 0:
            raise ValueError(f"pairs.{name} holds token ids in [{int(t.min())}, {int(t.max())}] but the model's vocab "
                             f"is [0, {vocab - 1}]: the pairs were built with a different tokenizer; rebuild them "
                             f"with this model's tokenizer (model.tokenizer)")
    T = pairs.recipient_ids.shape[1]
    qs, qp = pairs.query_start, pairs.query_pos
    if bool(((qp >= T) | (qp < qs) | (qs < 1)).any()):
        raise ValueError(f"pairs.query_start/query_pos must satisfy 1 <= query_start <= query_pos < T={T}; got "
                         f"query_start={qs.tolist()}, query_pos={qp.tolist()}")


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def _boundaries(pairs, boundary) -> torch.Tensor:
    """(N,) boundary per row: query_start - 1 by default; an int or an (N,) tensor otherwise."""
    n = len(pairs)
    if boundary is None:
        b = pairs.query_start - 1
    elif isinstance(boundary, (int, np.integer)):
        b = torch.full((n,), int(boundary), dtype=torch.long)
    else:
        b = torch.as_tensor(boundary, dtype=torch.long).cpu()
        if b.shape != (n,):
            raise ValueError(f"boundary must be None, an int or one position per row (shape ({n},)), got shape "
                             f"{tuple(b.shape)}")
    b = b.cpu()
    bad = (b < 0) | (b >= pairs.query_pos.cpu())
    if bool(bad.any()):
        raise ValueError(f"boundary must lie in [0, query_pos - 1] so that the answer position is in the suffix; "
                         f"got {b[bad].tolist()} against query_pos {pairs.query_pos.cpu()[bad].tolist()}")
    return b


def _spans(pairs, spans: SpansArg) -> torch.Tensor:
    """(N, R, 2) half-open spans per row; -1 rows are absent presentations."""
    n = len(pairs)
    rows = torch.arange(n)
    if isinstance(spans, str):
        if spans == "fact":
            return pairs.fact_spans[rows, pairs.target_fact].cpu()
        if spans == "value":
            return pairs.value_spans[rows, pairs.target_fact].cpu()
        raise ValueError(f"spans must be 'fact' (the target fact's whole spans), 'value' (its value tokens) or an "
                         f"(N, R, 2) tensor of [start, end) positions; got {spans!r}")
    t = torch.as_tensor(spans, dtype=torch.long).cpu()
    if t.dim() == 2 and t.shape[-1] == 2:
        t = t[:, None]
    if t.dim() != 3 or t.shape[0] != n or t.shape[-1] != 2:
        raise ValueError(f"spans tensor must have shape (N={n}, R, 2) of [start, end) positions, got {tuple(t.shape)}")
    T = pairs.recipient_ids.shape[1]
    valid = t[..., 0] >= 0
    if bool((valid & ((t[..., 1] < t[..., 0]) | (t[..., 1] > T))).any()):
        raise ValueError(f"spans must satisfy 0 <= start <= end <= T={T} (start -1 marks an absent span)")
    return t


def _span_mask(spans: torch.Tensor, T: int) -> torch.Tensor:
    """(N, T) bool: True on every position inside any valid span."""
    pos = torch.arange(T)[None, None, :]
    start, end = spans[..., 0:1], spans[..., 1:2]
    inside = (pos >= start) & (pos < end) & (start >= 0)
    return inside.any(1)


def _by_layer(heads: Sequence[Head]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for l, h in heads:
        out.setdefault(l, []).append(h)
    return out


def _chunks(rows: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    for i in range(0, len(rows), batch_size):
        yield rows[i:i + batch_size]


def _groups(b: torch.Tensor, batch_size: int) -> Iterable[tuple[int, torch.Tensor]]:
    """(boundary, row indices) chunks, rows grouped by equal boundary."""
    for value in torch.unique(b).tolist():
        rows = torch.nonzero(b == value)[:, 0]
        for chunk in _chunks(rows, batch_size):
            yield int(value), chunk


def candidate_logits(logits_last: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    return logits_last.float().gather(1, cand.to(logits_last.device)).cpu()


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------


class _Collector:
    """Forward hooks that keep a copy of each named activation of the last run."""

    def __init__(self, names: Iterable[str]):
        self.names = list(names)
        self.values: dict[str, torch.Tensor] = {}

    def hooks(self):
        def keep(t, hook):
            self.values[hook.name] = t.detach().clone()
        return [(name, keep) for name in self.names]


def _run(model, tokens, hooks=(), cache: Optional[RecurrentCache] = None):
    """Runs tokens (optionally continuing `cache`) with temporary hooks; returns (logits, new cache)."""
    return model.run_suffix(tokens, cache, hooks)   # the model protocol: native or transformers bridge alike


def _forward_for_hooks(model, tokens: torch.Tensor) -> None:
    """A forward run only for what its hooks capture: no position gets logits (the unembedding is skipped)."""
    model(tokens, logit_positions=torch.empty(tokens.shape[0], 0, dtype=torch.long, device=tokens.device))


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


def _memoised(model, pairs, key: tuple, compute: Callable, nbytes: Callable):
    """compute(), or its kept value inside reuse_clean_runs."""
    return compute() if _MEMO is None else _MEMO.get(model, pairs, key, compute, nbytes)


def _cache_bytes(cache: RecurrentCache) -> int:
    return sum(t.numel() * t.element_size() for lc in cache.layers
               for t in (lc.state, lc.keys, lc.values, *lc.conv.values()) if t is not None)


def _shallow(cache: RecurrentCache) -> RecurrentCache:
    """New cache and layer objects over the same tensors: an edit that reassigns a layer's tensor (set_head_state)
    cannot reach the memo's copy."""
    return RecurrentCache([LayerCache(lc.kind, lc.state, dict(lc.conv), lc.keys, lc.values) for lc in cache.layers],
                          cache.seen_tokens)


def prefix_caches(model, pairs, rows: torch.Tensor, b: int, device) -> tuple[RecurrentCache, RecurrentCache]:
    """Recipient and donor caches after the prefix [0, b], from one batched forward."""
    def compute():
        rec = pairs.recipient_ids[rows, :b + 1]
        don = pairs.donor_ids[rows, :b + 1]
        cache = model.run_prefix(torch.cat([rec, don]).to(device))
        n = len(rows)
        return cache.select(torch.arange(n)), cache.select(torch.arange(n, 2 * n))
    R, D = _memoised(model, pairs, ("prefix", tuple(rows.tolist()), int(b), str(device)), compute,
                     lambda rd: _cache_bytes(rd[0]) + _cache_bytes(rd[1]))
    return _shallow(R), _shallow(D)


def _swap_states(recipient: RecurrentCache, donor: RecurrentCache, heads: Sequence[Head]) -> RecurrentCache:
    out = recipient
    for layer, hs in _by_layer(heads).items():
        out = out.swap_from(donor, layers=[layer], heads=hs, parts=("state",))
    return out


def _finish(name, heads, n, parts, return_full, extra_keys=()) -> InterventionResult:
    """Assembles per-chunk outputs (lists of (rows, tensor)) into full (N, ...) tensors."""
    def gather(key):
        items = parts.get(key)
        if not items:
            return None
        first = items[0][1]
        out = torch.empty((n, *first.shape[1:]), dtype=first.dtype)
        for rows, t in items:
            out[rows] = t
        return out
    extra = {k: gather(k) for k in extra_keys if parts.get(k)}
    return InterventionResult(name, list(heads), gather("logits"), gather("clean"),
                              gather("full") if return_full else None, extra)


def _store(parts: dict, key: str, rows: torch.Tensor, t: torch.Tensor) -> None:
    parts.setdefault(key, []).append((rows, t.detach().cpu()))


def clean_run(model, pairs, batch_size: int = 16) -> dict[str, torch.Tensor]:
    """Clean candidate logits (N, C) of recipient and donor from full forwards: {"recipient": ..., "donor": ...}."""
    check_pairs(model, pairs)
    device = model_device(model)
    n = len(pairs)
    C = pairs.candidate_ids.shape[1]
    out = {"recipient": torch.empty(n, C), "donor": torch.empty(n, C)}
    with torch.no_grad():
        for rows in _chunks(torch.arange(n), batch_size):
            m = len(rows)
            qp = pairs.query_pos[rows].to(device).repeat(2)
            last = model(torch.cat([pairs.recipient_ids[rows], pairs.donor_ids[rows]]).to(device), logit_positions=qp)
            cand = pairs.candidate_ids[rows].repeat(2, 1)
            z = candidate_logits(last, cand)
            out["recipient"][rows], out["donor"][rows] = z[:m], z[m:]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Write interventions (full forwards with hooks on the write)
# ---------------------------------------------------------------------------------------------------------------


def _write_intervention(name, model, pairs, heads, spans, batch_size, return_full, make_patches):
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)
    span_t = _spans(pairs, spans)
    device = model_device(model)
    n, T = pairs.recipient_ids.shape
    parts: dict = {}
    with torch.no_grad():
        for rows in _chunks(torch.arange(n), batch_size):
            m = len(rows)
            rec = pairs.recipient_ids[rows].to(device)
            qp = pairs.query_pos[rows].to(device)
            cand = pairs.candidate_ids[rows]
            clean = _memoised(model, pairs, ("clean", tuple(rows.tolist()), str(device)),
                              lambda: candidate_logits(model(rec, logit_positions=qp), cand),  # at the answer only
                              lambda t: t.numel() * t.element_size())
            _store(parts, "clean", rows, clean)
            pos_mask = _span_mask(span_t[rows], T)
            with model.hooks(fwd_hooks=patch_hooks(model, make_patches(rows, pos_mask, device))):
                last = model(rec, logit_positions=qp)
            _store(parts, "logits", rows, candidate_logits(last, cand))
            if return_full:
                _store(parts, "full", rows, last.float())
    return _finish(name, heads, n, parts, return_full)


def write_block(model, pairs, heads: HeadsArg, *, spans: SpansArg = "fact", batch_size: int = 16,
                return_full: bool = False) -> InterventionResult:
    """Zero the chosen heads' writes over the target fact's spans (every presentation); decay and erase still act.

    spans: "fact" (whole fact spans, default), "value" (value tokens only) or an (N, R, 2) tensor of [start, end)
    positions (an empty span [s, s) blocks nothing).
    """
    heads_n = normalise_heads(model, heads)
    H = model.n_state_heads

    def make_patches(rows, pos_mask, device):
        return [WriteScale(layer, scale=0.0, mask=head_mask(pos_mask, H, hs).to(device))
                for layer, hs in _by_layer(heads_n).items()]

    return _write_intervention("write_block", model, pairs, heads_n, spans, batch_size, return_full, make_patches)


def donor_write(model, pairs, heads: HeadsArg, *, spans: SpansArg = "fact", batch_size: int = 16,
                return_full: bool = False) -> InterventionResult:
    """Replace the recipient's writes (u_t and x_t of the chosen heads) over the target fact's spans with the donor's,
    then run normally. One donor forward per chunk captures its write key and value; the recipient keeps its own
    erase and decay. spans as in write_block."""
    heads_n = normalise_heads(model, heads)
    layers = _by_layer(heads_n)
    H = model.n_state_heads

    def make_patches(rows, pos_mask, device):
        names = {l: (hook_name("hook_write_key", l), hook_name("hook_write_value", l)) for l in layers}
        donor = _Collector([n for pair in names.values() for n in pair])
        with model.hooks(fwd_hooks=donor.hooks()):
            _forward_for_hooks(model, pairs.donor_ids[rows].to(device))
        return [WriteReplace(layer, key=donor.values[names[layer][0]], value=donor.values[names[layer][1]],
                             mask=head_mask(pos_mask, H, hs).to(device))
                for layer, hs in layers.items()]

    return _write_intervention("donor_write", model, pairs, heads_n, spans, batch_size, return_full, make_patches)


#: random_write variants: "value" adds ε to x_t with ||ε|| = ||x_donor - x_recipient|| (the write key u_t kept);
#: "rank_one" replaces u_t x_t^T by a random rank-one write u' x'^T with ||u'|| = ||u_donor||, ||x'|| = ||x_donor||.
RANDOM_WRITE_VARIANTS = ("value", "rank_one")


def random_write(model, pairs, heads: HeadsArg, *, variant: str = "value", spans: SpansArg = "fact", seed: int = 0,
                 batch_size: int = 16, return_full: bool = False, row_ids=None) -> InterventionResult:
    """Equal-norm random control for donor_write, on the same spans and heads.

    variant="value": the recipient's write value becomes x_t + ε_t, ε_t a seeded Gaussian direction scaled per
    position and head to ||x_t(donor) - x_t(recipient)|| (zero where donor and recipient write the same value, e.g.
    on the key and template tokens of the span); the write key u_t is the recipient's.
    variant="rank_one": the write u_t x_t^T becomes u'_t x'^T_t with seeded Gaussian directions scaled to the donor's
    ||u_t|| and ||x_t||: a random rank-one write of the donor write's norm in place of the donor's.
    Directions depend on (seed, row index in pairs, layer, head, variant) only, not on batching; row_ids as in
    random_update (row indices in the larger batch a subset `pairs` was taken from).
    """
    if variant not in RANDOM_WRITE_VARIANTS:
        raise ValueError(f"variant must be one of {RANDOM_WRITE_VARIANTS}, got {variant!r}")
    heads_n = normalise_heads(model, heads)
    layers = _by_layer(heads_n)
    H = model.n_state_heads

    ids = torch.arange(len(pairs)) if row_ids is None else torch.as_tensor(row_ids, dtype=torch.long).cpu()
    if ids.shape != (len(pairs),):
        raise ValueError(f"row_ids must give one index per row of pairs ({len(pairs)}), got shape {tuple(ids.shape)}")

    def direction(shape, row, layer, head, stream):
        g = _gaussian(shape, seed, int(ids[row]), layer, head, stream=stream)
        return g / g.norm(dim=-1, keepdim=True)

    def make_patches(rows, pos_mask, device):
        names = {l: (hook_name("hook_write_key", l), hook_name("hook_write_value", l)) for l in layers}
        both = _Collector([n for pair in names.values() for n in pair])
        m = len(rows)
        with model.hooks(fwd_hooks=both.hooks()):
            _forward_for_hooks(model, torch.cat([pairs.recipient_ids[rows], pairs.donor_ids[rows]]).to(device))
        patches = []
        for layer, hs in layers.items():
            key, value = both.values[names[layer][0]], both.values[names[layer][1]]
            u_r, u_d, x_r, x_d = key[:m], key[m:], value[:m], value[m:]
            new_u, new_x = u_r.clone(), x_r.clone()
            T = key.shape[1]
            for i, row in enumerate(rows.tolist()):
                for h in hs:
                    if variant == "value":
                        scale = (x_d[i, :, h].double() - x_r[i, :, h].double()).norm(dim=-1, keepdim=True)
                        eps = direction((T, x_r.shape[-1]), row, layer, h, 1).to(device) * scale
                        new_x[i, :, h] = (x_r[i, :, h].double() + eps).to(x_r.dtype)
                    else:
                        u_norm = u_d[i, :, h].double().norm(dim=-1, keepdim=True)
                        x_norm = x_d[i, :, h].double().norm(dim=-1, keepdim=True)
                        new_u[i, :, h] = (direction((T, u_r.shape[-1]), row, layer, h, 2).to(device)
                                          * u_norm).to(u_r.dtype)
                        new_x[i, :, h] = (direction((T, x_r.shape[-1]), row, layer, h, 3).to(device)
                                          * x_norm).to(x_r.dtype)
            patches.append(WriteReplace(layer, key=new_u, value=new_x, mask=head_mask(pos_mask, H, hs).to(device)))
        return patches

    return _write_intervention(f"random_write:{variant}", model, pairs, heads_n, spans, batch_size, return_full,
                               make_patches)


def spans_with_conv_tail(model, pairs, spans: SpansArg = "fact") -> torch.Tensor:
    """(N, R, 2) spans widened by the short convolution's reach: each [start, end) becomes [start, end + W - 1)
    (W = conv_size; unchanged without short convolutions), capped at query_start. The convolution carries a span's
    tokens into the W - 1 tokens after it, so their writes carry the fact too; write_block(spans=this) blocks them."""
    t = _spans(pairs, spans).clone()
    reach = int(model.cfg.conv_size) - 1 if getattr(model.cfg, "use_short_conv", False) else 0
    cap = pairs.query_start.cpu()[:, None].expand(t.shape[:2])
    valid = t[..., 0] >= 0
    t[..., 1] = torch.where(valid, torch.minimum(t[..., 1] + reach, cap), t[..., 1])
    return t


# ---------------------------------------------------------------------------------------------------------------
# Query-time interventions (prefix cache + suffix)
# ---------------------------------------------------------------------------------------------------------------


def _query_time(name, model, pairs, heads, boundary, batch_size, return_full, body, extra_keys=()):
    """Shared loop: per chunk of equal boundary b, run both prefixes, then `body` runs the suffixes and returns
    {key: (m, C) candidate logits or (m, vocab) full logits}."""
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)
    b_all = _boundaries(pairs, boundary)
    device = model_device(model)
    n = len(pairs)
    parts: dict = {}
    with torch.no_grad():
        for b, rows in _groups(b_all, batch_size):
            R, D = prefix_caches(model, pairs, rows, b, device)
            ctx = _SuffixContext(model, pairs, rows, b, device)
            outputs = body(ctx, R, D, heads)
            for key, value in outputs.items():
                _store(parts, key, rows, value)
    return _finish(name, heads, n, parts, return_full, extra_keys)


class _SuffixContext:
    """The suffix [b+1, T) of one chunk: tokens, answer offset, and runs that return candidate logits."""

    def __init__(self, model, pairs, rows, b, device):
        self.model, self.rows, self.b, self.device = model, rows, b, device
        self.rec = pairs.recipient_ids[rows, b + 1:].to(device)
        self.don = pairs.donor_ids[rows, b + 1:].to(device)
        self.qp = (pairs.query_pos[rows] - (b + 1)).to(device)        # answer position inside the suffix
        qs = pairs.query_start[rows] - (b + 1)
        self.m = len(rows)
        self.cand = pairs.candidate_ids[rows]
        L = self.rec.shape[1]
        pos = torch.arange(L)[None, :]
        # Query positions of each row inside the suffix (for output_patch): [query_start, query_pos].
        self.query_mask = (pos >= qs.clamp(min=0)[:, None]) & (pos <= self.qp.cpu()[:, None])
        self.read_mask = pos <= self.qp.cpu()[:, None]            # every suffix position up to the answer
        self.last_mask = pos == self.qp.cpu()[:, None]

    def run(self, tokens, cache, hooks=()):
        """Returns (candidate logits (B, C), full last logits (B, vocab)); rows repeat self.rows as needed."""
        logits, _ = _run(self.model, tokens, hooks, cache)
        reps = tokens.shape[0] // self.m
        qp = self.qp.repeat(reps)
        last = logits[torch.arange(tokens.shape[0], device=logits.device), qp]
        return candidate_logits(last, self.cand.repeat(reps, 1)), last.float()


def _copy_head_out(heads, m: int, n_blocks: int, src_block: int, dst_block: int, pos_mask: torch.Tensor, H: int,
                   device, noise: Optional[dict] = None) -> list[ReadoutReplace]:
    """Readout patches that, inside one batched run of n_blocks blocks of m rows, copy block `src_block`'s o_t of
    the chosen heads at pos_mask (m, L) into block `dst_block`. Both blocks are computed in the same forward, so
    the copied value is exactly what that run produces at that layer.

    noise: {layer: (m, L, H, V) unit directions}; then dst keeps its own o_t and gains
    ||o_t(src) - o_t(block 0)|| times the direction instead (the equal-norm random control).
    """
    src_rows = slice(src_block * m, (src_block + 1) * m)
    dst_rows = slice(dst_block * m, (dst_block + 1) * m)
    where = torch.zeros(n_blocks * m, pos_mask.shape[1], dtype=torch.bool)
    where[dst_rows] = pos_mask
    patches = []
    for layer, hs in _by_layer(heads).items():
        def value(o, layer=layer):
            out = o.clone()
            if noise is None:
                out[dst_rows] = o[src_rows]
            else:
                scale = (o[src_rows].double() - o[:m].double()).norm(dim=-1, keepdim=True)
                out[dst_rows] = o[dst_rows] + (noise[layer].to(o.device) * scale).to(o.dtype)
            return out
        patches.append(ReadoutReplace(layer, value=value, mask=head_mask(where, H, hs).to(device)))
    return patches


def _stack(ctx, tokens: Sequence[torch.Tensor], caches: Sequence[RecurrentCache], patches=()):
    """One suffix run of several blocks of m rows; returns per-block candidate logits and full last logits."""
    hooks = patch_hooks(ctx.model, patches)
    z, last = ctx.run(torch.cat(list(tokens)), RecurrentCache.cat(list(caches)), hooks)
    m = ctx.m
    return [z[i * m:(i + 1) * m] for i in range(len(tokens))], [last[i * m:(i + 1) * m] for i in range(len(tokens))]


def state_swap(model, pairs, heads: HeadsArg, boundary=None, *, batch_size: int = 16,
               return_full: bool = False) -> InterventionResult:
    """Put the donor's recurrent matrix S_b into the chosen heads at the boundary b (default query_start - 1),
    keeping every other state and the short-conv tails as the recipient's, and run the suffix.

    Cost per chunk: one prefix forward of recipient and donor together, one suffix run of [clean; swapped].
    """
    def body(ctx: _SuffixContext, R, D, heads):
        swapped = _swap_states(R, D, heads)
        (clean, swap), (_, last) = _stack(ctx, [ctx.rec, ctx.rec], [R, swapped])
        out = {"clean": clean, "logits": swap}
        if return_full:
            out["full"] = last
        return out
    return _query_time("state_swap", model, pairs, heads, boundary, batch_size, return_full, body)


def output_patch(model, pairs, heads: HeadsArg, *, batch_size: int = 16,
                 return_full: bool = False) -> InterventionResult:
    """Keep the recipient's state; replace only the chosen heads' query-time output o_t (hook_head_out at every query
    position, query_start..query_pos) with the donor's o_t from the donor's own run.

    One suffix run of [recipient clean; donor clean; patched]: the patched rows take the donor rows' o_t at each
    chosen layer inside the same forward.
    """
    def body(ctx: _SuffixContext, R, D, heads):
        patches = _copy_head_out(heads, ctx.m, 3, 1, 2, ctx.query_mask, model.n_state_heads, ctx.device)
        (clean, donor, patched), (_, _, last) = _stack(ctx, [ctx.rec, ctx.don, ctx.rec], [R, D, R], patches)
        out = {"clean": clean, "donor_clean": donor, "logits": patched}
        if return_full:
            out["full"] = last
        return out
    return _query_time("output_patch", model, pairs, heads, None, batch_size, return_full, body,
                       extra_keys=("donor_clean",))


def output_restore(model, pairs, heads: HeadsArg, boundary=None, *, positions: str = "read",
                   batch_size: int = 16, return_full: bool = False) -> InterventionResult:
    """A state_swap of the chosen heads, then the recipient's query-time output of those heads restored.

    positions="read" (default) restores every suffix position up to query_pos, i.e. every readout of the swapped
    state: the swapped state then reaches nothing else, so the logits equal the clean ones exactly, at any depth.
    positions="last" restores only query_pos; with a one-token suffix the two coincide, otherwise the earlier
    query tokens still read the swapped state and layers above the head see it.
    One suffix run of [clean; swapped; restored]; extra["state_swap"] holds the unrestored swap logits.
    """
    if positions not in ("read", "last"):
        raise ValueError(f"positions must be 'read' (every suffix readout up to query_pos) or 'last' (query_pos "
                         f"only); got {positions!r}")

    def body(ctx: _SuffixContext, R, D, heads):
        swapped = _swap_states(R, D, heads)
        mask = ctx.read_mask if positions == "read" else ctx.last_mask
        patches = _copy_head_out(heads, ctx.m, 3, 0, 2, mask, model.n_state_heads, ctx.device)
        (clean, swap, restored), (_, _, last) = _stack(ctx, [ctx.rec] * 3, [R, swapped, swapped], patches)
        out = {"clean": clean, "state_swap": swap, "logits": restored}
        if return_full:
            out["full"] = last
        return out
    return _query_time("output_restore", model, pairs, heads, boundary, batch_size, return_full, body,
                       extra_keys=("state_swap",))


# ---------------------------------------------------------------------------------------------------------------
# Controls
# ---------------------------------------------------------------------------------------------------------------

#: Interventions for which an equal-norm random update is defined: those that replace a recipient quantity by the
#: donor's, so that a donor-minus-recipient change exists to match in norm. write_block has no donor; donor_write
#: changes rank-one writes u_t x_t^T, which a Gaussian matrix is not; output_restore is itself a restore.
RANDOM_UPDATE_KINDS = ("state_swap", "output_patch")


def _gaussian(shape, seed: int, row: int, layer: int, head: int, stream: int = 0) -> torch.Tensor:
    """A seeded Gaussian tensor, the same for a given (seed, row, layer, head, stream) however rows are batched;
    `stream` separates the draws of different controls (0: random_update)."""
    entropy = [int(seed), int(row), int(layer), int(head)] + ([int(stream)] if stream else [])
    state = np.random.SeedSequence(entropy).generate_state(2)
    gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _random_like_delta(delta: torch.Tensor, rows: torch.Tensor, layer: int, head: int, seed: int) -> torch.Tensor:
    """Per row, a Gaussian direction (shape delta.shape[1:]) scaled to that row's ||delta||_F."""
    out = torch.empty_like(delta, dtype=torch.float64)
    norms = delta.double().flatten(1).norm(dim=1)
    for i, row in enumerate(rows.tolist()):
        g = _gaussian(delta.shape[1:], seed, row, layer, head)
        out[i] = g / g.norm() * norms[i].cpu()
    return out


def random_update(model, pairs, heads: HeadsArg, kind: str = "state_swap", *, seed: int = 0, boundary=None,
                  batch_size: int = 16, return_full: bool = False, row_ids=None) -> InterventionResult:
    """Equal-norm random control for `kind` in RANDOM_UPDATE_KINDS.

    state_swap: for each row and chosen head, add G to the recipient state S_b, where G is a seeded Gaussian matrix
    scaled to ||S_b(donor) - S_b(recipient)||_F of that row and head (the change the swap would make).
    output_patch: at every query position, add to the recipient's o_t a seeded Gaussian vector scaled to
    ||o_t(donor) - o_t(recipient)|| of that row, position and head.
    Directions depend on (seed, row index in pairs, layer, head) only, not on batching. row_ids: when `pairs` is a
    subset of a larger batch (a distributed work unit), each row's index in that batch, so the subset draws the
    same directions as the whole batch would.
    """
    if kind not in RANDOM_UPDATE_KINDS:
        raise ValueError(f"random_update is defined for kind in {RANDOM_UPDATE_KINDS}, got {kind!r}: write_block has "
                         f"no donor change to match, donor_write changes rank-one writes (use a control head "
                         f"instead), output_restore is a restore")
    ids = torch.arange(len(pairs)) if row_ids is None else torch.as_tensor(row_ids, dtype=torch.long).cpu()
    if ids.shape != (len(pairs),):
        raise ValueError(f"row_ids must give one index per row of pairs ({len(pairs)}), got shape {tuple(ids.shape)}")

    if kind == "state_swap":
        def body(ctx: _SuffixContext, R, D, heads):
            perturbed = R.clone()
            for layer, head in heads:
                S_r, S_d = R.head_state(layer, head), D.head_state(layer, head)
                g = _random_like_delta(S_d - S_r, ids[ctx.rows], layer, head, seed)
                perturbed.set_head_state(layer, head, (S_r.double() + g.to(S_r.device)).to(S_r.dtype))
            z, last = ctx.run(torch.cat([ctx.rec, ctx.rec]), RecurrentCache.cat([R, perturbed]))
            out = {"clean": z[:ctx.m], "logits": z[ctx.m:]}
            if return_full:
                out["full"] = last[ctx.m:]
            return out
        return _query_time("random_update:state_swap", model, pairs, heads, boundary, batch_size, return_full, body)

    if boundary is not None:
        raise ValueError("boundary applies to kind='state_swap' only; output_patch acts at the query positions")

    def body(ctx: _SuffixContext, R, D, heads):
        L, (_, V) = ctx.rec.shape[1], model.cfg.state_shape()
        noise = {}
        for layer, hs in _by_layer(heads).items():
            directions = torch.zeros(ctx.m, L, model.n_state_heads, V, dtype=torch.float64)
            for h in hs:
                for i, row in enumerate(ids[ctx.rows].tolist()):
                    g = _gaussian((L, V), seed, row, layer, h)
                    directions[i, :, h] = g / g.norm(dim=-1, keepdim=True)
            noise[layer] = directions
        patches = _copy_head_out(heads, ctx.m, 3, 1, 2, ctx.query_mask, model.n_state_heads, ctx.device,
                                 noise=noise)
        (clean, _, patched), (_, _, last) = _stack(ctx, [ctx.rec, ctx.don, ctx.rec], [R, D, R], patches)
        out = {"clean": clean, "logits": patched}
        if return_full:
            out["full"] = last
        return out
    return _query_time("random_update:output_patch", model, pairs, heads, None, batch_size, return_full, body)


def choose_control_heads(model, heads: HeadsArg, scan=None) -> list[Head]:
    """One control head per chosen head, at the same layer and never among the chosen heads.

    With a scan (a ScanResult or a DataFrame with columns layer, head, J): among that layer's other heads, the head
    whose |J| is the median (sorted by |J| ascending then head index; the lower median for an even count).
    Without a scan: the head H/2 places further round the layer, (h + H // 2) mod H, stepping on by one past any
    chosen head. Raises if a layer has no head left to serve as control.
    """
    chosen = normalise_heads(model, heads)
    taken = set(chosen)
    H = model.n_state_heads
    table = None
    if scan is not None:
        table = getattr(scan, "heads", scan)
        missing = [c for c in ("layer", "head", "J") if c not in getattr(table, "columns", [])]
        if missing:
            raise ValueError(f"scan must be a ScanResult or a DataFrame with columns layer, head, J; missing {missing}")
    controls = []
    for layer, head in chosen:
        free = [h for h in range(H) if (layer, h) not in taken and (layer, h) not in controls]
        if not free:
            raise ValueError(f"layer {layer} has no head left for a control (all {H} heads are chosen); choose "
                             f"fewer heads in that layer")
        if table is None:
            pick = next(((head + H // 2 + k) % H for k in range(H) if (head + H // 2 + k) % H in free))
        else:
            sub = table[(table["layer"] == layer) & (table["head"].isin(free))]
            if len(sub) != len(free):
                raise ValueError(f"scan has no J for some heads of layer {layer} ({free}); pass the full scan")
            order = sorted(zip(sub["J"].abs().tolist(), sub["head"].tolist()))
            pick = int(order[(len(order) - 1) // 2][1])
        controls.append((layer, pick))
    return controls


def control_head(model, pairs, heads: HeadsArg, intervention: str = "state_swap", *, scan=None,
                 **kwargs) -> InterventionResult:
    """The same intervention on control heads (choose_control_heads), run jointly; result.extra["controls_for"]
    records the heads they stand in for."""
    if intervention not in INTERVENTIONS:
        raise ValueError(f"intervention must be one of {sorted(INTERVENTIONS)}, got {intervention!r}")
    chosen = normalise_heads(model, heads)
    controls = choose_control_heads(model, chosen, scan)
    result = INTERVENTIONS[intervention](model, pairs, controls, **kwargs)
    result.name = f"control_head:{intervention}"
    result.extra["controls_for"] = chosen
    return result


# ---------------------------------------------------------------------------------------------------------------
# The registry of named interventions (confirm, report, plots and the CLI read it; nothing else lists them)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NamedIntervention:
    """One row of the confirmation protocol.

    name: the `intervention` value in result rows; label: how the report names it; controls: the intervention this
    one is a control for (None for a main intervention or variant); metric: the effect the report reads it by (the
    controls: the donor-specific shift, which a mere loss of confidence in the recipient's answer does not move).
    run(model, pairs, heads, *, batch_size, seed, scan, row_ids) runs it jointly on `heads`; row_ids (each row's
    index in a larger batch that `pairs` was taken from) seeds the random control, the others ignore it.
    """

    name: str
    label: str
    run: Callable[..., InterventionResult]
    controls: Optional[str] = None
    metric: str = "donor_margin_shift"

    @property
    def is_control(self) -> bool:
        return self.controls is not None


def _plain(fn, **fixed):
    def run(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
        return fn(model, pairs, heads, batch_size=batch_size, **fixed)
    return run


def _restore_last(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    # Restores only the readout at the answer position. Restoring every readout after the swap ("output_restore")
    # gives the clean run by construction, since a head's state reaches the rest of the network only through its
    # readouts; with a multi-token query this variant can leak through readouts at earlier query tokens, which is
    # what it measures.
    result = output_restore(model, pairs, heads, positions="last", batch_size=batch_size)
    result.name = "output_restore_last"
    return result


def _random_state_update(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    return random_update(model, pairs, heads, kind="state_swap", seed=seed, batch_size=batch_size, row_ids=row_ids)


def _control_head_swap(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    return control_head(model, pairs, heads, "state_swap", scan=scan, batch_size=batch_size)


def _control_head_of(kind: str):
    def run(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
        result = control_head(model, pairs, heads, kind, scan=scan, batch_size=batch_size)
        result.name = f"control_head_{kind}"
        return result
    return run


def _random_write_value(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    return random_write(model, pairs, heads, variant="value", seed=seed, batch_size=batch_size, row_ids=row_ids)


def _random_write_rank_one(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    return random_write(model, pairs, heads, variant="rank_one", seed=seed, batch_size=batch_size, row_ids=row_ids)


def _random_output_patch(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    return random_update(model, pairs, heads, kind="output_patch", seed=seed, batch_size=batch_size, row_ids=row_ids)


def _write_block_conv_tail(model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None):
    result = write_block(model, pairs, heads, spans=spans_with_conv_tail(model, pairs), batch_size=batch_size)
    result.name = "write_block_conv_tail"
    return result


#: What the report reads a control by: the donor-specific shift (metrics.example_metrics). The donor margin also
#: rises whenever the recipient's answer merely loses confidence, towards the non-donor distractors alike, so a
#: control is "near zero" when the donor in particular does not gain.
CONTROL_METRIC = "donor_specific_shift"


#: In protocol order (How Linear Attention Remembers, Figures 3/4): the five interventions, the answer-position
#: restore variant and the write block widened by the short convolution, then each causal arm's controls (an
#: equal-norm random change of what the arm changes, and the same arm on the control head).
REGISTRY: tuple[NamedIntervention, ...] = (
    NamedIntervention("write_block", "write block", _plain(write_block)),
    NamedIntervention("donor_write", "donor write", _plain(donor_write)),
    NamedIntervention("state_swap", "state swap", _plain(state_swap)),
    NamedIntervention("output_patch", "output patch", _plain(output_patch)),
    NamedIntervention("output_restore", "output restore (after state swap)", _plain(output_restore)),
    NamedIntervention("output_restore_last", "output restore, answer position only", _restore_last),
    NamedIntervention("write_block_conv_tail", "write block, span + conv reach", _write_block_conv_tail),
    NamedIntervention("random_update", "equal-norm random update", _random_state_update, controls="state_swap",
                      metric=CONTROL_METRIC),
    NamedIntervention("control_head", "control head (state swap)", _control_head_swap, controls="state_swap",
                      metric=CONTROL_METRIC),
    NamedIntervention("random_write", "equal-norm random write (value)", _random_write_value,
                      controls="donor_write", metric=CONTROL_METRIC),
    NamedIntervention("random_write_rank_one", "equal-norm random write (rank one)", _random_write_rank_one,
                      controls="donor_write", metric=CONTROL_METRIC),
    NamedIntervention("control_head_donor_write", "control head (donor write)", _control_head_of("donor_write"),
                      controls="donor_write", metric=CONTROL_METRIC),
    NamedIntervention("random_output_patch", "equal-norm random output patch", _random_output_patch,
                      controls="output_patch", metric=CONTROL_METRIC),
    NamedIntervention("control_head_output_patch", "control head (output patch)", _control_head_of("output_patch"),
                      controls="output_patch", metric=CONTROL_METRIC),
)
INTERVENTION_NAMES: tuple[str, ...] = tuple(i.name for i in REGISTRY)
#: The five interventions of the paper, as the public functions (control_head repeats one of them).
INTERVENTIONS: dict[str, Callable] = {
    "write_block": write_block, "donor_write": donor_write, "state_swap": state_swap,
    "output_patch": output_patch, "output_restore": output_restore,
}


def named_intervention(name: str) -> NamedIntervention:
    """The registry entry called `name`; a ValueError lists the known names otherwise."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown intervention {name!r}; known: {list(INTERVENTION_NAMES)}")


def controls_of(name: str) -> list[NamedIntervention]:
    """The registry's controls for intervention `name` (e.g. state_swap -> random_update, control_head)."""
    named_intervention(name)
    return [entry for entry in REGISTRY if entry.controls == name]
