"""The cache `run_with_cache` returns: TransformerLens's ActivationCache, plus the recurrent state and the per-head
readouts stacked over the recurrent layers (what TransformerLens's own accessors do for attention heads)."""
from __future__ import annotations

from typing import Optional

import torch
from transformer_lens.ActivationCache import ActivationCache

READOUTS = ("hook_head_out", "hook_z")

#: TransformerLens's residual-decomposition helpers, each refused in one line with the reason it cannot run here
#: (docs/transformer_lens.md, "Limits"). They assume TransformerLens's own internals: LayerNorm hooks
#: (ln_final.hook_scale) and a final norm folded into W_U, attention heads with hook_z and W_O, and an MLP with
#: hook_post and W_out; recurscope's final norm is unfolded and model-specific, and its heads are state heads.
_NOT_HERE = {
    "logit_attrs": "needs the final norm folded into W_U and its scale hooked (ln_final.hook_scale); here the final "
                   "norm is the checkpoint's own, unfolded: take model.unembed(resid) of the components instead",
    "apply_ln_to_stack": "needs TransformerLens's LayerNorm hooks (hook_scale) and normalization_type; here the final "
                         "norm is the checkpoint's own: apply model.final_norm to the residual you decompose",
    "decompose_resid": "splits into attention and MLP heads by TransformerLens's internals (attn_only, hook_attn_out "
                       "per attention head); stack blocks.{l}.hook_mixer_out and hook_mlp_out with "
                       "cache.stack_activation instead",
    "get_full_resid_decomposition": "needs per-head results through W_O (blocks.{l}.attn.hook_z); recurscope's heads "
                                    "are state heads: use stack_head_readouts, or patch heads with patch specs",
    "stack_head_results": "needs attention heads' hook_z and W_O; use stack_head_readouts (per state head)",
    "compute_head_results": "needs attention heads' hook_z and W_O; use stack_head_readouts (per state head)",
    "stack_neuron_results": "needs TransformerLens's MLP internals (hook_post, W_out, d_mlp); stack "
                            "blocks.{l}.hook_mlp_out instead",
}


def _refuse(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"ActivationCache.{name} does not run on recurscope's models: {_NOT_HERE[name]}")
    method.__name__ = name
    method.__doc__ = f"Refused in one line: {_NOT_HERE[name]}."
    return method


class RecurrentActivationCache(ActivationCache):
    """An ActivationCache whose `state_positions` are those the run captured `hook_state` at (sorted). Keys may use
    TransformerLens's names for points named otherwise here (`cache["attn_out", l]` is blocks.{l}.hook_mixer_out,
    hooks.TL_ALIASES); its residual-decomposition helpers that assume its own internals are refused in one line."""

    def __init__(self, cache_dict: dict, model, state_positions: Optional[tuple] = None, has_batch_dim: bool = True):
        super().__init__(cache_dict, model, has_batch_dim=has_batch_dim)
        self.state_positions = state_positions

    def __getitem__(self, key) -> torch.Tensor:
        from transformer_lens.utilities import get_act_name

        from recurscope.hooks.points import canonical_name

        if isinstance(key, str) and key in self.cache_dict:
            return self.cache_dict[key]
        if isinstance(key, tuple):
            if len(key) > 1 and key[1] is not None and key[1] < 0:
                key = (key[0], self.model.cfg.n_layers + key[1], *key[2:])
            name = get_act_name(*key)
        else:
            name = key if "." in key else get_act_name(key)
        return self.cache_dict[canonical_name(name)]

    for _name in _NOT_HERE:
        locals()[_name] = _refuse(_name)
    del _name

    def _stack(self, point: str, what: str) -> tuple[torch.Tensor, list[int]]:
        layers = [l for l in self.model.recurrent_layers if f"blocks.{l}.mixer.{point}" in self.cache_dict]
        if not layers:
            raise ValueError(f"the cache holds no {point}: run run_with_cache with {what}")
        return torch.stack([self.cache_dict[f"blocks.{l}.mixer.{point}"] for l in layers]), layers

    def _position_index(self, position: int) -> int:
        if not self.state_positions or position not in self.state_positions:
            raise ValueError(f"position {position} was not captured: the run's state_positions are "
                             f"{self.state_positions}; pass it to run_with_cache(..., state_positions=[...])")
        return self.state_positions.index(position)

    def stack_states(self, position: Optional[int] = None, return_labels: bool = False):
        """S of every recurrent layer in the cache: (layers, B, P, H, K, V) over the captured positions, or
        (layers, B, H, K, V) at one of them. Labels: the layer indices."""
        stacked, layers = self._stack("hook_state", "state_positions=[...]")
        if position is not None:
            stacked = stacked[:, :, self._position_index(position)] if self.has_batch_dim \
                else stacked[:, self._position_index(position)]
        return (stacked, layers) if return_labels else stacked

    def stack_head_states(self, position: int, return_labels: bool = False):
        """S_t of every (layer, head) at one captured position: (layers x heads, B, K, V), ordered as
        `model.heads()`; labels "L{layer}H{head}" (TransformerLens's style)."""
        stacked, layers = self.stack_states(position, return_labels=True)
        heads_axis = 2 if self.has_batch_dim else 1
        per_head = stacked.movedim(heads_axis, 1).flatten(0, 1)
        labels = [f"L{l}H{h}" for l in layers for h in range(stacked.shape[heads_axis])]
        return (per_head, labels) if return_labels else per_head

    def stack_readouts(self, point: str = "hook_head_out", return_labels: bool = False):
        """A per-head readout of every recurrent layer: (layers, B, T, H, V); `point` is 'hook_head_out' (o_t before
        norm and gate) or 'hook_z' (after them)."""
        if point not in READOUTS:
            raise ValueError(f"point must be one of {READOUTS}, got {point!r}")
        stacked, layers = self._stack(point, f"{point} in names_filter")
        return (stacked, layers) if return_labels else stacked

    def stack_head_readouts(self, point: str = "hook_head_out", return_labels: bool = False):
        """The same per (layer, query head): (layers x query heads, B, T, V), labels "L{layer}H{head}"; with query
        groups (model.query_group = m > 1) "L{layer}H{group}q{j}", query j of state group `group`."""
        stacked, layers = self.stack_readouts(point, return_labels=True)
        heads_axis = 3 if self.has_batch_dim else 2
        per_head = stacked.movedim(heads_axis, 1).flatten(0, 1)
        m = getattr(self.model, "query_group", 1)
        name = (lambda h: f"H{h}") if m == 1 else (lambda h: f"H{h // m}q{h % m}")  # noqa: E731
        labels = [f"L{l}{name(h)}" for l in layers for h in range(stacked.shape[heads_axis])]
        return (per_head, labels) if return_labels else per_head
