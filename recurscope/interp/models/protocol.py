"""The model protocol that interventions, scans and confirmations use, so that they never ask which model they hold.

Both the native `RecurrentLM` (fla format) and the `BridgedLM` (transformers format) implement it:
- `run_prefix(tokens)` -> a `RecurrentCache` after the tokens;
- the cache's per-layer / per-head edits (`RecurrentCache.swap_from`, `set_head_state`, `select`, `cat`: states,
  conv tails and attention K/V);
- `run_suffix(tokens, cache, hooks)` -> (logits, the cache after them), from an edited cache, with hooks;
- layer by layer, for runs that change the batch between layers (the head scan's growing batch):
  `embed_suffix(tokens, cache)` -> (the residual entering layer 0, a context), `run_layer(layer, resid,
  layer_cache, context)` -> the residual leaving that layer, reading `layer_cache` (a LayerCache whose rows may be
  batch-expanded views) and never writing it, and `unembed(resid)` -> logits. The context holds what every layer
  needs besides its cache (positions, masks, rotary tables); it depends only on the tokens' length and the cache's,
  so it serves any number of rows continuing a cache of that length;
- `unembed(resid)`, the final norm then the LM head on residual-stream vectors (also the logit lens and the
  corrector), `final_norm`, that norm (a module), and `unembed_weight`, the (vocab, D) matrix with
  unembed(resid) = final_norm(resid) @ unembed_weight.T (the LM head's weight times any output multiplier);
- `heads()`, the (layer, head) inventory of recurrent heads, and `check_head`;
- `tokenizer`; plus `cfg.vocab_size`, `cfg.state_shape()`, `n_state_heads`, `recurrent_layers`, `attention_layers`,
  `family` (its FamilySpec) and TransformerLens's `hooks()` / `hook_dict` with recurscope's hook names.

`ProtocolMethods` holds everything the two kinds share (both subclass it): the runs above, the facts read from
`blocks` (an `nn.ModuleList` on both, each block with `is_recurrent` and `mixer`), the `debug` switch, the backend
choice, `run_with_cache` with `state_positions`, and TransformerLens's user-facing surface (`tl_compat`).
`RecurrentModel` is the checked type: `isinstance(model, RecurrentModel)` holds for both kinds.
"""
from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

from recurscope.interp.models.cache import RecurrentCache
from recurscope.interp.models.tl_compat import TransformerLensMethods


def at_positions(resid: torch.Tensor, positions) -> torch.Tensor:
    """resid (B, T, D) at per-row positions (B,) or (B, P) -> (B, D) or (B, P, D)."""
    B, T = resid.shape[:2]
    pos = torch.as_tensor(positions, dtype=torch.long, device=resid.device)
    if pos.dim() not in (1, 2) or pos.shape[0] != B:
        raise ValueError(f"logit_positions must have shape (B,) or (B, P) with B={B}; received {tuple(pos.shape)}.")
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= T):
        raise ValueError(f"logit_positions must lie in [0, {T - 1}] for {T} tokens; received "
                         f"[{int(pos.min())}, {int(pos.max())}].")
    rows = torch.arange(B, device=resid.device)
    return resid[rows, pos] if pos.dim() == 1 else resid[rows[:, None], pos]


def pack_rows(rows: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """1-D token rows of any lengths -> (tokens (1, sum of lengths), cu_seqlens [0, l0, l0 + l1, ...]): the packed
    batch that `model(tokens, cu_seqlens=cu)` runs as if each row ran alone."""
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + int(r.shape[0]))
    return torch.cat([r.reshape(-1) for r in rows])[None], cu


