"""The decoder every family shares, as a TransformerLens HookedRootModule: embeddings, pre-norm blocks
(RMSNorm, token mixer, residual, RMSNorm, SwiGLU MLP, residual), a final RMSNorm and the LM head."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from recurscope.interp.models.cache import RecurrentCache
from recurscope.interp.models.config import ModelConfig
from recurscope.interp.models.layers import GatedMLP, RMSNorm
from recurscope.interp.models.protocol import ProtocolMethods, at_positions, check_packed, unpack_cache
from recurscope.interp.models.mixers import AttentionMixer, RecurrentMixer


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        spec = cfg.attention_spec(layer)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if spec is not None:
            self.mixer = AttentionMixer(cfg, spec)
        else:   # the family's mixer (interp/models/families.py), built by the mixer contract
            self.mixer = cfg.family.mixer_class(cfg, layer=layer)
        self.hook_resid_pre = HookPoint()
        self.hook_mixer_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_resid_post = HookPoint()
        if cfg.family.mlp:        # Mamba-2's blocks have none (FamilySpec.mlp): norm, mixer, residual only
            self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.mlp = GatedMLP(cfg.hidden_size, cfg.mlp_intermediate)
            self.hook_mlp_out = HookPoint()
        else:
            self.mlp = None

    @property
    def is_recurrent(self) -> bool:
        return isinstance(self.mixer, RecurrentMixer)

    def forward(self, resid, layer_cache=None, state_positions=None, offset=0, carry=None):
        """carry: a dict one forward passes through every block, for what a family hands between layers (RWKV-7's
        first-layer values); this block needs none."""
        resid = self.hook_resid_pre(resid)
        if self.is_recurrent:
            mixed, new_cache = self.mixer(self.attn_norm(resid), layer_cache, state_positions)
        else:
            mixed, new_cache = self.mixer(self.attn_norm(resid), layer_cache, offset=offset)
        resid = self.hook_resid_mid(resid + self.hook_mixer_out(mixed))
        if self.mlp is not None:
            resid = resid + self.hook_mlp_out(self.mlp(self.mlp_norm(resid)))
        resid = self.hook_resid_post(resid)
        return resid, new_cache


class RecurrentLM(ProtocolMethods, HookedRootModule):
    """A hooked decoder for GLA, Gated DeltaNet, Gated DeltaNet-2/QED and their hybrids with attention.

    `model(tokens)` returns logits; `model(tokens, cache=c, use_cache=True)` returns (logits, RecurrentCache).
    `state_positions` asks the recurrent mixers for S_t at those positions (hook `blocks.{l}.mixer.hook_state`).
    `logit_positions` ((B,) or (B, P) token indices) returns logits at those positions only, (B, V) or (B, P, V):
    the LM head over every position dominates time and memory at long lengths when only a few are read.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.hook_embed = HookPoint()
        block = cfg.family.block_class or Block    # a family whose block is not Block's (RWKV-7) names its own
        self.blocks = nn.ModuleList([block(cfg, i) for i in range(cfg.num_hidden_layers)])
        final = cfg.family.final_norm
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if final is None else final(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.tokenizer = None
        self.name_or_path: Optional[str] = None
        self.setup()

    # The facts (recurrent_layers, attention_layers, family, n_state_heads), the debug switch, set_backend,
    # run_with_cache and TransformerLens's methods come from ProtocolMethods (interp.models.protocol).
    def _embedding(self) -> nn.Embedding:
        return self.embed

    # ---- forward ------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, cache: Optional[RecurrentCache] = None, use_cache: bool = False,
                state_positions: Optional[Sequence[int]] = None, logit_positions: Optional[torch.Tensor] = None,
                return_type: Optional[str] = "logits", loss_per_token: bool = False,
                prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None, cu_seqlens=None):
        """`tokens`: (B, T) or (T,) ids, or text (tokenised by `to_tokens` with `prepend_bos`, `padding_side`).
        `return_type` as in TransformerLens: 'logits', 'loss' (next-token cross-entropy, per token with
        `loss_per_token`), 'both' (logits, loss) or None.
        cu_seqlens: tokens (1, T) hold packed sequences at these offsets (protocol.pack_rows), each run as if alone:
        the short convolutions and the recurrence restart at each, attention is block-diagonal with positions
        restarting, state_positions count packed steps and a state patch carries forward within its own sequence
        only; the cache (use_cache) has one row per sequence, with their lengths (RecurrentCache.lengths)."""
        self._check_return_type(return_type)
        if cu_seqlens is not None:
            return self._packed_forward(tokens, cu_seqlens, cache, use_cache, state_positions, logit_positions,
                                        return_type, loss_per_token)
        tokens = self._input_tokens(tokens, prepend_bos, padding_side)
        self._check_state_positions(state_positions, tokens.shape[1])
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(tokens)).tolist())   # the call's one host sync
        if hi >= self.cfg.vocab_size or lo < 0:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size - 1}]; got ids in [{lo}, {hi}] "
                             "(wrong tokenizer for this model?)")
        if cache is not None and len(cache.layers) != len(self.blocks):
            raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {len(self.blocks)}")
        offset = 0 if cache is None else cache.offsets(tokens.device)
        resid = self.hook_embed(self.embed(tokens))
        new_layers = []
        carry = {}
        for i, block in enumerate(self.blocks):
            lc = None if cache is None else cache.layers[i]
            resid, new_lc = block(resid, lc, state_positions, offset, carry)
            new_layers.append(new_lc)
        if logit_positions is not None:
            resid = at_positions(resid, logit_positions)
        logits = self.unembed(resid)
        seen = 0 if cache is None else cache.seen_tokens
        lengths = None if cache is None or cache.lengths is None else cache.lengths + tokens.shape[1]
        new_cache = RecurrentCache(new_layers, seen + tokens.shape[1], lengths) if use_cache else None
        return self._output(logits, tokens, return_type, loss_per_token, logit_positions, new_cache, use_cache)

    def _packed_forward(self, tokens, cu_seqlens, cache, use_cache, state_positions, logit_positions, return_type,
                        loss_per_token):
        cu = check_packed(tokens, cu_seqlens, cache, return_type)
        if self.cfg.family.block_class is not None:
            raise ValueError(f"packed sequences (cu_seqlens) are not supported for {self.cfg.family.name} (its "
                             "token shift crosses sequences); run the sequences one by one")
        mixers = [b.mixer for b in self.blocks if hasattr(b.mixer, "cu_seqlens")]
        for m in mixers:
            m.cu_seqlens = cu
        try:
            out = self(tokens, use_cache=use_cache, state_positions=state_positions, logit_positions=logit_positions,
                       return_type=return_type, loss_per_token=loss_per_token)
        finally:
            for m in mixers:
                m.cu_seqlens = None
        if not use_cache:
            return out
        *rest, packed = out
        return (*rest, unpack_cache(packed, cu))

    # ---- layer by layer (the protocol's embed_suffix / run_layer / unembed) ----
    def embed_suffix(self, tokens: torch.Tensor, cache: RecurrentCache):
        """The residual entering layer 0, and the context every layer needs: the cache's length (rotary offset), or
        each row's own length for a cache of packed sequences (RecurrentCache.lengths)."""
        return self.hook_embed(self.embed(tokens)), cache.offsets(tokens.device)

    def run_layer(self, layer: int, resid: torch.Tensor, layer_cache, context) -> torch.Tensor:
        block = self.blocks[layer]
        if hasattr(block, "run_alone"):       # a block that hands something on to later layers (RWKV-7's v_first)
            return block.run_alone(resid, layer_cache, context)
        return block(resid, layer_cache, offset=context)[0]

    def unembed(self, resid: torch.Tensor) -> torch.Tensor:
        """Logits of residual-stream vectors (..., D): the final norm, then the LM head, as after the last block.
        Channels beyond D (what a family's run_layer carries between layers, RWKV-7's v_first) are dropped."""
        return self.lm_head(self.norm(resid[..., :self.cfg.hidden_size]))

    @property
    def final_norm(self) -> nn.Module:
        """The final norm, which `unembed` applies before the LM head."""
        return self.norm

    @property
    def unembed_weight(self) -> torch.Tensor:
        """(vocab, D): the LM head's weight, which `unembed` applies after the final norm."""
        return self.lm_head.weight
