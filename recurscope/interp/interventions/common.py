"""What every intervention shares: the result type, the argument checks (heads, pairs, spans, boundaries), row
chunking, candidate logits and a hook collector. The scan and the protocols use these too."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

Head = tuple[int, int]
HeadsArg = Union[Head, Sequence[Head]]
SpansArg = Union[str, torch.Tensor]

__all__ = [
    "Head", "HeadsArg", "SpansArg", "InterventionResult", "normalise_heads", "check_pairs", "model_device",
    "resolve_boundaries", "resolve_spans", "span_mask", "by_layer", "chunks", "boundary_groups", "candidate_logits",
    "Collector", "forward_for_hooks", "require_one_query_per_state",
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


def require_one_query_per_state(model, what: str) -> None:
    """Refuses a model whose states are each read by several query heads (GLA-7B's query groups) for an analysis
    that reads one query head's V-dimensional readout per state."""
    group = getattr(model, "query_group", 1)
    if group > 1:
        raise ValueError(f"{what} reads one query head's output per state, but each state of this model is read by "
                         f"{group} query heads (num_kv_heads < num_heads); run it on a model with one query head per "
                         "state, or use the state-level interventions (state_swap, write_block, donor_write)")


def normalise_heads(model, heads: HeadsArg) -> list[Head]:
    """(layer, head) or a list of them -> sorted unique list, each checked with model.check_head."""
    if heads is None:
        raise ValueError("heads is None: pass a (layer, head) pair or a list of them, e.g. [(21, 3)]")
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(x, (int, np.integer)) for x in heads):
        heads = [heads]
    try:   # operator.index: a string '0' or a float 0.9 is refused, not converted or truncated
        items = [tuple(_head_index(x) for x in item) for item in heads]
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


def _head_index(x) -> int:
    if isinstance(x, (bool, str)):
        raise TypeError(x)
    return operator.index(x)


def check_pairs(model, pairs) -> None:
    """Raises a ValueError naming the fix if `pairs` cannot run on `model`."""
    for name in ("recipient_ids", "donor_ids", "query_start", "query_pos", "candidate_ids"):
        if not isinstance(getattr(pairs, name, None), torch.Tensor):
            raise ValueError(f"pairs must be an interp.data.PairBatch (from build_pairs); it has no tensor {name!r}")
    n = pairs.recipient_ids.shape[0]
    if n == 0:
        raise ValueError("pairs is empty (0 rows); build at least one pair")
    if getattr(pairs, "candidate_tokens", None) is not None:
        raise ValueError("these pairs' answers are several tokens (pairs.candidate_tokens), which one position's "
                         "candidate logits cannot score; only the hybrid cache factorial (recurscope hybrid) scores "
                         "them, by their full conditional log-likelihood")
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
    made_with = (getattr(pairs, "report", None) or {}).get("tokenizer_hash")
    tokenizer = getattr(model, "tokenizer", None)
    if made_with is not None and tokenizer is not None:
        from recurscope.interp.data.tokenizer import vocabulary_hash

        if vocabulary_hash(tokenizer) != made_with:
            raise ValueError(f"the pairs were built with another tokenizer (vocabulary {made_with[:15]}...) than "
                             f"this model's ({vocabulary_hash(tokenizer)[:15]}...): token ids would mean other "
                             "words; rebuild them with build_pairs(model.tokenizer, ...)")
    T = pairs.recipient_ids.shape[1]
    qs, qp = pairs.query_start, pairs.query_pos
    if bool(((qp >= T) | (qp < qs) | (qs < 1)).any()):
        raise ValueError(f"pairs.query_start/query_pos must satisfy 1 <= query_start <= query_pos < T={T}; got "
                         f"query_start={qs.tolist()}, query_pos={qp.tolist()}")


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def logit_dtype(model) -> torch.dtype:
    """The dtype candidate_logits gives for this model's logits: float32, or float64 for a float64 model."""
    return torch.promote_types(next(model.parameters()).dtype, torch.float32)


def resolve_boundaries(pairs, boundary) -> torch.Tensor:
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


def resolve_spans(pairs, spans: SpansArg) -> torch.Tensor:
    """(N, R, 2) half-open spans per row from "fact", "value" or a tensor; -1 rows are absent presentations."""
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


def span_mask(spans: torch.Tensor, T: int) -> torch.Tensor:
    """(N, T) bool: True on every position inside any valid span."""
    pos = torch.arange(T)[None, None, :]
    start, end = spans[..., 0:1], spans[..., 1:2]
    inside = (pos >= start) & (pos < end) & (start >= 0)
    return inside.any(1)


def by_layer(heads: Sequence[Head]) -> dict[int, list[int]]:
    """{layer: [heads]} in the order the heads come."""
    out: dict[int, list[int]] = {}
    for l, h in heads:
        out.setdefault(l, []).append(h)
    return out


def chunks(rows: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    """`rows` in consecutive pieces of at most batch_size."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    for i in range(0, len(rows), batch_size):
        yield rows[i:i + batch_size]


def boundary_groups(b: torch.Tensor, batch_size: int) -> Iterable[tuple[int, torch.Tensor]]:
    """(boundary, row indices) chunks, rows grouped by equal boundary."""
    for value in torch.unique(b).tolist():
        rows = torch.nonzero(b == value)[:, 0]
        for chunk in chunks(rows, batch_size):
            yield int(value), chunk


def candidate_logits(logits_last: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """(B, C) logits of each row's candidates, on the CPU, from (B, vocab) logits: float32, or float64 for a float64
    model (a head's small effect is then not float32's rounding of the margin)."""
    acc = torch.promote_types(logits_last.dtype, torch.float32)
    return logits_last.to(acc).gather(1, cand.to(logits_last.device)).cpu()


class Collector:
    """Forward hooks that keep a copy of each named activation of the last run."""

    def __init__(self, names: Iterable[str]):
        self.names = list(names)
        self.values: dict[str, torch.Tensor] = {}

    def hooks(self):
        def keep(t, hook):
            self.values[hook.name] = t.detach().clone()
        return [(name, keep) for name in self.names]


def forward_for_hooks(model, tokens: torch.Tensor) -> None:
    """A forward run only for what its hooks capture: no position gets logits (the unembedding is skipped)."""
    model(tokens, logit_positions=torch.empty(tokens.shape[0], 0, dtype=torch.long, device=tokens.device))