def check_packed(tokens: torch.Tensor, cu_seqlens, cache, return_type="logits") -> list[int]:
    """cu_seqlens as a list of ints, checked against packed tokens (1, T); a packed call starts from no cache and
    returns logits (a next-token loss over the packed row would score each sequence's last token on the next one's
    first)."""
    if return_type in ("loss", "both"):
        raise ValueError("return_type='loss' with cu_seqlens would score across sequence boundaries; take the logits "
                         "and form the loss per sequence")
    raw = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    if not isinstance(raw, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in raw):
        raise ValueError(f"cu_seqlens must be integer offsets (a long tensor or a list of ints), got {cu_seqlens!r}; "
                         "build them with protocol.pack_rows")
    cu = list(raw)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError("packed sequences (cu_seqlens) take tokens of shape (1, T); pack rows with "
                         "protocol.pack_rows")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != tokens.shape[1] or any(b > c for b, c in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {tokens.shape[1]}, got {cu}")
    if cache is not None:
        raise ValueError("packed sequences (cu_seqlens) start from no cache; run them without one")
    return cu


def unpack_cache(packed: RecurrentCache, cu: list[int]) -> RecurrentCache:
    """The cache of a packed call as one row per sequence: recurrent states and conv tails are per sequence already;
    attention K/V (1, T, Hkv, D) are cut per sequence and left-padded with zeros to the longest, and `lengths`
    holds each sequence's length."""
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    longest = max(lengths)

    def padded(t):
        out = t.new_zeros(len(lengths), longest, *t.shape[2:])
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            out[i, longest - (b - a):] = t[0, a:b]
        return out

    from recurscope.interp.models.cache import LayerCache

    layers = [lc if lc.keys is None else LayerCache(lc.kind, lc.state, lc.conv, padded(lc.keys), padded(lc.values))
              for lc in packed.layers]
    device = next((t.device for lc in layers for t in (lc.state, lc.keys) if t is not None), None)
    return RecurrentCache(layers, longest, torch.tensor(lengths, dtype=torch.long, device=device))


@runtime_checkable
class RecurrentModel(Protocol):
    """What interventions, scans, confirmations and protocols may use of a model; `RecurrentLM` and the bridge both
    satisfy it (isinstance checks every member's presence, not its signature)."""
    tokenizer: object
    cfg: object
    blocks: object
    hook_dict: dict

    @property
    def recurrent_layers(self) -> list[int]: ...

    @property
    def attention_layers(self) -> list[int]: ...

    @property
    def n_state_heads(self) -> int: ...

    @property
    def family(self): ...

    debug: bool

    def set_backend(self, backend: str) -> None: ...

    def hooks(self, *args, **kwargs): ...

    def run_with_cache(self, *args, **kwargs): ...

    def run_prefix(self, tokens: torch.Tensor, state_positions: Optional[Sequence[int]] = None,
                   cu_seqlens=None) -> RecurrentCache: ...

    def run_suffix(self, tokens: torch.Tensor, cache: RecurrentCache, hooks=()) -> tuple: ...

    def embed_suffix(self, tokens: torch.Tensor, cache: RecurrentCache) -> tuple: ...

    def run_layer(self, layer: int, resid: torch.Tensor, layer_cache, context) -> torch.Tensor: ...

    def heads(self) -> list[tuple[int, int]]: ...

    def check_head(self, layer: int, head: int) -> None: ...

    def unembed(self, resid: torch.Tensor) -> torch.Tensor: ...

    @property
    def final_norm(self) -> torch.nn.Module: ...

    @property
    def unembed_weight(self) -> torch.Tensor: ...


class ProtocolMethods(TransformerLensMethods):
    """The protocol's runs in terms of `forward(tokens, cache=, use_cache=, state_positions=)` and `hooks()`, and the
    facts both model kinds read the same way from `self.blocks` and `self.cfg`."""

    # ---- facts ----------------------------------------------------------------------------------------------
    @property
    def recurrent_layers(self) -> list[int]:
        return [i for i, b in enumerate(self.blocks) if b.is_recurrent]

    @property
    def attention_layers(self) -> list[int]:
        # (a bridged MLP-only block, Nemotron-H's, is neither: is_attention False)
        return [i for i, b in enumerate(self.blocks) if getattr(b, "is_attention", not b.is_recurrent)]

    @property
    def family(self):
        """The family spec of this model: a FamilySpec (interp.models.families) or the bridge's spec."""
        return self.cfg.family

    @property
    def n_state_heads(self) -> int:
        """Heads that carry a state: the unit every intervention and the scan name as a "head" (a state group read
        by `query_group` query heads where the family groups its queries, GLA-7B)."""
        return self.cfg.state_heads

    @property
    def query_group(self) -> int:
        """Query heads that read each state (hook_q, hook_head_out and hook_z have n_state_heads * query_group)."""
        return int(getattr(self.cfg, "query_group", 1))

    def query_heads(self, head: int) -> list[int]:
        """The query heads (indices into hook_head_out / hook_z) that read state group `head`."""
        m = self.query_group
        return list(range(head * m, (head + 1) * m))

    def _recurrent_mixers(self) -> list:
        return [b.mixer for b in self.blocks if b.is_recurrent]

    @property
    def debug(self) -> bool:
        """When True, every recurrent layer checks its kernel inputs for NaN/inf (one host sync per tensor) and
        names the first bad one; off by default, so that a forward on a GPU never waits on the host."""
        return any(m.check_finite for m in self._recurrent_mixers())

    @debug.setter
    def debug(self, on: bool) -> None:
        for m in self._recurrent_mixers():
            m.check_finite = bool(on)

    def set_backend(self, backend: str) -> None:
        """Recurrence backend for every recurrent mixer: one of kernels.BACKENDS ('auto', 'reference', ...)."""
        from recurscope import kernels

        if backend not in kernels.BACKENDS:
            raise ValueError(f"backend must be one of {kernels.BACKENDS}, got {backend!r}")
        for m in self._recurrent_mixers():
            m.backend = backend

    def add_hook(self, name, hook, *args, **kwargs):
        """TransformerLens's add_hook (which run_with_hooks and hooks() use), also taking TransformerLens's names
        for points that have another name here ("blocks.{l}.hook_attn_out" is the mixer's output, hooks.TL_ALIASES),
        so that its patching sweeps run as they are."""
        from recurscope.hooks.points import canonical_name

        return super().add_hook(canonical_name(name) if isinstance(name, str) else name, hook, *args, **kwargs)

    def _enable_hook(self, name, hook, *args, **kwargs):
        # TransformerLens's hooks() (run_with_hooks) looks names up here rather than through add_hook
        from recurscope.hooks.points import canonical_name

        return super()._enable_hook(canonical_name(name) if isinstance(name, str) else name, hook, *args, **kwargs)

    def run_with_cache(self, *args, state_positions: Optional[Sequence[int]] = None,
                       return_cache_object: bool = True, **kwargs):
        """TransformerLens's run_with_cache, plus `state_positions` for `hook_state` (no other state is kept). The
        cache is a `RecurrentActivationCache` (a TransformerLens ActivationCache with state and readout
        accessors), or a plain dict with `return_cache_object=False`. names_filter may use TransformerLens's names
        (hooks.TL_ALIASES)."""
        from recurscope.hooks.points import canonical_name

        names = kwargs.get("names_filter")
        if isinstance(names, str):
            kwargs["names_filter"] = canonical_name(names)
        elif isinstance(names, (list, tuple)):
            kwargs["names_filter"] = [canonical_name(n) for n in names]
        if state_positions is not None:
            kwargs["state_positions"] = state_positions
        out, cache_dict = super().run_with_cache(*args, **kwargs)
        if not return_cache_object:
            return out, cache_dict
        from recurscope.interp.models.activation_cache import RecurrentActivationCache

        positions = None if state_positions is None else tuple(sorted({int(p) for p in state_positions}))
        return out, RecurrentActivationCache(cache_dict, self, state_positions=positions,
                                             has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def run_prefix(self, tokens: torch.Tensor, state_positions: Optional[Sequence[int]] = None,
                   cu_seqlens=None) -> RecurrentCache:
        """The cache after `tokens`; with cu_seqlens, after each packed sequence (one row each, their lengths in
        RecurrentCache.lengths)."""
        # Only the cache is used, so no position gets logits: on the tiny models the unembedding is half the prefix.
        no_logits = torch.empty(tokens.shape[0], 0, dtype=torch.long, device=tokens.device)
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        _, cache = self(tokens, use_cache=True, state_positions=state_positions, logit_positions=no_logits, **kw)
        return cache

    def run_suffix(self, tokens: torch.Tensor, cache: Optional[RecurrentCache], hooks=()):
        with self.hooks(fwd_hooks=list(hooks)):
            return self(tokens, cache=cache, use_cache=True)

    def heads(self) -> list[tuple[int, int]]:
        """Every (layer, head) with a recurrent state, in (layer, head) order."""
        return [(layer, head) for layer in self.recurrent_layers for head in range(self.n_state_heads)]

    def check_head(self, layer: int, head: int) -> None:
        """Raises a ValueError naming the problem if (layer, head) is not a recurrent head of this model."""
        L = self.cfg.num_hidden_layers
        if not 0 <= layer < L:
            raise ValueError(f"layer {layer} is out of range: this model has layers 0..{L - 1}")
        if layer not in self.recurrent_layers:
            raise ValueError(f"layer {layer} is a full-attention layer; recurrent layers are {self.recurrent_layers}")
        if not 0 <= head < self.n_state_heads:
            raise ValueError(f"head {head} is out of range: layer {layer} has heads 0..{self.n_state_heads - 1}")
