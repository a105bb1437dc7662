"""The controls that isolate the donor (How Linear Attention Remembers, Sec. 3.2): the equal-norm random update of
the state or the readout (random_update), the equal-norm random write in two forms (random_write), and the same
intervention on control heads (control_head, chosen by choose_control_heads). Each is a spec builder (`*_spec`) and
the function of the same name that runs it. Random directions depend on (seed, row, layer, head, stream) only, not
on batching."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from recurscope.hooks.patches import WriteReplace, head_mask
from recurscope.interp.interventions.common import (
    Collector, Head, HeadsArg, InterventionResult, SpansArg, by_layer, check_pairs, forward_for_hooks,
    normalise_heads, resolve_boundaries, resolve_spans,
)
from recurscope.interp.interventions.driver import SuffixRun, SuffixSpec, WriteSpec, copy_head_out, run_intervention
from recurscope.interp.interventions.query_time import output_patch_spec, output_restore_spec, state_swap_spec
from recurscope.interp.interventions.writes import donor_write_spec, write_block_spec, write_names

__all__ = ["RANDOM_UPDATE_KINDS", "RANDOM_WRITE_VARIANTS", "SPEC_BUILDERS", "seeded_gaussian", "random_like_delta",
           "random_update_spec", "random_write_spec", "choose_control_heads", "control_head_spec", "random_update",
           "random_write", "control_head"]

#: Interventions for which an equal-norm random update is defined: those that replace a recipient quantity by the
#: donor's, so that a donor-minus-recipient change exists to match in norm. write_block has no donor; donor_write
#: changes rank-one writes u_t x_t^T, which a Gaussian matrix is not; output_restore is itself a restore.
RANDOM_UPDATE_KINDS = ("state_swap", "output_patch")

#: random_write variants: "value" adds ε to x_t with ||ε|| = ||x_donor - x_recipient|| (the write key u_t kept);
#: "rank_one" replaces u_t x_t^T by a random rank-one write u' x'^T with ||u'|| = ||u_donor||, ||x'|| = ||x_donor||.
RANDOM_WRITE_VARIANTS = ("value", "rank_one")

#: The spec builders of the five interventions, by name (control_head repeats one of them on other heads).
SPEC_BUILDERS: dict[str, Callable] = {
    "write_block": write_block_spec, "donor_write": donor_write_spec, "state_swap": state_swap_spec,
    "output_patch": output_patch_spec, "output_restore": output_restore_spec,
}


def seeded_gaussian(shape, seed: int, row: int, layer: int, head: int, stream: int = 0) -> torch.Tensor:
    """A seeded Gaussian tensor, the same for a given (seed, row, layer, head, stream) however rows are batched;
    `stream` separates the draws of different controls (0: random_update)."""
    entropy = [int(seed), int(row), int(layer), int(head)] + ([int(stream)] if stream else [])
    state = np.random.SeedSequence(entropy).generate_state(2)
    gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def random_like_delta(delta: torch.Tensor, rows: torch.Tensor, layer: int, head: int, seed: int) -> torch.Tensor:
    """Per row, a Gaussian direction (shape delta.shape[1:]) scaled to that row's ||delta||_F."""
    out = torch.empty_like(delta, dtype=torch.float64)
    norms = delta.double().flatten(1).norm(dim=1)
    for i, row in enumerate(rows.tolist()):
        g = seeded_gaussian(delta.shape[1:], seed, row, layer, head)
        out[i] = g / g.norm() * norms[i].cpu()
    return out


def _row_ids(pairs, row_ids) -> torch.Tensor:
    ids = torch.arange(len(pairs)) if row_ids is None else torch.as_tensor(row_ids, dtype=torch.long).cpu()
    if ids.shape != (len(pairs),):
        raise ValueError(f"row_ids must give one index per row of pairs ({len(pairs)}), got shape {tuple(ids.shape)}")
    return ids


