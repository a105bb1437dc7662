"""The write interventions (How Linear Attention Remembers, Sec. 2.2): write_block zeroes the chosen heads' writes
over the target fact's spans, donor_write puts the donor's writes there, and the conv-tail write block widens the
spans by the short convolution's reach. Each is a spec builder (`*_spec`, a driver.WriteSpec) and the function of
the same name that runs it."""
from __future__ import annotations

import torch

from recurscope.hooks.patches import WriteReplace, WriteScale, head_mask
from recurscope.hooks.points import hook_name
from recurscope.interp.interventions.common import (
    Collector, HeadsArg, InterventionResult, SpansArg, by_layer, check_pairs, forward_for_hooks, normalise_heads,
    resolve_spans,
)
from recurscope.interp.interventions.driver import WriteSpec, run_intervention

__all__ = ["write_block_spec", "donor_write_spec", "conv_tail_write_block_spec", "spans_with_conv_tail",
           "write_block", "donor_write", "write_names"]


def write_names(layers) -> dict[int, tuple[str, str]]:
    """{layer: (its hook_write_key name, its hook_write_value name)}."""
    return {l: (hook_name("hook_write_key", l), hook_name("hook_write_value", l)) for l in layers}


def write_block_spec(model, pairs, heads: HeadsArg, *, spans: SpansArg = "fact",
                     name: str = "write_block") -> WriteSpec:
    """The spec of write_block (see there); `name` names the result (the conv-tail variant's)."""
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)
    H = model.n_state_heads

    def patches(rows, pos_mask, device):
        return [WriteScale(layer, scale=0.0, mask=head_mask(pos_mask, H, hs).to(device))
                for layer, hs in by_layer(heads).items()]

    return WriteSpec(name, heads, resolve_spans(pairs, spans), patches)


def donor_write_spec(model, pairs, heads: HeadsArg, *, spans: SpansArg = "fact") -> WriteSpec:
    """The spec of donor_write (see there)."""
    check_pairs(model, pairs)
    heads = normalise_heads(model, heads)
    layers = by_layer(heads)
    H = model.n_state_heads

    def patches(rows, pos_mask, device):
        names = write_names(layers)
        donor = Collector([n for pair in names.values() for n in pair])
        with model.hooks(fwd_hooks=donor.hooks()):
            forward_for_hooks(model, pairs.donor_ids[rows].to(device))
        return [WriteReplace(layer, key=donor.values[names[layer][0]], value=donor.values[names[layer][1]],
                             mask=head_mask(pos_mask, H, hs).to(device))
                for layer, hs in layers.items()]

    return WriteSpec("donor_write", heads, resolve_spans(pairs, spans), patches)


def spans_with_conv_tail(model, pairs, spans: SpansArg = "fact") -> torch.Tensor:
    """(N, R, 2) spans widened by the short convolution's reach: each [start, end) becomes [start, end + W - 1)
    (W = conv_size; unchanged without short convolutions), capped at query_start. The convolution carries a span's
    tokens into the W - 1 tokens after it, so their writes carry the fact too; write_block(spans=this) blocks them.
    A family's token shift (RWKV-7: FamilySpec.token_shift_reach = 1) widens a span the same way; RWKV-7's value-first
    residual moves layer 0's values to later layers at the same position, so the shifted span covers it too."""
    t = resolve_spans(pairs, spans).clone()
    reach = int(model.cfg.conv_size) - 1 if getattr(model.cfg, "use_short_conv", False) else 0
    reach = max(reach, int(getattr(getattr(model, "family", None), "token_shift_reach", 0)))
    cap = pairs.query_start.cpu()[:, None].expand(t.shape[:2])
    valid = t[..., 0] >= 0
    t[..., 1] = torch.where(valid, torch.minimum(t[..., 1] + reach, cap), t[..., 1])
    return t


def conv_tail_write_block_spec(model, pairs, heads: HeadsArg) -> WriteSpec:
    """write_block over the fact spans widened by the short convolution's reach (spans_with_conv_tail)."""
    check_pairs(model, pairs)
    return write_block_spec(model, pairs, heads, spans=spans_with_conv_tail(model, pairs),
                            name="write_block_conv_tail")


def write_block(model, pairs, heads: HeadsArg, *, spans: SpansArg = "fact", batch_size: int = 16,
                return_full: bool = False) -> InterventionResult:
    """Zero the chosen heads' writes over the target fact's spans (every presentation); decay and erase still act.

    spans: "fact" (whole fact spans, default), "value" (value tokens only) or an (N, R, 2) tensor of [start, end)
    positions (an empty span [s, s) blocks nothing).
    """
    return run_intervention(model, pairs, write_block_spec(model, pairs, heads, spans=spans), batch_size=batch_size,
                            return_full=return_full)


def donor_write(model, pairs, heads: HeadsArg, *, spans: SpansArg = "fact", batch_size: int = 16,
                return_full: bool = False) -> InterventionResult:
    """Replace the recipient's writes (u_t and x_t of the chosen heads) over the target fact's spans with the donor's,
    then run normally. One donor forward per chunk captures its write key and value; the recipient keeps its own
    erase and decay. spans as in write_block."""
    return run_intervention(model, pairs, donor_write_spec(model, pairs, heads, spans=spans), batch_size=batch_size,
                            return_full=return_full)
