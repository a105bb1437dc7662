"""Patch specifications: small objects that turn "block this write", "swap this state", "replace this readout"
into TransformerLens forward hooks on the names in `hooks.points`.

Write and state patches change the recurrence itself, so their effect carries forward into every later step
(unlike a readout-only hook on a cached state).

Where a patch acts is given in one of two forms, and both become one boolean mask over the activation:
- the simple form: `heads` (an int or a list) at `positions` (an int, a list or a slice), optionally on some
  `batch` rows only; the same heads and positions in every row;
- the per-row form: `mask`, a bool tensor (B, T, H) (for StateReplace (B, H)), True where the patch acts; rows may
  differ (e.g. each row's own fact spans). `head_mask` builds one from a (B, T) position mask and a head list.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

from recurscope.hooks.points import hook_name

Heads = Union[int, Sequence[int]]
Positions = Union[int, Sequence[int], slice]
#: A readout replacement: a (B, T, H, V) tensor from another run, or a function of this run's o_t returning one.
Replacement = Union[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]


def _heads(h: Heads) -> list[int]:
    return [operator.index(x) for x in h] if hasattr(h, "__iter__") else [operator.index(h)]


def _check_heads(patch) -> None:
    """heads: an integer or a list of integers (never strings, floats or bools, which int() would accept or
    truncate silently)."""
    if patch.heads is None:
        return
    items = list(patch.heads) if hasattr(patch.heads, "__iter__") and not isinstance(patch.heads, str) else [patch.heads]
    if isinstance(patch.heads, str) or not all(_is_index(h) for h in items):
        raise ValueError(f"{type(patch).__name__}(layer={patch.layer}).heads must be a head index or a list of "
                         f"integer head indices, got {patch.heads!r}; e.g. heads=[0, 2]")
    if not _is_index(patch.layer):
        raise ValueError(f"{type(patch).__name__}.layer must be an integer layer index, got {patch.layer!r}")


def _is_index(x) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
        return True
    except TypeError:
        return False


_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(patch, name: str, t, allow_nonfinite: bool, dims: Sequence[int]) -> None:
    """A patch tensor must be a floating torch.Tensor of one of `dims` ranks, finite unless allow_nonfinite."""
    label = f"{type(patch).__name__}(layer={patch.layer}).{name}"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATING:
        raise ValueError(f"{label} must be a floating tensor (float16/bfloat16/float32/float64), got {t.dtype}; "
                         f"convert it with .float()")
    if t.dim() not in dims:
        raise ValueError(f"{label} must have {' or '.join(str(d) for d in dims)} dimensions, got shape "
                         f"{tuple(t.shape)}")
    if not allow_nonfinite and t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{label} holds {int((~torch.isfinite(t)).sum())} NaN or inf value(s); pass finite values, "
                         "or allow_nonfinite=True to study them on purpose")


def _check_device(hook, name: str, t: torch.Tensor, run: torch.Tensor) -> None:
    if t.device != run.device:
        raise ValueError(f"{hook.name}: the patch's {name} is on {t.device} but the model runs on {run.device}; "
                         f"move it with .to({str(run.device)!r})")


def head_mask(position_mask: torch.Tensor, n_heads: int, heads: Heads) -> torch.Tensor:
    """(B, T, H) bool from a (B, T) bool position mask (one row per batch row), set for `heads` only."""
    if position_mask.dim() != 2 or position_mask.dtype != torch.bool:
        raise ValueError(f"position_mask must be a (B, T) bool tensor, got {position_mask.dtype} of shape "
                         f"{tuple(position_mask.shape)}")
    on = torch.zeros(n_heads, dtype=torch.bool, device=position_mask.device)
    on[_heads(heads)] = True
    return position_mask[:, :, None] & on


def _check_form(patch, has_simple: bool) -> None:
    if (patch.mask is None) == (not has_simple):
        raise ValueError(f"{type(patch).__name__}(layer={patch.layer}): give either heads and positions (the same in "
                         f"every row) or mask= (a bool tensor, per row), not both and not neither")
    if patch.mask is not None and (not isinstance(patch.mask, torch.Tensor) or patch.mask.dtype != torch.bool):
        got = patch.mask.dtype if isinstance(patch.mask, torch.Tensor) else type(patch.mask).__name__
        raise ValueError(f"{type(patch).__name__}(layer={patch.layer}): mask must be a bool tensor, got {got}")


def _where(patch, t: torch.Tensor, hook) -> torch.Tensor:
    """The patch's (B, T, H) bool mask for activation t (B, T, H, ...), on t's device."""
    B, T, H = t.shape[:3]
    if patch.mask is not None:
        if tuple(patch.mask.shape) != (B, T, H):
            raise ValueError(f"{hook.name}: the patch mask has shape {tuple(patch.mask.shape)} but this run's "
                             f"activation needs (B, T, H) = {(B, T, H)}; build the mask for this batch and length")
        return patch.mask.to(t.device)
    rows = torch.arange(B) if getattr(patch, "batch", None) is None else torch.as_tensor(list(patch.batch))
    label = f"{hook.name}: {type(patch).__name__}(layer={patch.layer})"
    if not isinstance(patch.positions, slice):
        items = list(patch.positions) if hasattr(patch.positions, "__iter__") else [patch.positions]
        if not all(_is_index(p) and -T <= operator.index(p) < T for p in items):
            raise ValueError(f"{label}.positions {patch.positions!r} are not positions of this run's {T} tokens; "
                             f"give integers in [0, {T}) or a slice")
    if rows.numel() and not (rows.dtype != torch.bool and not rows.is_floating_point()
                             and -B <= int(rows.min()) and int(rows.max()) < B):
        raise ValueError(f"{label}.batch {patch.batch!r} names rows outside this run's {B}; give row indices in "
                         f"[0, {B})")
    pos = torch.arange(T)[patch.positions]
    heads = torch.as_tensor(_heads(patch.heads))
    m = torch.zeros(B, T, H, dtype=torch.bool)
    m[rows[:, None, None], pos.reshape(1, -1, 1), heads[None, None, :]] = True
    return m.to(t.device)


@dataclass
class WriteScale:
    """Sets the write scale of `heads` at `positions` (or wherever `mask` is True) to `scale` (0 = write_block);
    decay and erase still act."""
    layer: int
    heads: Optional[Heads] = None
    positions: Optional[Positions] = None
    scale: float = 0.0
    batch: Optional[Sequence[int]] = None   # rows of the batch to patch; None = all
    mask: Optional[torch.Tensor] = None     # (B, T, H) bool, instead of heads/positions/batch
    allow_nonfinite: bool = False           # True admits a NaN/inf scale (on purpose)

    def __post_init__(self):
        _check_form(self, self.heads is not None and self.positions is not None)
        _check_heads(self)
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)):
            raise ValueError(f"WriteScale(layer={self.layer}).scale must be a number (0 blocks the write), got "
                             f"{self.scale!r}")
        if not self.allow_nonfinite and not math.isfinite(self.scale):
            raise ValueError(f"WriteScale(layer={self.layer}).scale is {self.scale}; pass a finite number, or "
                             "allow_nonfinite=True to study it on purpose")

    def fwd_hooks(self):
        def hook(ws, hook):
            return ws.masked_fill(_where(self, ws, hook), self.scale)
        return [(hook_name("hook_write_scale", self.layer), hook)]


@dataclass
class WriteReplace:
    """Replaces the write u_t x_t^T of `heads` at `positions` (or wherever `mask` is True) by key ⊗ value (e.g. the
    donor's); the erase is kept.

    key: (B, T, H, K) and value: (B, T, H, V) full tensors from the donor run; only the chosen entries are used.
    """
    layer: int
    heads: Optional[Heads] = None
    positions: Optional[Positions] = None
    key: Optional[torch.Tensor] = None
    value: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None     # (B, T, H) bool, instead of heads/positions
    allow_nonfinite: bool = False

    def __post_init__(self):
        _check_form(self, self.heads is not None and self.positions is not None)
        _check_heads(self)
        if self.key is None or self.value is None:
            raise ValueError(f"WriteReplace(layer={self.layer}) needs key (B, T, H, K) and value (B, T, H, V), e.g. "
                             f"the donor's hook_write_key and hook_write_value")
        _check_tensor(self, "key", self.key, self.allow_nonfinite, (4,))
        _check_tensor(self, "value", self.value, self.allow_nonfinite, (4,))

    def fwd_hooks(self):
        def put(src):
            def hook(t, hook):
                if t.shape != src.shape:
                    raise ValueError(f"{hook.name}: replacement has shape {tuple(src.shape)} but the run has "
                                     f"{tuple(t.shape)}; donor and recipient must have equal length and batch")
                _check_device(hook, "replacement", src, t)
                return torch.where(_where(self, t, hook)[..., None], src.to(device=t.device, dtype=t.dtype), t)
            return hook
        return [(hook_name("hook_write_key", self.layer), put(self.key)),
                (hook_name("hook_write_value", self.layer), put(self.value))]


@dataclass
class StateReplace:
    """Replaces S_t of `heads` (or of the (batch, head) entries where `mask` (B, H) is True) at one position with
    `state`, (B, H, K, V) or (B, K, V) for every chosen head; the change carries forward.

    The run must capture the position: `run_with_patches` passes it; with `model.run_with_hooks`, include it in
    `state_positions`. The hook finds its own slice among several captured positions (hook_state names them).
    """
    layer: int
    heads: Optional[Heads] = None
    position: int = 0
    state: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None     # (B, H) bool, instead of heads
    allow_nonfinite: bool = False

    def __post_init__(self):
        _check_form(self, self.heads is not None)
        _check_heads(self)
        if not _is_index(self.position):
            raise ValueError(f"StateReplace(layer={self.layer}).position must be an integer position, got "
                             f"{self.position!r}")
        if self.state is None:
            raise ValueError(f"StateReplace(layer={self.layer}) needs state: (B, H, K, V) or (B, K, V)")
        _check_tensor(self, "state", self.state, self.allow_nonfinite, (3, 4))

    def fwd_hooks(self):
        def hook(states, hook):
            positions = tuple(getattr(hook, "positions", ()))
            if self.position not in positions:
                raise ValueError(f"{hook.name}: StateReplace(position={self.position}) needs the run to capture that "
                                 f"state, but it captured positions {list(positions)}; pass state_positions "
                                 f"including {self.position} (run_with_patches does it for you)")
            i = positions.index(self.position)
            B, _, H = states.shape[:3]
            K, V = states.shape[3:]
            want = (B, H, K, V) if self.state.dim() == 4 else (B, K, V)
            if tuple(self.state.shape) != want:
                raise ValueError(f"{hook.name}: StateReplace.state has shape {tuple(self.state.shape)} but this run "
                                 f"needs exactly {want} ({'(B, H, K, V): every head of the layer' if len(want) == 4 else '(B, K, V): one state for every chosen head'}); "
                                 "no broadcasting: build the state for this batch and layer")
            _check_device(hook, "state", self.state, states)
            src = self.state.to(dtype=states.dtype)
            src = src if src.dim() == 4 else src[:, None].expand(B, H, *src.shape[1:])
            if self.mask is not None:
                if tuple(self.mask.shape) != (B, H):
                    raise ValueError(f"{hook.name}: the StateReplace mask has shape {tuple(self.mask.shape)}; this "
                                     f"run needs (B, H) = {(B, H)}")
                where = self.mask.to(states.device)
            else:
                where = torch.zeros(B, H, dtype=torch.bool, device=states.device)
                where[:, _heads(self.heads)] = True
            states = states.clone()
            states[:, i] = torch.where(where[..., None, None], src, states[:, i])
            return states
        return [(hook_name("hook_state", self.layer), hook)]


@dataclass
class ReadoutReplace:
    """Replaces the query-time head output o_t of `heads` at `positions` (or wherever `mask` is True) by `value`
    (hook_head_out); the state is untouched.

    value: a (B, T, H, V) tensor from another run, or a function of this run's o (B, T, H, V) returning one, for
    replacements computed inside the same forward (e.g. copying rows of one block of the batch into another).
    """
    layer: int
    heads: Optional[Heads] = None
    positions: Optional[Positions] = None
    value: Optional[Replacement] = None
    mask: Optional[torch.Tensor] = None     # (B, T, H) bool, instead of heads/positions
    allow_nonfinite: bool = False

    def __post_init__(self):
        _check_form(self, self.heads is not None and self.positions is not None)
        _check_heads(self)
        if self.value is None:
            raise ValueError(f"ReadoutReplace(layer={self.layer}) needs value: a (B, T, H, V) tensor or a function "
                             f"of o returning one")
        if not callable(self.value):
            _check_tensor(self, "value", self.value, self.allow_nonfinite, (4,))

    def fwd_hooks(self):
        def hook(o, hook):
            value = self.value(o) if callable(self.value) else self.value
            if callable(self.value):
                _check_tensor(self, "value (returned by the function)", value, self.allow_nonfinite, (4,))
            if o.shape != value.shape:
                raise ValueError(f"{hook.name}: replacement has shape {tuple(value.shape)} but the run has "
                                 f"{tuple(o.shape)}")
            _check_device(hook, "replacement", value, o)
            return torch.where(_where(self, o, hook)[..., None], value.to(device=o.device, dtype=o.dtype), o)
        return [(hook_name("hook_head_out", self.layer), hook)]


def check_tokens(tokens) -> None:
    """Tokens are a (B, T) integer tensor: a 1-D row is refused rather than guessed to be one row or one column."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
        got = (f"{tokens.dtype} of shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor)
               else type(tokens).__name__)
        raise ValueError(f"tokens must be a 2-D integer tensor (B, T), got {got}; for one sequence pass "
                         "tokens[None]")
    if 0 in tokens.shape:
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}: no rows or no positions to patch; pass at least "
                         "one row of at least one token")


