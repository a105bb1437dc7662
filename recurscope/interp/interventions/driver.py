"""The one driver of every intervention: pairs x patch spec x metric, in the spirit of TransformerLens's
`generic_activation_patch`. An intervention is a spec builder (writes.py, query_time.py, controls.py) that checks
its arguments and says what to patch; `run_intervention` walks the pairs in chunks, runs the unpatched and the
patched passes, gathers the candidate logits into an InterventionResult and, given a metric, returns the metric of
that result.

Two kinds of spec, after the two ways an intervention meets the sequence:
- WriteSpec: full forwards of the recipient with patches over position spans (write_block, donor_write, the random
  writes). Per chunk: the clean forward (shared through clean_runs.reuse_clean_runs), then the patched forward.
- SuffixSpec: query-time interventions. Per chunk of rows with equal boundary b: the recipient and donor prefixes
  [0, b] in one batch (also shared), then the suffix [b+1, T) as one batched run of blocks of rows (SuffixRun), each
  block a choice of tokens and cache, with readout patches between blocks of the same run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from recurscope.hooks.patches import ReadoutReplace, head_mask, patch_hooks
from recurscope.interp.interventions.clean_runs import clean_recipient_logits, prefix_caches
from recurscope.interp.interventions.common import (
    Head, InterventionResult, boundary_groups, by_layer, candidate_logits, chunks, model_device, span_mask,
)
from recurscope.interp.models.cache import RecurrentCache

__all__ = ["WriteSpec", "SuffixSpec", "SuffixRun", "SuffixContext", "run_intervention", "copy_head_out"]


@dataclass
class WriteSpec:
    """A write intervention. spans: (N, R, 2) checked [start, end) spans (common.resolve_spans);
    patches(rows, pos_mask, device): the patches of one chunk, pos_mask (m, T) True inside the rows' spans.
    extra: copied into the result's extra."""

    name: str
    heads: list[Head]
    spans: torch.Tensor
    patches: Callable[[torch.Tensor, torch.Tensor, torch.device], list]
    extra: dict = field(default_factory=dict)


@dataclass
class SuffixRun:
    """One batched suffix run: block i runs tokens[i] from caches[i] (each m rows); roles[i] names what block i's
    candidate logits are in the result ("clean", "logits", an extra key, or None when only its activations serve
    the patches). The full logits, when asked for, are the "logits" block's."""

    tokens: Sequence[torch.Tensor]
    caches: Sequence[RecurrentCache]
    roles: Sequence[Optional[str]]
    patches: Sequence = ()


@dataclass
class SuffixSpec:
    """A query-time intervention. boundary: (N,) checked boundaries (common.resolve_boundaries);
    suffix(ctx, R, D): the SuffixRun of one chunk, from its context and the recipient (R) and donor (D) caches
    after the prefix. extra_keys: the roles kept as result.extra; extra: copied into the result's extra."""

    name: str
    heads: list[Head]
    boundary: torch.Tensor
    suffix: Callable[["SuffixContext", RecurrentCache, RecurrentCache], SuffixRun]
    extra_keys: tuple = ()
    extra: dict = field(default_factory=dict)


