"""Patch specifications: small objects that turn "block this write", "swap this state", "replace this readout"
into TransformerLens forward hooks on the names in `hooks.points`.

Write and state patches change the recurrence itself, so their effect carries forward into every later step
(unlike a readout-only hook on a cached state).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

Heads = Union[int, Sequence[int]]
Positions = Union[int, Sequence[int], slice]


def _heads(h: Heads) -> list[int]:
    return [h] if isinstance(h, int) else list(h)


def _positions(p: Positions):
    return [p] if isinstance(p, int) else p


@dataclass
class WriteScale:
    """Multiplies the write of `heads` at `positions` by `scale` (0 = write_block); decay and erase still act."""
    layer: int
    heads: Heads
    positions: Positions
    scale: float = 0.0
    batch: Optional[Sequence[int]] = None   # rows of the batch to patch; None = all

    def fwd_hooks(self):
        heads, pos = _heads(self.heads), _positions(self.positions)

        def hook(ws, hook):
            ws = ws.clone()
            for r in (range(ws.shape[0]) if self.batch is None else self.batch):
                for h in heads:
                    ws[r, pos, h] = self.scale
            return ws
        return [(f"blocks.{self.layer}.mixer.hook_write_scale", hook)]


@dataclass
class WriteReplace:
    """Replaces the write u_t x_t^T of `heads` at `positions` by key ⊗ value (e.g. the donor's); the erase is kept.

    key: (B, T, H, K) and value: (B, T, H, V) full tensors from the donor run; only the chosen entries are used.
    """
    layer: int
    heads: Heads
    positions: Positions
    key: torch.Tensor
    value: torch.Tensor

    def fwd_hooks(self):
        heads, pos = _heads(self.heads), _positions(self.positions)

        def put(src):
            def hook(t, hook):
                if t.shape != src.shape:
                    raise ValueError(f"{hook.name}: replacement has shape {tuple(src.shape)} but the run has "
                                     f"{tuple(t.shape)}; donor and recipient must have equal length and batch")
                t = t.clone()
                for h in heads:
                    t[:, pos, h] = src[:, pos, h].to(t.dtype)
                return t
            return hook
        return [(f"blocks.{self.layer}.mixer.hook_write_key", put(self.key)),
                (f"blocks.{self.layer}.mixer.hook_write_value", put(self.value))]


@dataclass
class StateReplace:
    """Replaces S_t of `heads` at one position with `state` (B, H, K, V) or (B, K, V) per head; carries forward.

    Needs the run to request the position: pass `state_positions=[position]` (see `run_with_patches`).
    """
    layer: int
    heads: Heads
    position: int
    state: torch.Tensor

    def fwd_hooks(self):
        heads = _heads(self.heads)

        def hook(states, hook):
            positions = hook.ctx.get("positions")
            idx = positions.index(self.position) if positions else 0
            states = states.clone()
            for i, h in enumerate(heads):
                src = self.state[:, h] if self.state.dim() == 4 else self.state
                states[:, idx, h] = src.to(states.dtype)
            return states
        return [(f"blocks.{self.layer}.mixer.hook_state", hook)]


@dataclass
class ReadoutReplace:
    """Replaces the query-time head output o_t of `heads` at `positions` (hook_head_out); the state is untouched."""
    layer: int
    heads: Heads
    positions: Positions
    value: torch.Tensor   # (B, T, H, V) from another run

    def fwd_hooks(self):
        heads, pos = _heads(self.heads), _positions(self.positions)

        def hook(o, hook):
            if o.shape != self.value.shape:
                raise ValueError(f"{hook.name}: replacement has shape {tuple(self.value.shape)} but the run has {tuple(o.shape)}")
            o = o.clone()
            for h in heads:
                o[:, pos, h] = self.value[:, pos, h].to(o.dtype)
            return o
        return [(f"blocks.{self.layer}.mixer.hook_head_out", hook)]


def run_with_patches(model, tokens: torch.Tensor, patches: Sequence, **kwargs):
    """Runs `model` with every patch's hooks (removed afterwards, even on error) and the state positions they need."""
    positions = sorted({p.position for p in patches if isinstance(p, StateReplace)})
    hooks: list[tuple[str, Callable]] = []
    for p in patches:
        if isinstance(p, StateReplace):
            model.check_head(p.layer, _heads(p.heads)[0])
        hooks.extend(p.fwd_hooks())
    for name, _ in hooks:
        if name not in model.hook_dict:
            raise ValueError(f"no hook point named {name!r} on this model (attention layer, or out of range?)")
    if positions:
        kwargs["state_positions"] = positions
        for name, _ in hooks:
            model.hook_dict[name].ctx["positions"] = positions
    try:
        return model.run_with_hooks(tokens, fwd_hooks=hooks, **kwargs)
    finally:
        for name, _ in hooks:
            model.hook_dict[name].ctx.pop("positions", None)
