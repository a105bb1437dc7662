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

from recurscope.interp.bridge.adapters import BridgeAdapter
from recurscope.interp.bridge.blocks import BridgeBlock  # noqa: F401  (the blocks' class, importable from here as before)
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
    use_short_conv: bool = True     # its recurrent layers convolve their inputs (the adapter's short_conv)

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

    def __init__(self, hf: nn.Module, family: BridgeAdapter, tokenizer=None):
        super().__init__()
        from recurscope.interp.bridge.mixers import register_attention

        register_attention()
        base = hf.base_model        # hf.model (the decoder hybrids), hf.backbone (Mamba-2)
        text = base.language_model if hasattr(base, "language_model") else base
        text_cfg = text.config
        text_cfg._attn_implementation = "recurscope"
        self.bridge_family = family   # the architecture's adapter (bridge/adapters/)
        self.text_layer_types = family.layer_types(text_cfg)
        layers, blocks = family.decoder_layers(text), []
        for i, layer in enumerate(layers):
            block = family.make_block(layer, self.text_layer_types[i])
            layers[i] = block
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
                                text_cfg, family.spec, conv_size=family.conv_size(text_cfg),
                                max_position_embeddings=getattr(text_cfg, "max_position_embeddings", None),
                                use_short_conv=family.short_conv)
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
        return self.bridge_family.to_hf_cache(self.blocks, cache, self.cfg.hf_config)

    def _from_hf_cache(self, hf_cache, seen: int) -> RecurrentCache:
        return self.bridge_family.from_hf_cache(self.blocks, hf_cache, seen)

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
                                     use_cache=use_cache or cache is not None, **kwargs)
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
            # (the cache the model made, where the adapter hands it none to fill: xLSTM's is sized by the batch)
            new_cache = self._from_hf_cache(out.cache if hf_cache is None else hf_cache, offset + T)
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
        return self.bridge_family.run_layer(self, layer, resid, layer_cache, context)

    def run_block(self, layer: int, resid: torch.Tensor, layer_cache: LayerCache, context) -> torch.Tensor:
        kwargs, seen = context
        block = self.blocks[layer]
        keys = layer_cache.keys
        # Rows continuing one cached row as a batch-expanded view (the head scan's growing batch): the attention
        # function reads that row's K/V once for all rows instead of a per-row concatenation (hooked_attention).
        shared = (block.is_attention and self.bridge_family.cached_kv_to_attention and keys is not None
                  and keys.shape[0] > 1 and keys.stride(0) == 0 and layer_cache.values.stride(0) == 0)
        view = self.bridge_family.layer_view
        if not shared:
            return block.block_forward(resid, cache=view(layer_cache, seen), **kwargs[layer])
        attention = block.attention   # the block's mixer, or the attention beside a parallel block's mixer
        attention.shared_kv = (keys[:1].transpose(1, 2), layer_cache.values[:1].transpose(1, 2))
        try:
            return block.block_forward(resid, cache=view(layer_cache, seen, new_kv_only=True), **kwargs[layer])
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
        return self.bridge_family.cap_logits(self.hf, logits if scale == 1.0 else logits * scale)

    @property
    def unembed_weight(self) -> torch.Tensor:
        """(vocab, D): the unembedding that `unembed` applies after the final norm, the LM head's weight times
        logit_multiplier, so that final_norm(resid) @ unembed_weight.T are the model's own logits."""
        scale = self.logit_multiplier
        return self.hf.lm_head.weight if scale == 1.0 else self.hf.lm_head.weight * scale


#: the earlier name (TransformerLens 4 has a `TransformerBridge` of its own)
TransformersBridge = BridgedLM