def random_update_spec(model, pairs, heads: HeadsArg, kind: str = "state_swap", *, seed: int = 0, boundary=None,
                       row_ids=None) -> SuffixSpec:
    """The spec of random_update (see there)."""
    if kind not in RANDOM_UPDATE_KINDS:
        raise ValueError(f"random_update is defined for kind in {RANDOM_UPDATE_KINDS}, got {kind!r}: write_block has "
                         f"no donor change to match, donor_write changes rank-one writes (use a control head "
                         f"instead), output_restore is a restore")
    ids = _row_ids(pairs, row_ids)
    if kind == "output_patch" and boundary is not None:
        raise ValueError("boundary applies to kind='state_swap' only; output_patch acts at the query positions")
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)

    def state_suffix(ctx, R, D):
        perturbed = R.clone()
        for layer, head in heads:
            S_r, S_d = R.head_state(layer, head), D.head_state(layer, head)
            g = random_like_delta(S_d - S_r, ids[ctx.rows], layer, head, seed)
            perturbed.set_head_state(layer, head, (S_r.double() + g.to(S_r.device)).to(S_r.dtype))
        return SuffixRun([ctx.rec, ctx.rec], [R, perturbed], ("clean", "logits"))

    def output_suffix(ctx, R, D):
        L, (_, V) = ctx.rec.shape[1], model.cfg.state_shape()
        noise = {}
        for layer, hs in by_layer(heads).items():
            group = model.query_group                 # a state group's readout: its query heads, each its own draw
            directions = torch.zeros(ctx.m, L, model.n_state_heads * group, V, dtype=torch.float64)
            for qh in [h * group + j for h in hs for j in range(group)]:
                for i, row in enumerate(ids[ctx.rows].tolist()):
                    g = seeded_gaussian((L, V), seed, row, layer, qh)
                    directions[i, :, qh] = g / g.norm(dim=-1, keepdim=True)
            noise[layer] = directions
        patches = copy_head_out(heads, ctx.m, 3, 1, 2, ctx.query_mask, model.n_state_heads, ctx.device,
                                noise=noise, group=model.query_group)
        return SuffixRun([ctx.rec, ctx.don, ctx.rec], [R, D, R], ("clean", None, "logits"), patches)

    suffix = state_suffix if kind == "state_swap" else output_suffix
    return SuffixSpec(f"random_update:{kind}", heads, resolve_boundaries(pairs, boundary), suffix)


def random_write_spec(model, pairs, heads: HeadsArg, *, variant: str = "value", spans: SpansArg = "fact",
                      seed: int = 0, row_ids=None) -> WriteSpec:
    """The spec of random_write (see there)."""
    if variant not in RANDOM_WRITE_VARIANTS:
        raise ValueError(f"variant must be one of {RANDOM_WRITE_VARIANTS}, got {variant!r}")
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)
    layers = by_layer(heads)
    H = model.n_state_heads
    ids = _row_ids(pairs, row_ids)

    def direction(shape, row, layer, head, stream):
        g = seeded_gaussian(shape, seed, int(ids[row]), layer, head, stream=stream)
        return g / g.norm(dim=-1, keepdim=True)

    def patches(rows, pos_mask, device):
        names = write_names(layers)
        both = Collector([n for pair in names.values() for n in pair])
        m = len(rows)
        with model.hooks(fwd_hooks=both.hooks()):
            forward_for_hooks(model, torch.cat([pairs.recipient_ids[rows], pairs.donor_ids[rows]]).to(device))
        out = []
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
            out.append(WriteReplace(layer, key=new_u, value=new_x, mask=head_mask(pos_mask, H, hs).to(device)))
        return out

    return WriteSpec(f"random_write:{variant}", heads, resolve_spans(pairs, spans), patches)


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


def control_head_spec(model, pairs, heads: HeadsArg, intervention: str = "state_swap", *, scan=None,
                      name: str = "", **options):
    """The spec of control_head (see there); `name` names the result (default "control_head:<intervention>")."""
    if intervention not in SPEC_BUILDERS:
        raise ValueError(f"intervention must be one of {sorted(SPEC_BUILDERS)}, got {intervention!r}")
    chosen = normalise_heads(model, heads)
    spec = SPEC_BUILDERS[intervention](model, pairs, choose_control_heads(model, chosen, scan), **options)
    spec.name = name or f"control_head:{intervention}"
    spec.extra["controls_for"] = chosen
    return spec


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
    spec = random_update_spec(model, pairs, heads, kind, seed=seed, boundary=boundary, row_ids=row_ids)
    return run_intervention(model, pairs, spec, batch_size=batch_size, return_full=return_full)


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
    spec = random_write_spec(model, pairs, heads, variant=variant, spans=spans, seed=seed, row_ids=row_ids)
    return run_intervention(model, pairs, spec, batch_size=batch_size, return_full=return_full)


def control_head(model, pairs, heads: HeadsArg, intervention: str = "state_swap", *, scan=None, batch_size: int = 16,
                 return_full: bool = False, **options) -> InterventionResult:
    """The same intervention on control heads (choose_control_heads), run jointly; `options` go to its spec builder
    (boundary, spans, positions). result.extra["controls_for"] records the heads they stand in for."""
    spec = control_head_spec(model, pairs, heads, intervention, scan=scan, **options)
    return run_intervention(model, pairs, spec, batch_size=batch_size, return_full=return_full)
