"""RecurrentCache: everything a model carries between calls (recurrent states, short-conv tails, attention K/V).

States are (B, H, K, V) with the key dimension first, as in the papers and in `kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch


@dataclass
class LayerCache:
    kind: str                                        # "recurrent", "attention", "hybrid" (a block whose recurrent
    #                                                  mixer and attention run side by side: state, conv and K/V) or
    #                                                  "none" (an MLP-only block)
    state: Optional[torch.Tensor] = None             # (B, H, K, V)
    conv: dict = field(default_factory=dict)         # name -> (B, W-1, D) tail of conv inputs
    keys: Optional[torch.Tensor] = None              # (B, T, Hkv, D)
    values: Optional[torch.Tensor] = None

    def map(self, fn) -> "LayerCache":
        f = lambda t: None if t is None else fn(t)  # noqa: E731
        return LayerCache(self.kind, f(self.state), {k: fn(v) for k, v in self.conv.items()}, f(self.keys), f(self.values))


@dataclass
class RecurrentCache:
    """layers: one LayerCache per layer. seen_tokens: the tokens every row has seen, or with `lengths` the longest.
    lengths: None when every row has seen seen_tokens tokens; else (B,) each row's own count (a cache of packed
    sequences of different lengths, RecurrentLM.forward(cu_seqlens=...)): attention K/V are then left-padded to
    seen_tokens, and a row's positions continue from its own length. States and conv tails are per row either way."""

    layers: list
    seen_tokens: int = 0
    lengths: Optional[torch.Tensor] = None

    def _like(self, layers, lengths="same") -> "RecurrentCache":
        return RecurrentCache(layers, self.seen_tokens, self.lengths if lengths == "same" else lengths)

    # ---- whole-cache operations -----------------------------------------
    def clone(self) -> "RecurrentCache":
        return self._like([lc.map(lambda t: t.clone()) for lc in self.layers])

    def detach(self) -> "RecurrentCache":
        return self._like([lc.map(lambda t: t.detach()) for lc in self.layers])

    def offsets(self, device=None):
        """Where each row's next token sits: seen_tokens (an int), or the (B,) lengths."""
        return self.seen_tokens if self.lengths is None else self.lengths.to(device)

    @property
    def batch_size(self) -> int:
        for lc in self.layers:
            for t in (lc.state, lc.keys, *lc.conv.values()):
                if t is not None:
                    return t.shape[0]
        raise ValueError("the cache is empty")

    def select(self, index) -> "RecurrentCache":
        """Rows of the batch (a LongTensor or a list of indices), e.g. to repeat one pair for many patches."""
        index = torch.as_tensor(index, dtype=torch.long)
        lengths = None if self.lengths is None else self.lengths.index_select(0, index.to(self.lengths.device))
        return self._like([lc.map(lambda t: t.index_select(0, index.to(t.device))) for lc in self.layers], lengths)

    def repeat_interleave(self, n: int) -> "RecurrentCache":
        lengths = None if self.lengths is None else self.lengths.repeat_interleave(n)
        return self._like([lc.map(lambda t: t.repeat_interleave(n, dim=0)) for lc in self.layers], lengths)

    @staticmethod
    def cat(caches: Sequence["RecurrentCache"]) -> "RecurrentCache":
        first = caches[0]
        if any(c.seen_tokens != first.seen_tokens for c in caches):
            raise ValueError("caches of different lengths cannot be batched: all must have seen the same number of tokens")
        layers = []
        for i, lc in enumerate(first.layers):
            parts = [c.layers[i] for c in caches]
            cat = lambda get: None if get(lc) is None else torch.cat([get(p) for p in parts], 0)  # noqa: E731
            layers.append(LayerCache(lc.kind, cat(lambda p: p.state),
                                     {k: torch.cat([p.conv[k] for p in parts], 0) for k in lc.conv},
                                     cat(lambda p: p.keys), cat(lambda p: p.values)))
        lengths = None
        if any(c.lengths is not None for c in caches):
            lengths = torch.cat([c.lengths if c.lengths is not None else torch.full((c.batch_size,), c.seen_tokens)
                                 for c in caches])
        return RecurrentCache(layers, first.seen_tokens, lengths)

    # ---- one head -------------------------------------------------------
    def _recurrent(self, layer: int) -> LayerCache:
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer {layer} is out of range: the cache has layers 0..{len(self.layers) - 1}")
        lc = self.layers[layer]
        if lc.kind not in ("recurrent", "hybrid") or lc.state is None:
            raise ValueError(f"layer {layer} is an attention layer (or holds no state); pick a recurrent layer")
        return lc

    def _check_head(self, lc: LayerCache, layer: int, head: int) -> None:
        H = lc.state.shape[1]
        if not 0 <= head < H:
            raise ValueError(f"head {head} is out of range for layer {layer}: it has heads 0..{H - 1}")

    def head_state(self, layer: int, head: int) -> torch.Tensor:
        """S for one head, (B, K, V)."""
        lc = self._recurrent(layer)
        self._check_head(lc, layer, head)
        return lc.state[:, head]

    def set_head_state(self, layer: int, head: int, value: torch.Tensor) -> None:
        lc = self._recurrent(layer)
        self._check_head(lc, layer, head)
        want = lc.state[:, head].shape
        if value.shape != want:
            raise ValueError(f"state for layer {layer} head {head} must have shape {tuple(want)}, got {tuple(value.shape)}")
        lc.state = lc.state.clone()
        lc.state[:, head] = value.to(lc.state.dtype)

    def swap_from(self, donor: "RecurrentCache", layers: Optional[Iterable[int]] = None,
                  heads: Optional[Iterable[int]] = None, parts: Sequence[str] = ("state",)) -> "RecurrentCache":
        """A copy with the donor's `parts` ("state", "conv", "kv") put into the chosen layers and heads.

        heads=None takes every head of each layer; conv tails and K/V are swapped per layer.
        """
        if donor.seen_tokens != self.seen_tokens or donor.batch_size != self.batch_size:
            raise ValueError("donor and recipient caches must have the same batch size and length; build pairs of equal length")
        if (self.lengths is None) != (donor.lengths is None) or (
                self.lengths is not None and not torch.equal(self.lengths.cpu(), donor.lengths.cpu())):
            raise ValueError("donor and recipient caches must have the same length per row; build aligned pairs")
        unknown = set(parts) - {"state", "conv", "kv"}
        if unknown:
            raise ValueError(f"parts must be among 'state', 'conv', 'kv'; got {sorted(unknown)}")
        out = self.clone()
        chosen = range(len(self.layers)) if layers is None else list(layers)
        for layer in chosen:
            if not 0 <= layer < len(self.layers):
                raise ValueError(f"layer {layer} is out of range: the cache has layers 0..{len(self.layers) - 1}")
            mine, theirs = out.layers[layer], donor.layers[layer]
            if mine.kind in ("recurrent", "hybrid"):
                if "state" in parts:
                    for h in (range(mine.state.shape[1]) if heads is None else heads):
                        self._check_head(mine, layer, h)
                        mine.state[:, h] = theirs.state[:, h]
                if "conv" in parts:
                    mine.conv = {k: v.clone() for k, v in theirs.conv.items()}
            if "kv" in parts and mine.kind in ("attention", "hybrid"):
                if heads is None:
                    mine.keys, mine.values = theirs.keys.clone(), theirs.values.clone()
                else:
                    for h in heads:
                        if not 0 <= h < mine.keys.shape[2]:   # K/V heads: fewer under GQA, one latent under MLA
                            raise ValueError(f"head {h} is out of range for layer {layer}'s K/V: it caches "
                                             f"{mine.keys.shape[2]} key/value heads; pick among those, or leave "
                                             "heads unset to swap the layer's whole K/V")
                        mine.keys[:, :, h] = theirs.keys[:, :, h]
                        mine.values[:, :, h] = theirs.values[:, :, h]
        return out
