"""BridgedLM: a transformers linear-attention hybrid with recurscope's hook names, cache and model protocol.

transformers' modules do the work (embeddings, norms, attention, MLP/MoE, rotary tables, masks, the cache object);
the bridge swaps in
- each decoder layer's glue (`BridgeBlock`), which adds the residual hooks and keeps the layer's own submodules;
- each linear-attention module (`bridge.mixers`), whose recurrence is `kernels.recurrence` through the hook points;
- the attention function (`attn_implementation="recurscope"`), eager softmax attention with hook points.
Hook names are recurscope's (`blocks.{l}.mixer.hook_state`, ...), whatever transformers calls the module.

The cache crosses the protocol as a `RecurrentCache` (states (B, H, K, V), conv tails as transformers keeps them,
K/V as (B, T, Hkv, D)), so that interventions edit it exactly as they edit a native model's; each call copies it
into a fresh transformers `DynamicCache` and reads the updated one back.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from recurscope.interp.bridge.families import BridgeFamily
from recurscope.interp.bridge.mixers import add_attention_hooks
from recurscope.interp.models.cache import LayerCache, RecurrentCache
from recurscope.interp.models.protocol import ProtocolMethods, at_positions, check_packed, unpack_cache
from recurscope.interp.models.tl_compat import TLConfigAliases


@dataclass
class BridgeConfig(TLConfigAliases):
    """The few facts about a bridged model that the protocol users read (as from a native ModelConfig)."""
    model_type: str
    vocab_size: int
    num_hidden_layers: int
    hf_config: object
    family_spec: object
    conv_size: int                  # the short convolution's kernel (write_block_conv_tail widens spans by it - 1)
    max_position_embeddings: Optional[int] = None   # pairs longer than this are refused (the attention layers)
    use_short_conv: bool = True     # every bridged linear-attention layer convolves q, k, v

    @property
    def state_heads(self) -> int:
        return self.family_spec.state_heads(self.hf_config)

    def state_shape(self) -> tuple[int, int]:
        return self.family_spec.state_shape(self.hf_config)

    @property
    def family(self):
        return self.family_spec

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)


class BridgeBlock(nn.Module):
    """A decoder layer of transformers with recurscope's residual hooks; it holds the transformers layer's own
    submodules under their own names. `norm="pre"`: input_layernorm before the mixer and post_attention_layernorm
    before the MLP (Qwen3.5, Qwen3-Next, Kimi-Linear, OLMo-hybrid's linear layers); `norm="post"`:
    post_attention_layernorm on the mixer's output and post_feedforward_layernorm on the MLP's (OLMo-hybrid's
    attention layers). hook_mixer_out and hook_mlp_out are what the layer adds to the residual stream.

    `attn_attr` (a module path in the layer): the layer also runs that attention module beside its recurrent mixer,
    and the block is both a recurrent and an attention layer, with the attention's hook points at `blocks.{l}.attn.*`
    (`attn` is that module) and its output at `hook_attn_out`. `attn_mode="parallel"` (Falcon-H1): the attention
    runs side by side with the mixer on the same normed input, and both outputs are added to the residual stream
    (hook_resid_mid is the residual plus both). `attn_mode="shared"` (Zamba2's hybrid layers): the layer first runs
    its shared transformer block (`shared_transformer`: attention and MLP over the residual concatenated with the
    token embeddings, `original_hidden_states`), projects it by `linear` (hook_attn_out) and adds that to the mixer's
    input only, not to the residual stream; its mixer (`mixer_attr`) and mixer norm are module paths inside the
    layer. `arg_names`: the names of the positional arguments after the hidden states with which the family's model
    calls each layer (Zamba2's)."""

    def __init__(self, hf_layer: nn.Module, mixer_attr: str, recurrent: bool, norm: str = "pre",
                 mixer_norm_attr: str = "input_layernorm", mlp_only: bool = False, mlp_attr: str = "mlp",
                 mlp_norm_attr: str = "post_attention_layernorm", mlp_fn=None, attn_attr: Optional[str] = None,
                 attn_mode: str = "parallel", arg_names: tuple = ()):
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
        if attn_mode not in ("parallel", "shared"):
            raise ValueError(f"attn_mode must be 'parallel' or 'shared', got {attn_mode!r}")
        self.attn_attr, self.attn_mode, self.arg_names = attn_attr, attn_mode, tuple(arg_names)
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
        # Falcon-H1's muP multipliers around its two mixers: the recurrent mixer's output times ssm_out_multiplier,
        # the attention's input times attention_in_multiplier and its output times attn_out_multiplier
        self.mixer_out_multiplier = float(getattr(hf_layer, "ssm_out_multiplier", 1.0))
        self.attention_in_multiplier = float(getattr(hf_layer, "attention_in_multiplier", 1.0))
        self.attention_out_multiplier = float(getattr(hf_layer, "attn_out_multiplier", 1.0))
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
        """What the block multiplies its mixer's output by before hook_mixer_out: Falcon-H1's ssm_out_multiplier in a
        parallel block, Granite-4.0-H's residual_multiplier in a plain one, 1 in Zamba2's shared-block layers."""
        if self.attn_attr is None:
            return self.residual_multiplier
        return self.mixer_out_multiplier if self.attn_mode == "parallel" else 1.0

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
        resid = self.hook_resid_pre(hidden_states)
        pre = self.norm_layout == "pre"
        if self.attn_mode == "shared" and self.attn_attr is not None:
            return self._shared_forward(resid, attention_mask, position_ids, cache, position_embeddings, kwargs)
        h = self._sub(self.mixer_norm_attr)(resid) if pre else resid
        if self.residual_in_fp32:
            resid = resid.to(torch.promote_types(resid.dtype, torch.float32))
        if self.mlp_only:
            resid = self.hook_resid_mid(resid)
            return self.hook_resid_post(resid + self.hook_mlp_out(self.mixer(h)))
        if self.attn_attr is not None:
            return self._parallel_forward(resid, h, attention_mask, position_ids, cache, position_embeddings, kwargs)
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

    def _parallel_forward(self, resid, h, attention_mask, position_ids, cache, position_embeddings, kwargs):
        """Falcon-H1's layer: the recurrent mixer and the attention on the same normed input h, both outputs added to
        the residual stream (as transformers adds them: residual + (mixer + attention)), then the MLP."""
        mixed = self.mixer(h, cache=cache, attention_mask=kwargs.get("mamba_attention_mask"))
        if self.mixer_out_multiplier != 1.0:
            mixed = mixed * self.mixer_out_multiplier
        attended, _ = self.attn(hidden_states=h * self.attention_in_multiplier if self.attention_in_multiplier != 1.0
                                else h, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                position_embeddings=position_embeddings)
        if self.attention_out_multiplier != 1.0:
            attended = attended * self.attention_out_multiplier
        resid = self.hook_resid_mid(resid + (self.hook_mixer_out(mixed) + self.hook_attn_out(attended)))
        return self._mlp_forward(resid, True)

    def _shared_forward(self, resid, attention_mask, position_ids, cache, position_embeddings, kwargs):
        """Zamba2's hybrid layer: its shared transformer block reads the residual and the token embeddings; its
        output, projected by `linear`, is added to the mixer's input (before the mixer norm), not to the residual
        stream; then the mixer, whose output is added to the residual (attention_mask is the mixer's mask,
        causal_mask the shared attention's)."""
        shared = self.shared_transformer(resid, original_hidden_states=kwargs["original_hidden_states"],
                                         layer_idx=kwargs["layer_idx"], attention_mask=kwargs.get("causal_mask"),
                                         cache=cache, position_embeddings=position_embeddings,
                                         position_ids=position_ids)
        fed = self.hook_attn_out(self.linear(shared))
        mixed = self.mixer(self._sub(self.mixer_norm_attr)(resid + fed), cache=cache, attention_mask=attention_mask)
        resid = self.hook_resid_mid(resid + self.hook_mixer_out(mixed))
        return self._mlp_forward(resid, True)

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


class _LayerView:
    """What a bridged layer reads of transformers' cache, served from one recurscope LayerCache without writing it:
    the layer's own call sees the cached state, conv tail and K/V with its new inputs appended, as transformers'
    cache returns them, and nothing is stored. The head scan's rows share the recipient's cache as batch-expanded
    views, which transformers' in-place cache updates could not take (and would copy per row)."""

    def __init__(self, lc: LayerCache, seen: int, new_kv_only: bool = False, state_transposed: bool = False):
        # new_kv_only: `update` returns the new K/V alone; the attention function reads the cached ones itself
        # (the module's shared_kv, set by BridgedLM.run_layer). state_transposed: the layer reads its state as
        # transformers keeps it, (V, K) per head (Mamba-2), while the LayerCache holds recurscope's (K, V)
        self.lc, self.seen, self.new_kv_only, self.state_transposed = lc, seen, new_kv_only, state_transposed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        state = self.lc.state
        return state.transpose(-1, -2) if self.state_transposed and state is not None else state

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.lc.conv.get(str(state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        tail = self.lc.conv.get(str(state_idx))
        return conv_states if tail is None else torch.cat([tail.to(conv_states.dtype), conv_states], dim=-1)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return recurrent_states

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.lc.keys is None or self.new_kv_only:
            return key_states, value_states
        return (torch.cat([self.lc.keys.transpose(1, 2), key_states], dim=-2),
                torch.cat([self.lc.values.transpose(1, 2), value_states], dim=-2))


_BLOCKS_KEY = re.compile(r"(?:^|\.)blocks\.\d+\.")


def _drop_block_aliases(module, state_dict, prefix, local_metadata) -> None:
    """`blocks` holds transformers' own layers a second time (as `hf.model.layers`): its entries are left out of
    the state dict, whose names stay transformers' own under `hf.`."""
    for key in [k for k in state_dict if k.startswith(prefix + "blocks.")]:
        del state_dict[key]


def _ignore_block_aliases(module, incompatible_keys) -> None:
    """load_state_dict: the `blocks.` entries are not in a state dict (see _drop_block_aliases); the same tensors
    load through `hf.`."""
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not _BLOCKS_KEY.search(k)]


class BridgedLM(ProtocolMethods, HookedRootModule):
    """A transformers causal LM (`hf`) with recurscope's hooks; implements the model protocol (interp.models.protocol).

    `model(tokens)` returns logits; `model(tokens, cache=c, use_cache=True)` returns (logits, RecurrentCache);
    `state_positions` asks every linear-attention layer for S_t at those positions (`blocks.{l}.mixer.hook_state`).
    `blocks` is an `nn.ModuleList` of the decoder layers (each a `BridgeBlock` over transformers' own layer, also
    reachable as `hf.model.layers.{l}`), so every hook name is a module path: `get_submodule(name)` and nnsight's
    envoys (`model_nn.blocks[l].mixer.hook_state`) resolve it. Parameters and the state dict keep transformers'
    names under `hf.` (the `blocks.` aliases are left out of the state dict).
    """

    def __init__(self, hf: nn.Module, family: BridgeFamily, tokenizer=None):
        super().__init__()
        from recurscope.interp.bridge.mixers import register_attention

        register_attention()
        base = hf.base_model        # hf.model (the decoder hybrids), hf.backbone (Mamba-2)
        text = base.language_model if hasattr(base, "language_model") else base
        text_cfg = text.config
        text_cfg._attn_implementation = "recurscope"
        self.bridge_family = family
        self.text_layer_types = list(text_cfg.layer_types)
        mixer_cls = family.spec.mixer_class
        blocks = []
        for i, layer in enumerate(text.layers):
            parallel = self.text_layer_types[i] in family.parallel_block_types   # Falcon-H1: mixer and attention
            shared = self.text_layer_types[i] in family.shared_block_types       # Zamba2: shared block, then mixer
            recurrent = self.text_layer_types[i] == "linear_attention" or parallel or shared
            mlp_only = self.text_layer_types[i] in family.mlp_block_types
            mixer_path, norm_path, attn_path = (family.shared_block_paths if shared else
                                                (family.linear_attr if recurrent else family.attention_attr,
                                                 family.mixer_norm_attr, family.attention_attr))
            if recurrent:
                owner, _, name = mixer_path.rpartition(".")
                owner = layer.get_submodule(owner) if owner else layer
                setattr(owner, name, mixer_cls(getattr(owner, name)))
            if parallel or shared or not (recurrent or mlp_only):
                add_attention_hooks(layer.get_submodule(attn_path))
            block = BridgeBlock(layer, mixer_path, recurrent, "pre" if recurrent else family.attention_norm,
                                norm_path, mlp_only, family.mlp_attr, family.mlp_norm_attr, family.mlp_fn,
                                attn_path if parallel or shared else None, "shared" if shared else "parallel",
                                family.layer_args)
            block.returns_tuple = family.layer_returns_tuple
            text.layers[i] = block
            blocks.append(block)
        self.hf = hf
        self.text_model = [text]      # a plain list: not a second registration of the same modules
        # Registered after `hf`, so that named_parameters and named_modules list transformers' paths first.
        self.blocks = nn.ModuleList(blocks)
        self.register_state_dict_post_hook(_drop_block_aliases)
        self.register_load_state_dict_post_hook(_ignore_block_aliases)
        self.hook_embed = HookPoint()
        text.get_input_embeddings().register_forward_hook(lambda module, args, out: self.hook_embed(out))
        self.cfg = BridgeConfig(family.spec.name, int(text_cfg.vocab_size), int(text_cfg.num_hidden_layers),
                                text_cfg, family.spec, conv_size=int(getattr(text_cfg, family.conv_kernel_key)),
                                max_position_embeddings=getattr(text_cfg, "max_position_embeddings", None))
        self.tokenizer = tokenizer
        self.name_or_path: Optional[str] = None
        self.checkpoint_dir = None
        self.setup()

    def setup(self):
        """TransformerLens's setup, then the hook points renamed to recurscope's names (blocks.{l}.mixer.hook_x)."""
        super().setup()
        # each hook point's name from the block and the module that hold it: the block's own, its mixer's (the
        # recurrent mixer, or an attention block's attention) or the attention beside the mixer (`attn`)
        names = {}
        for layer, block in enumerate(self.blocks):
            attn = block.attn
            in_attn = set() if attn is None else {id(m) for m in attn.modules()}
            for path, module in block.named_modules():
                if isinstance(module, HookPoint):
                    point = path.rsplit(".", 1)[-1]
                    sub = "" if "." not in path else "attn." if id(module) in in_attn else "mixer."
                    names[id(module)] = f"blocks.{layer}.{sub}{point}"
        renamed = {}
        for path, hp in self.hook_dict.items():
            name = path if path == "hook_embed" else names.get(id(hp))
            if name is None:
                raise RuntimeError(f"bridge: hook point {path} has no recurscope name")
            hp.name = name
            renamed[name] = hp
            self.mod_dict[name] = hp
        self.hook_dict = renamed

    # The facts (recurrent_layers, attention_layers, family, n_state_heads), the debug switch, set_backend,
    # run_with_cache and TransformerLens's methods come from ProtocolMethods (interp.models.protocol).
    def _embedding(self) -> nn.Embedding:
        return self.text_model[0].get_input_embeddings()

    # ---- the cache: RecurrentCache <-> transformers' DynamicCache ----------------------------------------------
    def _to_hf_cache(self, cache: Optional[RecurrentCache]):
        from transformers import DynamicCache

        hf_cache = DynamicCache(config=self.cfg.hf_config)
        if cache is None:
            return hf_cache
        if len(cache.layers) != len(self.blocks):
            raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {len(self.blocks)}")
        for i, lc in enumerate(cache.layers):
            layer = hf_cache.layers[i]
            if lc.kind == "none":   # an MLP-only block: transformers keeps no cache layer content for it
                continue
            if lc.kind in ("recurrent", "hybrid"):   # "hybrid": a parallel block's state, conv tail and K/V
                for key, conv in lc.conv.items():
                    idx = int(key)
                    layer.conv_states[idx] = conv.clone()   # transformers updates its cache in place
                    layer.conv_kernel_size[idx] = conv.shape[-1]
                    layer.is_conv_states_initialized[idx] = True
                    layer.has_previous_state[idx] = True
                if lc.state is not None:
                    state = lc.state.transpose(-1, -2) if self.bridge_family.state_transposed else lc.state
                    layer.recurrent_states[0] = state.contiguous().clone()
                    layer.is_recurrent_states_initialized[0] = True
                    layer.has_previous_state[0] = True
                layer.device, layer.dtype = lc.state.device, lc.state.dtype
            if lc.kind != "recurrent" and lc.keys is not None:
                layer.update(lc.keys.transpose(1, 2).contiguous(), lc.values.transpose(1, 2).contiguous())
        return hf_cache

    def _from_hf_cache(self, hf_cache, seen: int) -> RecurrentCache:
        layers = []
        for i, block in enumerate(self.blocks):
            layer = hf_cache.layers[i]
            if block.is_recurrent:
                conv = {str(k): v for k, v in layer.conv_states.items() if v is not None}
                state = layer.recurrent_states[0]
                if self.bridge_family.state_transposed and state is not None:
                    state = state.transpose(-1, -2)
                hybrid = block.attn_attr is not None   # Falcon-H1's and Zamba2's: the state and the attention's K/V
                kv = {} if not hybrid or layer.keys is None else \
                    dict(keys=layer.keys.transpose(1, 2), values=layer.values.transpose(1, 2))
                layers.append(LayerCache("hybrid" if hybrid else "recurrent", state=state, conv=conv, **kv))
            elif block.mlp_only:
                layers.append(LayerCache("none"))
            else:
                layers.append(LayerCache("attention", keys=layer.keys.transpose(1, 2), values=layer.values.transpose(1, 2)))
        return RecurrentCache(layers, seen)

    # ---- packed sequences and caches of different lengths per row ---------------------------------------------
    def _mask_mapping(self, allowed: torch.Tensor) -> dict:
        """transformers' per-layer-type masks for a call whose attention pattern we give: `allowed` (B, 1, T, S)
        for the attention layers, no mask for the others (every bridged family's text model takes this mapping)."""
        kinds = {}
        for kind, block in zip(self.text_layer_types, self.blocks):
            if block.is_attention and "sliding" in kind:
                raise ValueError(f"packed sequences and caches of different lengths: layer type {kind!r} (a sliding "
                                 "window) is not supported; run the rows one by one")
            kinds[kind] = allowed if block.is_attention else None
        return kinds

    def _ragged_inputs(self, B: int, T: int, cache: Optional[RecurrentCache], cu: Optional[list], device):
        """(position ids (B, T), the mask mapping) for packed sequences (cu) or a cache with per-row lengths."""
        from recurscope.interp.models.layers import sequence_starts

        if cu is not None:
            start = sequence_starts(cu, T, device)
            positions = (torch.arange(T, device=device) - start)[None]
            allowed = (start[:, None] == start[None, :]) & torch.ones(T, T, dtype=torch.bool, device=device).tril()
            return positions, self._mask_mapping(allowed[None, None])
        P, lengths = cache.seen_tokens, cache.lengths.to(device)
        positions = lengths[:, None] + torch.arange(T, device=device)
        kpos = torch.arange(P + T, device=device)
        allowed = (kpos[None, :] <= P + torch.arange(T, device=device)[:, None])[None] & \
            (kpos[None, None, :] >= (P - lengths)[:, None, None])
        return positions.expand(B, T), self._mask_mapping(allowed[:, None].expand(B, 1, T, P + T))

    # ---- forward --------------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: Optional[RecurrentCache] = None, use_cache: bool = False,
                state_positions: Optional[Sequence[int]] = None, logit_positions: Optional[torch.Tensor] = None,
                return_type: Optional[str] = "logits", loss_per_token: bool = False,
                prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None, cu_seqlens=None):
        """As RecurrentLM.forward: `logit_positions` ((B,) or (B, P)) gives logits at those positions only; text
        input and `return_type` as in TransformerLens. cu_seqlens: tokens (1, T) hold packed sequences, each run as
        if alone (as RecurrentLM.forward: per-sequence convs and states, block-diagonal attention, positions
        restarting; the cache has one row per sequence with their lengths)."""
        self._check_return_type(return_type)
        tokens = self._input_tokens(tokens, prepend_bos, padding_side)
        self._check_state_positions(state_positions, tokens.shape[1])
        vocab = self.cfg.vocab_size
        if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
            raise ValueError(f"token ids must lie in [0, {vocab - 1}]; got ids in [{int(tokens.min())}, "
                             f"{int(tokens.max())}] (wrong tokenizer for this model?)")
        cu = None if cu_seqlens is None else check_packed(tokens, cu_seqlens, cache, return_type)
        offset = 0 if cache is None else cache.seen_tokens
        B, T = tokens.shape
        hf_cache = self._to_hf_cache(cache) if (cache is not None or use_cache) else None
        kwargs = {}
        if cu is not None or (cache is not None and cache.lengths is not None):
            positions, kwargs["attention_mask"] = self._ragged_inputs(B, T, cache, cu, tokens.device)
        else:
            positions = torch.arange(offset, offset + T, device=tokens.device)[None].expand(B, T)
        mixers = [b.mixer for b in self.blocks if b.is_recurrent]
        attentions = [b.mixer for b in self.blocks if b.is_attention and hasattr(b.mixer, "cu_seqlens")]
        for m in mixers:
            m.state_positions = state_positions
            m.cu_seqlens = cu
        for m in attentions:
            m.cu_seqlens = cu
        try:
            out = self.text_model[0](input_ids=tokens, position_ids=positions, cache=hf_cache,
                                     use_cache=hf_cache is not None, **kwargs)
        finally:
            for m in mixers:
                m.state_positions = None
                m.cu_seqlens = None
            for m in attentions:
                m.cu_seqlens = None
        hidden = out.last_hidden_state
        if logit_positions is not None:
            hidden = at_positions(hidden, logit_positions)
        logits = self._logits(hidden)
        new_cache = None
        if use_cache:
            new_cache = self._from_hf_cache(hf_cache, offset + T)
            if cu is not None:
                new_cache = unpack_cache(new_cache, cu)
            elif cache is not None and cache.lengths is not None:
                new_cache.lengths = cache.lengths + T
        return self._output(logits, tokens, return_type, loss_per_token, logit_positions, new_cache, use_cache)

    # ---- layer by layer (the protocol's embed_suffix / run_layer / unembed) -----------------------------------
    def embed_suffix(self, tokens: torch.Tensor, cache: RecurrentCache):
        """The residual entering layer 0 (every bridged family's text model feeds its embeddings to the layers
        unchanged) and the arguments transformers' own model passes each layer for `tokens` after `cache`: they are
        recorded from a run of the text model with one row and with the layers computing nothing, so that each
        family's own masks, rotary tables and position ids are used, and they broadcast over any number of rows
        (positions and causal masks are the same for every row of a cache, since the bridge takes no padding)."""
        text = self.text_model[0]
        B, T = tokens.shape
        kwargs = {}
        if cache.lengths is None:
            one = RecurrentCache([lc.map(lambda t: t[:1]) for lc in cache.layers], cache.seen_tokens)
            positions = torch.arange(cache.seen_tokens, cache.seen_tokens + T, device=tokens.device)[None]
        else:   # rows of different lengths: each row's own positions and K/V padding (one row per cache row)
            one = cache
            positions, kwargs["attention_mask"] = self._ragged_inputs(B, T, cache, None, tokens.device)
        embeds = torch.zeros(positions.shape[0], T, self.cfg.hf_config.hidden_size,
                             dtype=self._embedding().weight.dtype, device=tokens.device)
        for block in self.blocks:
            block.recorded = []
        try:
            text(inputs_embeds=embeds, position_ids=positions, cache=self._to_hf_cache(one), use_cache=True, **kwargs)
            context = [block.recorded[0] for block in self.blocks]
        finally:
            for block in self.blocks:
                block.recorded = None
        # Granite-4.0-H's and Falcon-H1's models scale their embeddings before the first layer
        scale = float(getattr(text, "embedding_multiplier", 1.0))
        return self._embedding()(tokens) * scale, (context, cache.seen_tokens)

    def run_layer(self, layer: int, resid: torch.Tensor, layer_cache: LayerCache, context) -> torch.Tensor:
        kwargs, seen = context
        if self.bridge_family.shared_block_types:
            # Zamba2's shared blocks read the token embeddings at every use: the residual between layers carries them
            # in its trailing channels (layer 0 takes the bare embeddings and appends them), so that rows regrouped
            # between layers (the head scan's growing batch) keep their own
            d = self.cfg.hidden_size
            embeds = resid if layer == 0 else resid[..., d:]
            per_layer = list(kwargs)
            per_layer[layer] = dict(kwargs[layer], original_hidden_states=embeds)
            out = self._run_block(layer, resid[..., :d], layer_cache, (per_layer, seen))
            return torch.cat([out, embeds], dim=-1)
        return self._run_block(layer, resid, layer_cache, context)

    def _run_block(self, layer: int, resid: torch.Tensor, layer_cache: LayerCache, context) -> torch.Tensor:
        kwargs, seen = context
        block = self.blocks[layer]
        keys = layer_cache.keys
        # Rows continuing one cached row as a batch-expanded view (the head scan's growing batch): the attention
        # function reads that row's K/V once for all rows instead of a per-row concatenation (hooked_attention).
        shared = (block.is_attention and self.bridge_family.cached_kv_to_attention and keys is not None
                  and keys.shape[0] > 1 and keys.stride(0) == 0 and layer_cache.values.stride(0) == 0)
        transposed = self.bridge_family.state_transposed
        if not shared:
            return block.block_forward(resid, cache=_LayerView(layer_cache, seen, state_transposed=transposed),
                                       **kwargs[layer])
        attention = block.attention   # the block's mixer, or the attention beside a parallel block's mixer
        attention.shared_kv = (keys[:1].transpose(1, 2), layer_cache.values[:1].transpose(1, 2))
        try:
            return block.block_forward(resid, cache=_LayerView(layer_cache, seen, new_kv_only=True,
                                                                state_transposed=transposed), **kwargs[layer])
        finally:
            attention.shared_kv = None

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Logits of residual-stream vectors (..., D): the text model's final norm, then the LM head. (forward
        applies only the LM head: transformers' text model returns its hidden states already normed.)"""
        resid = resid[..., :self.cfg.hidden_size]   # channels beyond D: what run_layer carries (Zamba2's embeddings)
        return self._logits(self.final_norm(resid))

    @property
    def final_norm(self) -> nn.Module:
        """The text model's final norm, which `unembed` applies before the LM head."""
        return getattr(self.text_model[0], self.bridge_family.final_norm_attr)

    @property
    def logit_multiplier(self) -> float:
        """The factor transformers' forward applies to the LM head's output: 1 / Granite-4.0-H's logits_scaling times
        Falcon-H1's lm_head_multiplier (1 for every other family)."""
        return (float(getattr(self.text_model[0], "lm_head_multiplier", 1.0))
                / float(getattr(self.hf, "logits_scaling", 1.0)))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head times logit_multiplier, as transformers' forward computes the logits."""
        logits = self.hf.lm_head(hidden)
        scale = self.logit_multiplier
        return logits if scale == 1.0 else logits * scale

    @property
    def unembed_weight(self) -> torch.Tensor:
        """(vocab, D): the unembedding that `unembed` applies after the final norm, the LM head's weight times
        logit_multiplier, so that final_norm(resid) @ unembed_weight.T are the model's own logits."""
        scale = self.logit_multiplier
        return self.hf.lm_head.weight if scale == 1.0 else self.hf.lm_head.weight * scale


#: the earlier name (TransformerLens 4 has a `TransformerBridge` of its own)
TransformersBridge = BridgedLM
