"""xLSTM (transformers' `xLSTMForCausalLM`, xLSTM-7B's architecture): blocks of an mLSTM layer and a gated
feed-forward, each pre-normed, no attention; logits soft-capped.

The mLSTM per head (transformers' `mlstm_recurrent_step_native`), with q' = q / sqrt(d_qk),
f = logsigmoid(soft_cap(f_pre)), i = soft_cap(i_pre):

    C_t = e^{f_t} C_{t-1} + e^{i_t} k_t v_t^T,    n_t = e^{f_t} n_{t-1} + e^{i_t} k_t,
    h_t = (C_t^T q'_t) / (max(|n_t^T q'_t|, 1) + eps e^{m_t}),    m_t = max(f_t + m_{t-1}, i_t)

transformers keeps the stabilised C~ = C e^{-m}, n~ = n e^{-m} and m, which gives the same h. C and n follow one
recurrence: n is a further value column of the memory whose value is always 1. So the kernel runs, per head,

    S_t = Diag(exp g_t) S_{t-1} + k_t x_t^T,   g_t = f_t (per head),   x_t = e^{i_t} [v_t, 1],   a = 0,
    o_t = S_t^T q'_t = [C_t^T q'_t, n_t^T q'_t]

an exact fit with a state of K x (V + 1): the memory C in the first V columns, the normaliser n in the last. The
stabiliser m depends on the gates alone; it enters only as the eps guard, and is carried in the cache beside the
state (`LayerCache.conv["m"]`; xLSTM has no short convolution).
"""
from __future__ import annotations

import importlib
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from recurscope.interp.bridge.adapters.base import TRANSFORMERS_WEIGHTS, BridgeAdapter
from recurscope.interp.bridge.blocks import BridgeBlock
from recurscope.interp.bridge.mixers import _adopt
from recurscope.interp.models.families import FamilySpec
from recurscope.interp.models.mixers import RecurrentMixer

_MODELING = "transformers.models.xlstm.modeling_xlstm"

SPEC = FamilySpec(
    name="xlstm", title="xLSTM: mLSTM (matrix memory, exponential input gate, normaliser) + gated feed-forward "
                        "(transformers)",
    weights=TRANSFORMERS_WEIGHTS,
    config_keys=frozenset({"num_heads", "qk_dim_factor", "v_dim_factor", "gate_soft_cap", "output_logit_soft_cap",
                           "weight_mode", "eps", "use_bias", "norm_eps", "embedding_dim", "num_blocks",
                           "ffn_proj_factor", "ffn_round_up_to_multiple_of", "add_out_norm"}),
    kernel_inputs={"q": "q / sqrt(d_qk), per head", "k": "k, per head",
                   "x": "exp(soft_cap(i_pre)) [v, 1]: the value and a constant 1, whose column of the state is the "
                        "normaliser n",
                   "g": "logsigmoid(soft_cap(f_pre)), per head", "a": "none (no erase)"},
    mixer="BridgedMLSTM", mixer_module=__name__,
    state_shape=lambda cfg: (cfg.qk_head_dim, cfg.v_head_dim + 1), state_heads=lambda cfg: cfg.num_heads,
    absent_hooks=frozenset({"hook_erase", "hook_erase_gate"}),
)


class BridgedMLSTM(RecurrentMixer):
    """transformers' `xLSTMLayer` with its recurrence through `kernels.recurrence` (module docstring). hook_q is q'
    (scaled), hook_k k, hook_v v, hook_decay g = logsigmoid(soft_cap(f_pre)), hook_write_value e^{i} [v, 1]
    (V + 1 columns), hook_state [C | n] (B, H, K, V + 1) at the requested positions, hook_head_out the readout
    [C^T q', n^T q'] (V + 1 columns); hook_z is sigmoid(o_pre) times `multihead_norm` of h (V columns), before
    out_proj."""

    readout_scale = 1.0   # q is scaled by d_qk^-1/2 before hook_q, as transformers scales it

    def __init__(self, hf_layer: torch.nn.Module):
        super().__init__(0)
        del self.hook_erase
        _adopt(self, hf_layer)
        self.xcfg = hf_layer.config
        self.num_heads = self.xcfg.num_heads
        self.head_k = hf_layer.qk_dim // self.num_heads
        self.head_v = hf_layer.v_dim // self.num_heads
        self.soft_cap = importlib.import_module(_MODELING).soft_cap
        self.state_positions: Optional[Sequence[int]] = None   # set by the bridge for one call

    def _projections(self, x):
        cfg = self.xcfg
        if cfg.weight_mode == "single":
            q, k, v, o_pre = self.q(x), self.k(x), self.v(x), self.ogate_preact(x)
            i_pre, f_pre = self.igate_preact(x), self.fgate_preact(x)
        else:
            qk = self.head_k * self.num_heads
            q, k, v, o_pre = torch.tensor_split(self.qkv_opreact(x), (qk, 2 * qk, 2 * qk + self.head_v * self.num_heads),
                                                dim=-1)
            i_pre, f_pre = torch.tensor_split(self.ifgate_preact(x), (self.num_heads,), dim=-1)
        cap = cfg.gate_soft_cap
        return q, k, v, o_pre, self.soft_cap(i_pre, cap_value=cap), self.soft_cap(f_pre, cap_value=cap)

    def forward(self, x: torch.Tensor, state=None):
        """x (B, T, D); state: (S (B, H, K, V + 1), m (B, H, 1)) or None -> (output, (S, m) after the last step)."""
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_k, self.head_v
        q, k, v, o_pre, i, f = self._projections(x)
        acc = torch.promote_types(x.dtype, torch.float32)
        q = self.hook_q(q.reshape(B, T, H, K).to(acc) * K ** -0.5)
        k = self.hook_k(k.reshape(B, T, H, K).to(acc))
        v = self.hook_v(v.reshape(B, T, H, V).to(acc))
        i, g = i.to(acc), self.hook_decay(F.logsigmoid(f.to(acc)))
        init, m0 = (None, torch.zeros(B, H, 1, dtype=acc, device=x.device)) if state is None else state
        # m_t = max(g_t + m_{t-1}, i_t) = G_t + max(m_0, max_{j<=t} (i_j - G_j)), G the running sum of g
        G = g.cumsum(1)
        m = G + torch.maximum(m0[:, None, :, 0].to(acc), torch.cummax(i - G, dim=1).values)        # (B, T, H)
        ones = torch.ones(B, T, H, 1, dtype=acc, device=x.device)
        o, S = self._recur(q, k, i.exp()[..., None] * torch.cat([v, ones], -1), g, None,
                           None if init is None else init.to(acc), self.state_positions, self.readout_scale)
        o = self.hook_head_out(o)
        h = o[..., :V] / (torch.maximum(o[..., V:].abs(), torch.ones_like(o[..., V:])) +
                          self.xcfg.eps * m.exp()[..., None])
        z = torch.sigmoid(o_pre) * self.multihead_norm(h.to(x.dtype)).reshape(B, T, -1)
        z = self.hook_z(z.reshape(B, T, H, V))
        return self.out_proj(z.reshape(B, T, -1)), (S, m[:, -1, :, None])