class SuffixContext:
    """The suffix [b+1, T) of one chunk: tokens, answer offset, masks of the query and read positions."""

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

    def run(self, run: SuffixRun) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per block: candidate logits (m, C) and full logits (m, vocab) at the answer position."""
        hooks = patch_hooks(self.model, run.patches)
        tokens = torch.cat(list(run.tokens))
        logits, _ = self.model.run_suffix(tokens, RecurrentCache.cat(list(run.caches)), hooks)   # the model protocol
        reps = tokens.shape[0] // self.m
        last = logits[torch.arange(tokens.shape[0], device=logits.device), self.qp.repeat(reps)]
        z, last = candidate_logits(last, self.cand.repeat(reps, 1)), last.float()
        m = self.m
        return [z[i * m:(i + 1) * m] for i in range(reps)], [last[i * m:(i + 1) * m] for i in range(reps)]


def copy_head_out(heads, m: int, n_blocks: int, src_block: int, dst_block: int, pos_mask: torch.Tensor, H: int,
                  device, noise: Optional[dict] = None, group: int = 1) -> list[ReadoutReplace]:
    """Readout patches that, inside one batched run of n_blocks blocks of m rows, copy block `src_block`'s o_t of
    the chosen heads at pos_mask (m, L) into block `dst_block`. Both blocks are computed in the same forward, so
    the copied value is exactly what that run produces at that layer.

    heads are state heads (H of them); with query groups (group = model.query_group > 1) a state group's readout is
    the o_t of its `group` query heads h group .. h group + group - 1, all of which are copied.
    noise: {layer: (m, L, H * group, V) unit directions, one per query head}; then dst keeps its own o_t and gains
    ||o_t(src) - o_t(block 0)|| times the direction instead (the equal-norm random control).
    """
    src_rows = slice(src_block * m, (src_block + 1) * m)
    dst_rows = slice(dst_block * m, (dst_block + 1) * m)
    where = torch.zeros(n_blocks * m, pos_mask.shape[1], dtype=torch.bool)
    where[dst_rows] = pos_mask
    patches = []
    for layer, hs in by_layer(heads).items():
        def value(o, layer=layer):
            out = o.clone()
            if noise is None:
                out[dst_rows] = o[src_rows]
            else:
                scale = (o[src_rows].double() - o[:m].double()).norm(dim=-1, keepdim=True)
                out[dst_rows] = o[dst_rows] + (noise[layer].to(o.device) * scale).to(o.dtype)
            return out
        query = [h * group + j for h in hs for j in range(group)]
        patches.append(ReadoutReplace(layer, value=value, mask=head_mask(where, H * group, query).to(device)))
    return patches


def _write_chunks(model, pairs, spec: WriteSpec, batch_size: int, return_full: bool, keep) -> None:
    device = model_device(model)
    n, T = pairs.recipient_ids.shape
    for rows in chunks(torch.arange(n), batch_size):
        rec = pairs.recipient_ids[rows].to(device)
        qp = pairs.query_pos[rows].to(device)
        keep("clean", rows, clean_recipient_logits(model, pairs, rows, rec, qp, device))
        pos_mask = span_mask(spec.spans[rows], T)
        with model.hooks(fwd_hooks=patch_hooks(model, spec.patches(rows, pos_mask, device))):
            last = model(rec, logit_positions=qp)
        keep("logits", rows, candidate_logits(last, pairs.candidate_ids[rows]))
        if return_full:
            keep("full", rows, last.float())


def _suffix_chunks(model, pairs, spec: SuffixSpec, batch_size: int, return_full: bool, keep) -> None:
    device = model_device(model)
    for b, rows in boundary_groups(spec.boundary, batch_size):
        R, D = prefix_caches(model, pairs, rows, b, device)
        ctx = SuffixContext(model, pairs, rows, b, device)
        run = spec.suffix(ctx, R, D)
        z, last = ctx.run(run)
        for role, block in zip(run.roles, z):
            if role is not None:
                keep(role, rows, block)
        if return_full:
            keep("full", rows, last[list(run.roles).index("logits")])


def run_intervention(model, pairs, spec, *, batch_size: int = 16, return_full: bool = False,
                     metric: Optional[Callable] = None):
    """Runs `spec` (a WriteSpec or SuffixSpec from a spec builder) over `pairs` in chunks of batch_size rows.

    Returns the InterventionResult (candidate logits, clean logits, by-products; full logits with return_full), or
    metric(pairs, result) when a metric is given (e.g. interp.metrics.example_metrics for one row per example).
    """
    n = len(pairs)
    parts: dict = {}

    def keep(key: str, rows: torch.Tensor, t: torch.Tensor) -> None:
        parts.setdefault(key, []).append((rows, t.detach().cpu()))

    with torch.no_grad():
        if isinstance(spec, WriteSpec):
            _write_chunks(model, pairs, spec, batch_size, return_full, keep)
            extra_keys = ()
        elif isinstance(spec, SuffixSpec):
            _suffix_chunks(model, pairs, spec, batch_size, return_full, keep)
            extra_keys = spec.extra_keys
        else:
            raise TypeError(f"spec must be a WriteSpec or a SuffixSpec (from a spec builder such as "
                            f"interventions.state_swap_spec), got {type(spec).__name__}")

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
    extra.update(spec.extra)
    result = InterventionResult(spec.name, list(spec.heads), gather("logits"), gather("clean"),
                                gather("full") if return_full else None, extra)
    return result if metric is None else metric(pairs, result)