def check_patch_heads(model, patch) -> None:
    """Raises a ValueError naming the problem and the fix unless every head of `patch` is a recurrent head of
    `model` in the patch's layer (model.check_head on each, as interventions.normalise_heads does). A patch given
    as a mask (heads=None) is left to the mask's own shape check."""
    if getattr(patch, "heads", None) is None:
        return
    name = type(patch).__name__
    try:
        heads = [operator.index(h) for h in ([patch.heads] if not hasattr(patch.heads, "__iter__") else patch.heads)]
    except TypeError:
        raise ValueError(f"{name}.heads must be a head index or a list of them, got {patch.heads!r}; "
                         "e.g. heads=[0, 2]") from None
    if not heads:
        raise ValueError(f"{name}.heads is empty; name at least one head, e.g. heads=[0]")
    group = getattr(model, "query_group", 1)
    for h in heads:
        if isinstance(patch, ReadoutReplace) and group > 1:
            # hook_head_out indexes query heads: state group h // group's readouts
            model.check_head(operator.index(patch.layer), h // group)
            if h < 0:
                raise ValueError(f"{name}.heads: query head {h} is out of range")
        else:
            model.check_head(operator.index(patch.layer), h)


def patch_hooks(model, patches: Sequence) -> list[tuple[str, Callable]]:
    """The forward hooks of every patch, each checked to name a hook point of `model` and every head checked
    (check_patch_heads)."""
    hooks: list[tuple[str, Callable]] = []
    if isinstance(patches, (str, bytes)) or not hasattr(patches, "__iter__"):
        raise ValueError(f"patches must be a list of patch specifications (WriteScale, WriteReplace, StateReplace, "
                         f"ReadoutReplace), got {type(patches).__name__}")
    for i, p in enumerate(patches):
        if not hasattr(p, "fwd_hooks"):
            raise ValueError(f"patches[{i}] is {p!r}, not a patch specification; pass WriteScale, WriteReplace, "
                             "StateReplace or ReadoutReplace objects")
        check_patch_heads(model, p)
        hooks.extend(p.fwd_hooks())
    for name, _ in hooks:
        if name not in model.hook_dict:
            raise ValueError(f"no hook point named {name!r} on this model (attention layer, or out of range?)")
    return hooks


def run_with_patches(model, tokens: torch.Tensor, patches: Sequence, **kwargs):
    """Runs `model` with every patch's hooks (removed afterwards, even on error) and the state positions they need."""
    check_tokens(tokens)
    hooks = patch_hooks(model, patches)
    positions = {p.position for p in patches if isinstance(p, StateReplace)}
    if positions:
        kwargs["state_positions"] = sorted(positions | set(kwargs.get("state_positions") or ()))
    return model.run_with_hooks(tokens, fwd_hooks=hooks, **kwargs)
