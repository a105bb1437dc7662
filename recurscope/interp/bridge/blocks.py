"""The bridge's decoder block: a transformers decoder layer with recurscope's residual hooks, holding the layer's own
submodules under their own names. An architecture's adapter (bridge/adapters/) builds one per layer; the blocks of
architectures with a layout of their own (Falcon-H1's parallel mixer and attention, Zamba2's shared transformer,
MiniMax's normed residual) subclass it in their adapter's module."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from transformer_lens.hook_points import HookPoint


class BridgeBlock(nn.Module):
    """A decoder layer of transformers with recurscope's residual hooks; it holds the transformers layer's own
    submodules under their own names. `norm="pre"`: input_layernorm before the mixer and post_attention_layernorm
    before the MLP (Qwen3.5, Qwen3-Next, Kimi-Linear, OLMo-hybrid's linear layers); `norm="post"`:
    post_attention_layernorm on the mixer's output and post_feedforward_layernorm on the MLP's (OLMo-hybrid's
    attention layers). hook_mixer_out and hook_mlp_out are what the layer adds to the residual stream.

    `attn_attr` (a module path in the layer): the layer also runs that attention module beside its recurrent mixer,
    and the block is both a recurrent and an attention layer, with the attention's hook points at `blocks.{l}.attn.*`
    (`attn` is that module) and its output at `hook_attn_out`; how the two combine is the subclass's
    `residual_update` (Falcon-H1's `ParallelBlock`, Zamba2's `SharedBlock`, in their adapters). `arg_names`: the
    names of the positional arguments after the hidden states with which the family's model calls each layer
    (Zamba2's)."""

    def __init__(self, hf_layer: nn.Module, mixer_attr: str, recurrent: bool, norm: str = "pre",
                 mixer_norm_attr: str = "input_layernorm", mlp_only: bool = False, mlp_attr: str = "mlp",
                 mlp_norm_attr: str = "post_attention_layernorm", mlp_fn=None, attn_attr: Optional[str] = None,
                 arg_names: tuple = ()):
        super().__init__()
        if norm not in ("pre", "post"):
            raise ValueError(f"norm must be 'pre' or 'post', got {norm!r}")
        for name, child in hf_layer.named_children():
            setattr(self, name, child)
        if hasattr(hf_layer, "block_type"):   # Nemotron-H's model picks each block's mask by it
            self.block_type = hf_layer.block_type
        self.mixer_attr, self.is_recurrent, self.norm_layout = mixer_attr, recurrent, norm
        self.mixer_norm_attr = mixer_norm_attr
        self.returns_tuple = False   # set by BridgedLM for a family whose model unpacks (hidden, weights) per layer
        # mlp_only: the layer holds an MLP or MoE in place of a mixer (Nemotron-H's "mlp" / "moe" blocks): norm, MLP,
        # residual; hook_resid_mid is its input (no mixer, no hook_mixer_out)
        self.mlp_only = mlp_only
        self.attn_attr, self.arg_names = attn_attr, tuple(arg_names)
        self.is_attention = (not recurrent and not mlp_only) or attn_attr is not None
        # Mamba-2's blocks are norm, mixer, residual only; their residual stream is kept in at least float32
        # (transformers' residual_in_fp32), never narrowed
        self.mlp_attr, self.mlp_norm_attr = mlp_attr, mlp_norm_attr   # Bamba: feed_forward, pre_ff_layernorm
        self.has_mlp = hasattr(hf_layer, mlp_attr)
        self.mlp_fn = mlp_fn
        # Granite-4.0-H scales what each mixer and MLP adds to the residual stream (hook_mixer_out and hook_mlp_out
        # hold the scaled outputs: what the layer adds)
        self.residual_multiplier = float(getattr(hf_layer, "residual_multiplier", 1.0))
        self.residual_in_fp32 = bool(getattr(getattr(hf_layer, "config", None), "residual_in_fp32", False))
        # A list while BridgedLM.embed_suffix records the arguments transformers' model passes to each
        # layer (masks, rotary tables, positions); the layer then computes nothing.
        self.recorded: Optional[list] = None
        self.hook_resid_pre = HookPoint()
        if not mlp_only:
            self.hook_mixer_out = HookPoint()
        if attn_attr is not None:
            self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        if self.has_mlp or mlp_only:
            self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    @property
    def mixer(self) -> nn.Module:
        # not getattr: Mamba-2's layer names its mixer `mixer` itself (Zamba2's hybrid layers: a path inside the layer)
        return self._sub(self.mixer_attr)

    @property
    def mixer_output_scale(self) -> float:
        """What the block multiplies its mixer's output by before hook_mixer_out: Granite-4.0-H's residual_multiplier
        (1 elsewhere; Falcon-H1's ParallelBlock and Zamba2's SharedBlock say their own)."""
        return self.residual_multiplier

    @property
    def attn(self) -> Optional[nn.Module]:
        """The attention module a parallel or shared block runs beside its recurrent mixer (None in any other)."""
        return None if self.attn_attr is None else self._sub(self.attn_attr)

    @property
    def attention(self) -> Optional[nn.Module]:
        """The module that attends over cached K/V: `mixer` in an attention block, `attn` in a parallel block."""
        return self.attn if self.attn_attr is not None else self.mixer if self.is_attention else None

    def _sub(self, path: str) -> nn.Module:
        module = self
        for part in path.split("."):
            module = module._modules[part]
        return module

    def forward(self, hidden_states, *args, **kwargs):
        if len(args) > len(self.arg_names):
            raise TypeError(f"{type(self).__name__} takes {len(self.arg_names)} positional arguments after the hidden "
                            f"states ({', '.join(self.arg_names) or 'none'}), got {len(args)}")
        kwargs.update(zip(self.arg_names, args))
        out = self.block_forward(hidden_states, **kwargs)
        return (out, None) if self.returns_tuple else out

    def block_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                      cache=None, **kwargs):
        """The layer's residual update (a tensor), whatever its model expects the layer to return."""
        kwargs.pop("use_cache", None)
        if self.recorded is not None:
            self.recorded.append(dict(kwargs, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                      position_ids=position_ids))
            return hidden_states
        return self.residual_update(self.hook_resid_pre(hidden_states), attention_mask, position_ids, cache,
                                    position_embeddings, kwargs)

    def residual_update(self, resid, attention_mask, position_ids, cache, position_embeddings, kwargs):
        """The layer's output from its residual input after hook_resid_pre: norm, mixer, residual, MLP."""
        pre = self.norm_layout == "pre"
        h = self._sub(self.mixer_norm_attr)(resid) if pre else resid
        if self.residual_in_fp32:
            resid = resid.to(torch.promote_types(resid.dtype, torch.float32))
        if self.mlp_only:
            resid = self.hook_resid_mid(resid)
            return self.hook_resid_post(resid + self.hook_mlp_out(self.mixer(h)))
        if self.is_recurrent:
            mixed = self.mixer(h, cache=cache, attention_mask=attention_mask)
        else:
            mixed, _ = self.mixer(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, position_embeddings=position_embeddings)
        if not pre:
            mixed = self.post_attention_layernorm(mixed)
        if self.residual_multiplier != 1.0:
            mixed = mixed * self.residual_multiplier
        resid = self.hook_resid_mid(resid + self.hook_mixer_out(mixed))
        return self._mlp_forward(resid, pre)

    def _mlp_forward(self, resid, pre: bool):
        if not self.has_mlp:
            return self.hook_resid_post(resid)
        h = getattr(self, self.mlp_norm_attr)(resid) if pre else resid
        mlp = self.mlp_fn(self, h) if self.mlp_fn is not None else getattr(self, self.mlp_attr)(h)
        if isinstance(mlp, tuple):   # MoE blocks may also return router logits
            mlp = mlp[0]
        if not pre:
            mlp = self.post_feedforward_layernorm(mlp)
        if self.residual_multiplier != 1.0:
            mlp = mlp * self.residual_multiplier
        return self.hook_resid_post(resid + self.hook_mlp_out(mlp))
