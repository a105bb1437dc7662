"""The query-time interventions (How Linear Attention Remembers, Sec. 2.2 and 3.3): state_swap puts the donor's state
into the chosen heads at the query boundary, output_patch the donor's readouts at the query positions, and
output_restore swaps the state and then restores the recipient's readouts. Each is a spec builder (`*_spec`, a
driver.SuffixSpec) and the function of the same name that runs it.

The query boundary b (default query_start - 1) splits a sequence into a prefix [0, b] and a suffix [b+1, T). "The
state at b" is S_b as it enters step b+1: the readout at b itself is the recipient's. Rows whose boundaries differ
(left-padded batches) are run in groups of equal boundary.
"""
from __future__ import annotations

from typing import Sequence

from recurscope.interp.interventions.common import (
    Head, HeadsArg, InterventionResult, by_layer, check_pairs, normalise_heads, resolve_boundaries,
)
from recurscope.interp.interventions.driver import SuffixRun, SuffixSpec, copy_head_out, run_intervention
from recurscope.interp.models.cache import RecurrentCache

__all__ = ["state_swap_spec", "output_patch_spec", "output_restore_spec", "state_swap", "output_patch",
           "output_restore", "swap_states"]


def swap_states(recipient: RecurrentCache, donor: RecurrentCache, heads: Sequence[Head]) -> RecurrentCache:
    """The recipient's cache with the donor's state in the chosen heads."""
    out = recipient
    for layer, hs in by_layer(heads).items():
        out = out.swap_from(donor, layers=[layer], heads=hs, parts=("state",))
    return out


def state_swap_spec(model, pairs, heads: HeadsArg, boundary=None) -> SuffixSpec:
    """The spec of state_swap (see there)."""
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)

    def suffix(ctx, R, D):
        return SuffixRun([ctx.rec, ctx.rec], [R, swap_states(R, D, heads)], ("clean", "logits"))
    return SuffixSpec("state_swap", heads, resolve_boundaries(pairs, boundary), suffix)


def output_patch_spec(model, pairs, heads: HeadsArg) -> SuffixSpec:
    """The spec of output_patch (see there)."""
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)

    def suffix(ctx, R, D):
        patches = copy_head_out(heads, ctx.m, 3, 1, 2, ctx.query_mask, model.n_state_heads, ctx.device,
                                group=model.query_group)
        return SuffixRun([ctx.rec, ctx.don, ctx.rec], [R, D, R], ("clean", "donor_clean", "logits"), patches)
    return SuffixSpec("output_patch", heads, resolve_boundaries(pairs, None), suffix, extra_keys=("donor_clean",))


def output_restore_spec(model, pairs, heads: HeadsArg, boundary=None, *, positions: str = "read",
                        name: str = "output_restore") -> SuffixSpec:
    """The spec of output_restore (see there); `name` names the result (the answer-position variant's)."""
    if positions not in ("read", "last"):
        raise ValueError(f"positions must be 'read' (every suffix readout up to query_pos) or 'last' (query_pos "
                         f"only); got {positions!r}")
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)

    def suffix(ctx, R, D):
        swapped = swap_states(R, D, heads)
        mask = ctx.read_mask if positions == "read" else ctx.last_mask
        patches = copy_head_out(heads, ctx.m, 3, 0, 2, mask, model.n_state_heads, ctx.device,
                                group=model.query_group)
        return SuffixRun([ctx.rec] * 3, [R, swapped, swapped], ("clean", "state_swap", "logits"), patches)
    return SuffixSpec(name, heads, resolve_boundaries(pairs, boundary), suffix, extra_keys=("state_swap",))


def state_swap(model, pairs, heads: HeadsArg, boundary=None, *, batch_size: int = 16,
               return_full: bool = False) -> InterventionResult:
    """Put the donor's recurrent matrix S_b into the chosen heads at the boundary b (default query_start - 1),
    keeping every other state and the short-conv tails as the recipient's, and run the suffix.

    Cost per chunk: one prefix forward of recipient and donor together, one suffix run of [clean; swapped].
    """
    return run_intervention(model, pairs, state_swap_spec(model, pairs, heads, boundary), batch_size=batch_size,
                            return_full=return_full)


def output_patch(model, pairs, heads: HeadsArg, *, batch_size: int = 16,
                 return_full: bool = False) -> InterventionResult:
    """Keep the recipient's state; replace only the chosen heads' query-time output o_t (hook_head_out at every query
    position, query_start..query_pos) with the donor's o_t from the donor's own run.

    One suffix run of [recipient clean; donor clean; patched]: the patched rows take the donor rows' o_t at each
    chosen layer inside the same forward; extra["donor_clean"] holds the donor's candidate logits.
    """
    return run_intervention(model, pairs, output_patch_spec(model, pairs, heads), batch_size=batch_size,
                            return_full=return_full)


def output_restore(model, pairs, heads: HeadsArg, boundary=None, *, positions: str = "read",
                   batch_size: int = 16, return_full: bool = False) -> InterventionResult:
    """A state_swap of the chosen heads, then the recipient's query-time output of those heads restored.

    positions="read" (default) restores every suffix position up to query_pos, i.e. every readout of the swapped
    state: the swapped state then reaches nothing else, so the logits equal the clean ones exactly, at any depth.
    positions="last" restores only query_pos; with a one-token suffix the two coincide, otherwise the earlier
    query tokens still read the swapped state and layers above the head see it (registry: output_restore_last).
    One suffix run of [clean; swapped; restored]; extra["state_swap"] holds the unrestored swap logits.
    """
    spec = output_restore_spec(model, pairs, heads, boundary, positions=positions)
    return run_intervention(model, pairs, spec, batch_size=batch_size, return_full=return_full)