def to_transformers_state(S, m):
    """(S = [C | n] (B, H, K, V + 1), m (B, H, 1)) -> transformers' (C~, n~, m)."""
    scale = torch.exp(-m)[..., None]
    return (S[..., :-1] * scale).contiguous(), (S[..., -1] * scale[..., 0]).contiguous(), m.contiguous()


def from_transformers_state(c, n, m):
    scale = torch.exp(m)[..., None]
    return torch.cat([c * scale, (n * scale[..., 0])[..., None]], -1), m


class XLSTMBlock(BridgeBlock):
    """xLSTM's block: norm_mlstm, the mLSTM, residual; norm_ffn, the gated feed-forward (`ffn`), residual. transformers'
    model calls it with the layer's state triple and takes the new one back; the layer-by-layer protocol's runs
    read the state from the LayerCache view instead."""

    def forward(self, hidden_states, state=None, **kwargs):
        if self.recorded is not None:   # BridgedLM.embed_suffix records what each layer is called with: nothing
            self.recorded.append({})
            return hidden_states, state
        out, (S, m) = self._run(hidden_states, None if state is None else from_transformers_state(*state))
        return out, (None if S is None else to_transformers_state(S, m))

    def block_forward(self, hidden_states, cache=None, **kwargs):
        lc = None if cache is None else cache.lc
        state = None if lc is None or lc.state is None else (lc.state, lc.conv["m"])
        return self._run(hidden_states, state)[0]

    def _run(self, x, state):
        resid = self.hook_resid_pre(x)
        mixed, new_state = self.mixer(self.norm_mlstm(resid), state)
        resid = self.hook_resid_mid(resid + self.hook_mixer_out(mixed))
        return self.hook_resid_post(resid + self.hook_mlp_out(self.ffn(self.norm_ffn(resid)))), new_state


class XLSTMAdapter(BridgeAdapter):
    spec = SPEC
    order = 120
    model_types = ("xlstm",)
    linear_attr = "mlstm_layer"
    mixer_norm_attr, mlp_attr, mlp_norm_attr = "norm_mlstm", "ffn", "norm_ffn"
    final_norm_attr = "out_norm"
    short_conv = False
    dispatched = {}   # its native kernels are torch already

    def layer_types(self, text_config) -> list:
        return ["linear_attention"] * int(text_config.num_blocks)

    def decoder_layers(self, text_model):
        return text_model.blocks

    def cap_logits(self, hf_model, logits):
        return importlib.import_module(_MODELING).soft_cap(logits, hf_model.config.output_logit_soft_cap)

    def make_block(self, layer, layer_type: str):
        self.wrap_mixer(layer, self.linear_attr)
        return XLSTMBlock(layer, self.linear_attr, True, "pre", self.mixer_norm_attr, False, self.mlp_attr,
                          self.mlp_norm_attr)

    def to_hf_cache(self, blocks, cache, hf_config):
        """transformers' xLSTMCache holding the states, or None for a fresh run (its model makes one of the batch's
        size)."""
        if cache is None:
            return None
        xcache_cls = importlib.import_module(_MODELING).xLSTMCache
        first = cache.layers[0].state
        hf_cache = xcache_cls(hf_config, first.shape[0], dtype=first.dtype, device=first.device)
        for i, lc in enumerate(cache.layers):
            hf_cache.rnn_state[i] = to_transformers_state(lc.state, lc.conv["m"])
        hf_cache.seqlen_offset += cache.seen_tokens
        return hf_cache

    def from_hf_cache(self, blocks, hf_cache, seen: int):
        from recurscope.interp.models.cache import LayerCache, RecurrentCache

        layers = []
        for i in range(len(blocks)):
            S, m = from_transformers_state(*hf_cache.rnn_state[i])
            layers.append(LayerCache("recurrent", state=S, conv={"m": m}))
        return RecurrentCache(layers, seen)


ADAPTER = XLSTMAdapter()
