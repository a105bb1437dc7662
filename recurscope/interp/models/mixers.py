"""Token mixers with fla 0.6.0's math and parameter names, each exposing the recurrence as named hook points.

Recurrent mixers (GLA, Gated DeltaNet, Gated DeltaNet-2/QED, Mamba-2) reduce to one call of `kernels.recurrence` with
their own (g, a, x); the hook points sit on exactly those inputs, on the states and on the readout.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformer_lens.hook_points import HookPoint

from recurscope import kernels
from recurscope.hooks.points import StateHookPoint, is_intercepted
from recurscope.interp.models.cache import LayerCache
from recurscope.interp.models.config import ModelConfig
from recurscope.interp.models.layers import GatedRMSNorm, RMSNorm, ShortConvolution, rotary


def _split_heads(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], -1, dim)


def _acc(t: torch.Tensor) -> torch.dtype:
    """The gates' dtype: at least float32, float64 in a float64 model."""
    return torch.promote_types(t.dtype, torch.float32)


def _repeat_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, T, H*groups, D), head h serving heads h*groups .. h*groups+groups-1."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)


def _readout(S: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * S^T q at one step: S (B, H, K, V), q (B, H_q, K) with H_q = m H query heads (query groups; m = 1
    otherwise), query head h m + j reading state h, or q (B, H_k, K) with H = n H_k (grouped value heads: value head
    h reads key head h // n). Returns (B, max(H, H_q), V) in S's dtype."""
    H, Hq = S.shape[1], q.shape[1]
    if Hq < H:
        q, Hq = q.repeat_interleave(H // Hq, dim=1), H
    o = torch.einsum("bhkv,bhjk->bhjv", S, q.to(S.dtype).unflatten(1, (H, Hq // H)))
    return scale * o.flatten(1, 2)


class RecurrentMixer(nn.Module):
    """Shared plumbing: hook points, write patches, state patches that carry forward, output norm and o_proj.

    The contract of a family's mixer (docs/adding_a_family.md), which the decoder relies on and nothing else:
    - `__init__(cfg, layer)`: built from the ModelConfig and its layer index (`self.layer`), e.g. to seed per-layer
      constants; it calls `super().__init__(layer)` and deletes the hook points its family lacks;
    - `forward(h, layer_cache, state_positions) -> (out, LayerCache)`: computes q, k, x, g, a through their hook
      points, runs `self._recur(...)` and returns `self._finish(o, gate, ...)`;
    - `o_norm`, the per-head output norm, applied as o_norm(o, gate) when `forward` passes a gate and o_norm(o)
      when it passes None, and `o_proj`, the output projection.

    Two class attributes tell readers of the hooks (interp.attribution) the kernel a mixer runs: `readout_scale`,
    the scale of o_t = scale S_t^T q_t (None: head_k ** -0.5), and `low_rank_transition`, True where the transition
    is "decay plus low-rank" (kernels.recurrence_low_rank, b = hook_erase * hook_erase_gate) rather than
    (I - k a^T) Diag(exp g).
    """

    readout_scale: Optional[float] = None
    low_rank_transition: bool = False

    def __init__(self, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.backend = "auto"
        self.check_finite = False            # the model's debug flag (RecurrentLM.debug) sets it
        # False when a caller needs only the outputs (the head scan's suffix rows): the kernel then skips the last
        # state update and the layer cache carries state None.
        self.keep_final_state = True
        # Packed sequences for one call (set by the model around it, RecurrentLM.forward(cu_seqlens=...)): the
        # input is (1, T, ·) holding sequences at these offsets; the conv, the kernel and state patches keep to them.
        self.cu_seqlens: Optional[list] = None
        self.hook_q = HookPoint()            # (B, T, H, K) after conv, activation and norm
        self.hook_k = HookPoint()            # (B, T, H, K)
        self.hook_v = HookPoint()            # (B, T, H, V)
        self.hook_decay = HookPoint()        # g: (B, T, H) or (B, T, H, K), log decay
        self.hook_erase = HookPoint()        # a: (B, T, H, K); absent for GLA
        self.hook_write_key = HookPoint()    # u_t: (B, T, H, K), the write direction (k_t unless patched)
        self.hook_write_value = HookPoint()  # x_t: (B, T, H, V), so that W_t = u_t x_t^T
        self.hook_write_scale = HookPoint()  # (B, T, H), 1 unless patched; 0 blocks a write
        self.hook_state = StateHookPoint()   # S_t at requested positions: (B, P, H, K, V); .positions names them
        self.hook_head_out = HookPoint()     # o_t before norm and gate: (B, T, H, V)
        self.hook_z = HookPoint()            # after norm and gate, before o_proj: (B, T, H, V)

    # ---- the recurrence with its hooks ------------------------------------
    def _recur(self, q, k, x, g, a, init_state, state_positions, scale, b=None):
        """Applies the write/state hooks and runs the kernel; returns (o, final_state). With b (the erase direction
        of a "decay plus low-rank" transition, RWKV-7) the kernel is `kernels.recurrence_low_rank`, a its read
        direction: S_t = (Diag(exp g) - b a^T) S_{t-1} + k x^T.

        The hook points fire on every call that something intercepts them (hooks.is_intercepted: TransformerLens
        hooks, nnsight's forward replacement, whose edits may be in place), and only then is a point's output
        compared with its input to find what changed: a forward without hooks makes no host sync here.

        With autograd on (grad mode, and an input that requires grad), an intercepted write or state point's output
        is what the recurrence reads even where it equals its input, so that its gradient is the loss's gradient
        with respect to that quantity: backward hooks fire and `retain_grad` works (docs/gradients.md).
        """
        B, T, H = x.shape[:3]              # state heads; q may hold a multiple of them (query groups)
        scale_dtype = _acc(q)   # write scales in at least float32, float64 in a float64 model
        u, ws = k, None
        if is_intercepted(self.hook_write_key):
            u = self.hook_write_key(k.clone())
        else:
            self.hook_write_key(k)
        x = self.hook_write_value(x)
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, u, x, g, a, b, init_state))
        if is_intercepted(self.hook_write_scale):
            ones = torch.ones(B, T, H, dtype=scale_dtype, device=q.device)
            # Under autograd the ones take part in the graph (a non-leaf, so that in-place edits stay allowed).
            ws = self.hook_write_scale(ones.requires_grad_().clone() if grad else ones)
            if not grad and bool((ws == 1).all()):
                ws = None
        extra = None
        if u is not k and (grad or not torch.equal(u, k)):
            # A patched write key must not move the erase: block the k x^T write and add u x^T instead. Under
            # autograd this holds for an unchanged key too, so that the write's gradient reaches u, the erase's k.
            extra = (u, x if ws is None else x * ws[..., None].to(x.dtype))
            ws = torch.zeros(B, T, H, dtype=scale_dtype, device=q.device)

        def kernel(sl, *args, **kw):
            if b is None:
                return kernels.recurrence(*args, **kw)
            return kernels.recurrence_low_rank(*args, b[:, sl], **kw)

        cu = self.cu_seqlens
        if cu is not None and b is not None:
            raise ValueError("packed sequences (cu_seqlens) are not supported by the decay-plus-low-rank kernel "
                             "(RWKV-7); run its sequences one by one")
        run = lambda sl, init, cap=None, final=True, cu=None: kernel(  # noqa: E731
            sl, q[:, sl], k[:, sl], x[:, sl], g[:, sl], None if a is None else a[:, sl], scale=scale,
            initial_state=init, write_scale=None if ws is None else ws[:, sl],
            extra_write=None if extra is None else (extra[0][:, sl], extra[1][:, sl]),
            capture=cap, output_final_state=final, backend=self.backend, check_finite=self.check_finite,
            **({} if cu is None else {"cu_seqlens": cu}))
        positions = None if state_positions is None else sorted({int(p) for p in state_positions})
        if positions is not None and any(p < 0 or p >= T for p in positions):
            raise ValueError(f"state_positions must lie in [0, {T - 1}] for a call of {T} tokens, got {positions}")
        if not positions:
            out = run(slice(0, T), init_state, final=self.keep_final_state, cu=cu)
            return out.o, out.final_state
        out = run(slice(0, T), init_state, positions, cu=cu)
        states = out.states
        # The hook names the positions its (B, P, ...) input holds, so a patch finds its own step.
        self.hook_state.positions = tuple(positions)
        try:
            if not is_intercepted(self.hook_state):
                self.hook_state(states)
                return out.o, out.final_state
            patched = self.hook_state(states.clone())
        finally:
            self.hook_state.positions = ()
        if patched.shape != states.shape:
            raise ValueError(f"a hook_state hook must return shape {tuple(states.shape)}, got {tuple(patched.shape)}")
        changed = (patched.to(states.dtype) != states).flatten(3).any(-1)   # (B, P, H)
        hit = [i for i, c in enumerate(changed.any(dim=(0, 2)).tolist()) if c]
        # Under autograd the recurrence continues from the hook's output at every captured position.
        tracked = grad and patched.requires_grad
        follow = list(range(len(positions))) if tracked else hit
        if not follow:
            return out.o, out.final_state
        return self._follow(out, states, patched, changed, follow, positions, tracked, run, q, scale, cu)

    @staticmethod
    def _follow(out, states, patched, changed, follow, positions, tracked, run, q, scale, cu=None):
        """Reruns the recurrence from each followed patch: the patch replaces the (batch, head) states it changes
        and the recurrence continues from there, so the change carries into every later step of its sequence.
        Unpacked, the batch is one sequence spanning all T steps; packed (cu_seqlens, B = 1), a patch at packed step
        p reruns from p to the end of p's own sequence only, and the sequences after it never see it. Returns the
        outputs and the final state (per sequence when packed)."""
        import bisect

        packed = cu is not None
        bounds = list(cu) if packed else [0, out.o.shape[1]]
        o = out.o.clone()
        final = out.final_state.clone() if packed else None
        S, prev, cur = None, None, None

        def close(prev, cur, S):
            hi = bounds[cur + 1]
            if prev + 1 < hi:
                seg = run(slice(prev + 1, hi), S)
                o[:, prev + 1:hi] = seg.o
                S = seg.final_state
            if packed:
                final[cur] = S[0]
            return S

        for i in follow:
            p = positions[i]
            seq = bisect.bisect_right(bounds, p) - 1
            if cur is not None and seq != cur:
                close(prev, cur, S)
                prev = None
            if prev is None:
                S = states[:, i]
            else:
                seg = run(slice(prev + 1, p + 1), S)
                o[:, prev + 1:p + 1] = seg.o
                S = seg.final_state
            mask = changed[:, i][..., None, None]
            new = patched[:, i].to(S.dtype)
            if tracked:
                # An unchanged entry keeps the carried value S and takes the gradient at the hook's output: the
                # hook receives dL/dS_p (through every later step, later captures included), and the cancelling
                # term stops that gradient from reaching the inputs a second time through the captured state.
                kept = states[:, i].to(S.dtype)
                S = S + (new - new.detach()) - (kept - kept.detach())
            S = torch.where(mask, new, S)
            o[:, p] = _readout(S, q[:, p], scale).to(o.dtype)
            prev, cur = p, seq
        S = close(prev, cur, S)
        return o, (final if packed else S)

    def _conv_or_act(self, name, proj_out, layer_cache, new_conv):
        conv = getattr(self, f"{name}_conv1d", None)
        if conv is None:
            return proj_out
        tail = None if layer_cache is None else layer_cache.conv.get(name)
        y, new_conv[name] = conv(proj_out, tail, self.cu_seqlens)
        return y

    def _finish(self, o, gate, layer_cache, new_state, new_conv):
        o = self.hook_head_out(o)
        z = self.hook_z(self.o_norm(o) if gate is None else self.o_norm(o, gate))
        out = self.o_proj(z.reshape(*z.shape[:2], -1))
        return out, LayerCache("recurrent", state=new_state, conv=new_conv)


class GLAMixer(RecurrentMixer):
    """Gated Linear Attention: g = logsigmoid(gk_proj x) / 16 per channel, no erase, x = v.

    With num_kv_heads < num_heads (GLA-7B) k, v and the gate have num_kv_heads heads and each of their states is read
    by `query_group` = num_heads / num_kv_heads consecutive query heads: the state hooks, the write hooks, hook_k,
    hook_v and hook_decay index the num_kv_heads state groups, hook_q, hook_head_out and hook_z the query heads
    (query head h m + j reads state group h). fla repeats k, v and the gate and keeps num_heads identical states;
    here the group's one state is the unit an intervention edits."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(layer)
        del self.hook_erase  # GLA has no erase term
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads or cfg.num_heads
        self.groups = self.query_group = self.num_heads // self.num_kv_heads
        key_dim, value_dim = int(round(d * cfg.expand_k)), int(round(d * cfg.expand_v))
        self.head_k, self.head_v = key_dim // cfg.num_heads, value_dim // cfg.num_heads
        kd, vd = key_dim // self.groups, value_dim // self.groups
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, kd, bias=False)
        self.v_proj = nn.Linear(d, vd, bias=False)
        if cfg.use_output_gate:
            self.g_proj = nn.Linear(d, value_dim, bias=False)
        if cfg.use_short_conv:
            self.q_conv1d = ShortConvolution(key_dim, cfg.conv_size, cfg.conv_bias)
            self.k_conv1d = ShortConvolution(kd, cfg.conv_size, cfg.conv_bias)
            self.v_conv1d = ShortConvolution(vd, cfg.conv_size, cfg.conv_bias)
        self.gk_proj = nn.Sequential(nn.Linear(d, cfg.gate_low_rank_dim, bias=False),
                                     nn.Linear(cfg.gate_low_rank_dim, kd, bias=True))
        self.o_proj = nn.Linear(value_dim, d, bias=False)
        self.use_output_gate = cfg.use_output_gate
        norm = GatedRMSNorm(self.head_v, cfg.norm_eps, "swish", cfg.elementwise_affine) if cfg.use_output_gate \
            else RMSNorm(self.head_v, cfg.norm_eps, cfg.elementwise_affine)
        # fla names the norm after whether it is fused with the gate.
        self.norm_name = "g_norm_swish_gate" if (cfg.fuse_norm and cfg.use_output_gate) else "g_norm"
        setattr(self, self.norm_name, norm)
        self.gate_logit_normalizer = cfg.gate_logit_normalizer
        self.clamp_min = cfg.clamp_min

    @property
    def o_norm(self) -> nn.Module:
        """The output norm, under fla's name for it (which says whether it is fused with the gate)."""
        return getattr(self, self.norm_name)

    def forward(self, h, layer_cache: Optional[LayerCache] = None, state_positions=None):
        new_conv = {}
        q = self._conv_or_act("q", self.q_proj(h), layer_cache, new_conv)
        k = self._conv_or_act("k", self.k_proj(h), layer_cache, new_conv)
        v = self._conv_or_act("v", self.v_proj(h), layer_cache, new_conv)
        gk = self.gk_proj(h)
        q = _split_heads(q, self.head_k)                 # num_heads query heads
        k = _split_heads(k, self.head_k)                 # num_kv_heads state groups, never repeated
        v = _split_heads(v, self.head_v)
        gk = _split_heads(gk, self.head_k)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        g = F.logsigmoid(gk.to(_acc(gk))) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            g = g.clamp_min(self.clamp_min)
        g = self.hook_decay(g)
        init = None if layer_cache is None else layer_cache.state
        o, S = self._recur(q, k, v, g, None, init, state_positions, self.head_k ** -0.5)
        gate = _split_heads(self.g_proj(h), self.head_v) if self.use_output_gate else None
        return self._finish(o, gate, layer_cache, S, new_conv)


class _DeltaBase(RecurrentMixer):
    """Shared by Gated DeltaNet and GDN-2: q/k/v projections with short conv + SiLU, L2-normalised q and k."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(layer)
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.num_v_heads = cfg.num_v_heads or cfg.num_heads
        self.groups = self.num_v_heads // self.num_heads
        self.head_k, self.head_v = cfg.head_dim, int(cfg.head_dim * cfg.expand_v)
        self.key_dim, self.value_dim = self.num_heads * self.head_k, self.num_v_heads * self.head_v
        self.q_proj = nn.Linear(d, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d, self.value_dim, bias=False)

    def _qkv(self, h, layer_cache, new_conv):
        if hasattr(self, "q_conv1d"):
            q = self._conv_or_act("q", self.q_proj(h), layer_cache, new_conv)
            k = self._conv_or_act("k", self.k_proj(h), layer_cache, new_conv)
            v = self._conv_or_act("v", self.v_proj(h), layer_cache, new_conv)
        else:
            q, k, v = F.silu(self.q_proj(h)), F.silu(self.k_proj(h)), F.silu(self.v_proj(h))
        q = _repeat_heads(kernels.l2_normalise(_split_heads(q, self.head_k)), self.groups)
        k = _repeat_heads(kernels.l2_normalise(_split_heads(k, self.head_k)), self.groups)
        v = _split_heads(v, self.head_v)
        return self.hook_q(q), self.hook_k(k), self.hook_v(v)

    def _convs(self, cfg):
        if cfg.use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, cfg.conv_size, cfg.conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, cfg.conv_size, cfg.conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, cfg.conv_size, cfg.conv_bias)


class GatedDeltaNetMixer(_DeltaBase):
    """Gated DeltaNet: g = -exp(A_log) softplus(a_proj x + dt_bias) per head, a = beta k, x = beta v."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(cfg, layer)
        d = cfg.hidden_size
        self.a_proj = nn.Linear(d, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(d, self.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(1, 16)))
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self._convs(cfg)
        self.use_gate = cfg.use_gate
        if cfg.use_gate:
            self.g_proj = nn.Linear(d, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v, cfg.norm_eps, cfg.output_gate_activation)
        else:
            self.o_norm = RMSNorm(self.head_v, cfg.norm_eps)
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)
        self.allow_neg_eigval = cfg.allow_neg_eigval

    def forward(self, h, layer_cache: Optional[LayerCache] = None, state_positions=None):
        new_conv = {}
        q, k, v = self._qkv(h, layer_cache, new_conv)
        acc = _acc(h)
        beta = torch.sigmoid(self.b_proj(h).to(acc))
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = self.hook_decay(-self.A_log.to(acc).exp() * F.softplus(self.a_proj(h).to(acc) + self.dt_bias))
        a = self.hook_erase(beta[..., None] * k.to(acc))
        x = beta[..., None] * v.to(acc)
        init = None if layer_cache is None else layer_cache.state
        o, S = self._recur(q, k, x, g, a, init, state_positions, self.head_k ** -0.5)
        gate = _split_heads(self.g_proj(h), self.head_v) if self.use_gate else None
        return self._finish(o.to(h.dtype), gate, layer_cache, S, new_conv)


def rand_arm_directions(layer: int, heads: int, dim: int) -> torch.Tensor:
    """The rand arm's fixed unit directions z, (heads, dim): head h of layer l draws from its own seed (l, h), so
    every layer and head gets its own z (the QED paper draws z per head)."""
    rows = [torch.randn(dim, generator=torch.Generator().manual_seed(RAND_Z_SEED + 1009 * int(layer) + h))
            for h in range(heads)]
    z = torch.stack(rows)
    return z / z.norm(dim=-1, keepdim=True)


RAND_Z_SEED = 20_260_813


class GatedDeltaNet2Mixer(_DeltaBase):
    """Gated DeltaNet-2 with an optional QED erase arm: per-channel decay, erase gate b in R^K, write gate w in R^V.

    a = kernels.erase_vector(k, q, b, lam, arm), lam_h = qed_lambda_max * sigmoid(theta_h) * strength.
    `layer` seeds the rand arm's fixed directions.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.hook_erase_gate = HookPoint()   # b: (B, T, H, K), the erase gate entering the erase vector
        d = cfg.hidden_size
        self._convs(cfg)
        self.f_proj = nn.Sequential(nn.Linear(d, self.head_v, bias=False), nn.Linear(self.head_v, self.key_dim, bias=False))
        self.b_proj = nn.Linear(d, self.key_dim, bias=False)
        self.w_proj = nn.Linear(d, self.value_dim, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_heads).uniform_(1, 16)))
        dt = torch.exp(torch.rand(self.key_dim) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.g_proj = nn.Sequential(nn.Linear(d, self.head_v, bias=False), nn.Linear(self.head_v, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(self.head_v, cfg.norm_eps, "sigmoid")
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)
        self.allow_neg_eigval = cfg.allow_neg_eigval
        self.erase_arm = cfg.erase_arm
        self.lambda_max = cfg.qed_lambda_max
        self.strength = 1.0  # inference-time scaling of every lam_h (QED paper, strength test)
        if self.erase_arm != "gdn2":
            self.qed_theta = nn.Parameter(torch.full((self.num_v_heads,), float(cfg.qed_theta_init)))
        if self.erase_arm == "rand":
            self.register_buffer("qed_z", rand_arm_directions(layer, self.num_v_heads, self.head_k))

    def qed_lambda(self) -> Optional[torch.Tensor]:
        """lam_h per state head, strength applied; None for the GDN-2 arm."""
        if self.erase_arm == "gdn2":
            return None
        return self.lambda_max * torch.sigmoid(self.qed_theta.to(_acc(self.qed_theta))) * self.strength

    def forward(self, h, layer_cache: Optional[LayerCache] = None, state_positions=None):
        new_conv = {}
        q, k, v = self._qkv(h, layer_cache, new_conv)
        acc = _acc(h)
        g = F.softplus(self.f_proj(h).to(acc) + self.dt_bias)
        g = _split_heads(g, self.head_k) * -self.A_log.to(acc).exp()[:, None]
        b = torch.sigmoid(_split_heads(self.b_proj(h).to(acc), self.head_k))
        w = torch.sigmoid(_split_heads(self.w_proj(h).to(acc), self.head_v))
        g, b = _repeat_heads(g, self.groups), _repeat_heads(b, self.groups)
        if self.allow_neg_eigval:
            b = b * 2.0
        b = self.hook_erase_gate(b)
        g = self.hook_decay(g)
        lam = self.qed_lambda()
        a = kernels.erase_vector(k.to(acc), q.to(acc), b, lam if lam is not None else torch.zeros(k.shape[2]),
                                 self.erase_arm, getattr(self, "qed_z", None))
        a = self.hook_erase(a)
        x = w * v.to(acc)
        init = None if layer_cache is None else layer_cache.state
        o, S = self._recur(q, k, x, g, a, init, state_positions, self.head_k ** -0.5)
        gate = _split_heads(self.g_proj(h), self.head_v)
        return self._finish(o.to(h.dtype), gate, layer_cache, S, new_conv)


@contextmanager
def qed_strength(model, s: float):
    """Multiplies every QED lam_h of `model` by s through prefill and decoding, then restores it (the QED paper's
    strength test): `with qed_strength(model, 0.5): ...`."""
    mixers = [m for m in model.modules() if isinstance(m, GatedDeltaNet2Mixer)]
    if not mixers or all(m.erase_arm == "gdn2" for m in mixers):
        raise ValueError("qed_strength needs a GDN-2 model with a QED erase arm (erase_arm other than 'gdn2')")
    old = [m.strength for m in mixers]
    try:
        for m in mixers:
            m.strength = float(s)
        yield model
    finally:
        for m, o in zip(mixers, old):
            m.strength = o


class Mamba2GatedNorm(nn.Module):
    """fla's RMSNormGated for Mamba-2: rmsnorm over groups of `group_size` channels (a group of heads, not one head)
    of y * silu(gate), times `weight` (norm_before_gate=False), or rmsnorm(y) * weight * silu(gate) (True).
    Takes and returns per-head tensors (B, T, H, P)."""

    def __init__(self, dim: int, eps: float, group_size: int, norm_before_gate: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate

    def forward(self, y, gate):
        shape = y.shape
        y, gate = y.reshape(*shape[:-2], -1).float(), gate.reshape(*shape[:-2], -1).float()
        if not self.norm_before_gate:
            y = y * F.silu(gate)
        grouped = y.reshape(*y.shape[:-1], -1, self.group_size)
        out = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(y.shape)
        out = out * self.weight.float()
        if self.norm_before_gate:
            out = out * F.silu(gate)
        return out.reshape(shape)


class _SiluGate(nn.Module):
    """Mamba-2 without its norm (rmsnorm=False): y * silu(gate)."""

    def forward(self, y, gate):
        return y * F.silu(gate)


class Mamba2Mixer(RecurrentMixer):
    """Mamba-2's SSD layer (fla's `Mamba2`, parameter names kept): one in_proj gives the gate z, the conv input
    (x, B, C) and dt; after the short conv and SiLU, per head h of group g = h // (H / n_groups):

        S_t = exp(dt_t A_h) S_{t-1} + B_t (dt_t x_t)^T,    y_t = S_t^T C_t + D_h x_t

    i.e. the kernel with q = C, k = B (shared by a group's heads), x = dt x, g = dt A per head, no erase, scale 1.
    The state of a head is N x P (state_size x head_dim), key side first: fla's cache holds its transpose (P x N).
    hook_head_out holds the state readout S_t^T C_t alone; the D skip is added after it, then the gated norm
    (hook_z). Heads are grouped contiguously (head h reads group h // (H / n_groups)), as fla's decode path,
    mamba_ssm and the gated norm's groups do.
    """

    readout_scale = 1.0

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(layer)
        del self.hook_erase                  # no erase term
        from recurscope.interp.models.families import dt_limit_pair

        d = cfg.hidden_size
        self.num_heads, self.n_groups = cfg.num_heads, cfg.n_groups
        self.head_k, self.head_v = cfg.state_size, cfg.head_dim        # the state is N x P
        self.intermediate = int(cfg.expand * d)
        self.conv_dim = self.intermediate + 2 * self.n_groups * self.head_k
        self.in_proj = nn.Linear(d, self.intermediate + self.conv_dim + self.num_heads, bias=cfg.use_bias)
        self.conv1d = ShortConvolution(self.conv_dim, cfg.conv_kernel, cfg.use_conv_bias)   # SiLU after the conv
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_heads).uniform_(*cfg.A_init_range)))
        self.D = nn.Parameter(torch.ones(self.intermediate if cfg.D_has_hdim else self.num_heads))
        if cfg.rmsnorm:
            self.norm = Mamba2GatedNorm(self.intermediate, cfg.norm_eps, self.intermediate // self.n_groups,
                                        cfg.norm_before_gate)
        self.out_proj = nn.Linear(self.intermediate, d, bias=cfg.use_bias)
        self.dt_limit = dt_limit_pair(cfg.dt_limit)
        dt = torch.exp(torch.rand(self.num_heads) * (math.log(cfg.dt_max) - math.log(cfg.dt_min)) + math.log(cfg.dt_min))
        dt = dt.clamp(min=cfg.dt_init_floor)
        with torch.no_grad():
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))      # softplus^-1 of dt, as fla initialises

    @property
    def o_norm(self) -> nn.Module:
        norm = getattr(self, "norm", None)
        return _SiluGate() if norm is None else norm

    @property
    def o_proj(self) -> nn.Module:
        return self.out_proj

    def _group_to_heads(self, t):
        """(B, T, G * N) -> (B, T, H, N), head h reading group h // (H / G)."""
        return _repeat_heads(_split_heads(t, self.head_k), self.num_heads // self.n_groups)

    def forward(self, h, layer_cache: Optional[LayerCache] = None, state_positions=None):
        new_conv = {}
        gate, xBC, dt = self.in_proj(h).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1)
        tail = None if layer_cache is None else layer_cache.conv.get("conv1d")
        xBC, new_conv["conv1d"] = self.conv1d(xBC, tail, self.cu_seqlens)
        xs, Bm, Cm = xBC.split([self.intermediate, self.n_groups * self.head_k, self.n_groups * self.head_k], dim=-1)
        q = self.hook_q(self._group_to_heads(Cm))
        k = self.hook_k(self._group_to_heads(Bm))
        v = self.hook_v(_split_heads(xs, self.head_v))
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)          # (B, T, H)
        g = self.hook_decay(dt * -self.A_log.float().exp())
        init = None if layer_cache is None else layer_cache.state
        o, S = self._recur(q, k, dt[..., None] * v.float(), g, None, init, state_positions, self.readout_scale)
        o = self.hook_head_out(o)
        D = self.D.float().reshape(self.num_heads, -1)                                    # (H, 1) or (H, P)
        y = o + D * v.float()                                                             # the D skip
        z = self.hook_z(self.o_norm(y, _split_heads(gate, self.head_v)).to(h.dtype))
        out = self.out_proj(z.reshape(*z.shape[:2], -1))
        return out, LayerCache("recurrent", state=S, conv=new_conv)


def grouped_scores(qg: torch.Tensor, k: torch.Tensor, past_k: Optional[torch.Tensor] = None,
                   shared: bool = False) -> torch.Tensor:
    """Attention scores of queries grouped by their KV head, qg (B, Hkv, G T, D) (query head h = kv G + g), against
    the cached keys past_k (B, Hkv, P, D), first, and the new keys k (B, Hkv, S, D) -> (B, Hkv, G T, P + S), unscaled.
    No key is repeated per query head. shared: past_k's rows are views of one row (the head scan's rows continuing one
    cached row), so every row's queries meet it in one product per KV head and the cache is read once."""
    scores = qg @ k.transpose(-1, -2)
    if past_k is None:
        return scores
    if shared:
        B, Hkv, M, D = qg.shape
        old = (qg.transpose(0, 1).reshape(Hkv, B * M, D) @ past_k[0].transpose(-1, -2)).view(Hkv, B, M, -1)
        old = old.transpose(0, 1)
    else:
        old = qg @ past_k.transpose(-1, -2)
    return torch.cat([old, scores], dim=-1)


def grouped_values(pg: torch.Tensor, v: torch.Tensor, past_v: Optional[torch.Tensor] = None,
                   shared: bool = False) -> torch.Tensor:
    """The weighted values of grouped_scores' pattern pg (B, Hkv, G T, P + S), cached values past_v (B, Hkv, P, Dv)
    first, new values v (B, Hkv, S, Dv) -> (B, Hkv, G T, Dv); shared as in grouped_scores."""
    P = 0 if past_v is None else past_v.shape[-2]
    o = pg[..., P:] @ v
    if past_v is None:
        return o
    if shared:
        B, Hkv, M, _ = pg.shape
        po = pg[..., :P].transpose(0, 1).reshape(Hkv, B * M, P) @ past_v[0]
        return o + po.view(Hkv, B, M, -1).transpose(0, 1)
    return o + pg[..., :P] @ past_v


class AttentionMixer(nn.Module):
    """Causal softmax attention with RoPE, grouped KV heads, an optional sliding window and a KV cache."""

    def __init__(self, cfg: ModelConfig, spec: dict):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.num_kv_heads = spec["num_heads"], spec["num_kv_heads"]
        self.head_dim = d // self.num_heads
        self.window_size, self.rope_theta = spec["window_size"], spec["rope_theta"]
        bias = spec["qkv_bias"]
        self.q_proj = nn.Linear(d, d, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.hook_q = HookPoint()         # (B, T, H, D) after RoPE
        self.hook_k = HookPoint()         # (B, T, Hkv, D) after RoPE, new tokens only
        self.hook_v = HookPoint()         # (B, T, Hkv, D)
        self.hook_pattern = HookPoint()   # (B, H, Tq, Tk) softmax weights
        self.hook_head_out = HookPoint()  # (B, T, H, D) before o_proj
        # False when a caller needs only the outputs (the head scan's suffix rows): the layer cache then carries no
        # keys or values, which saves concatenating the cache with the new ones.
        self.keep_final_state = True
        self.cu_seqlens: Optional[list] = None   # packed sequences for one call (set by the model around it)

    def forward(self, h, layer_cache: Optional[LayerCache] = None, state_positions=None, offset=0):
        """offset: the cache's length (an int), or (B,) each row's own length when the rows continue caches of
        different lengths (their K/V left-padded to the longest, RecurrentCache.lengths). With `cu_seqlens` set,
        h (1, T, D) holds packed sequences: positions restart at each, and each attends within itself only."""
        B, T, _ = h.shape
        cu = self.cu_seqlens
        if cu is not None:
            from recurscope.interp.models.layers import sequence_starts

            if layer_cache is not None and layer_cache.keys is not None:
                raise ValueError("packed sequences (cu_seqlens) start from no cache; run them without one")
            start = sequence_starts(cu, T, h.device)
            offset = (torch.arange(T, device=h.device) - start)[None]       # (1, T): positions restart
        q = rotary(_split_heads(self.q_proj(h), self.head_dim), offset, self.rope_theta)
        k = rotary(_split_heads(self.k_proj(h), self.head_dim), offset, self.rope_theta)
        v = _split_heads(self.v_proj(h), self.head_dim)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        past = layer_cache is not None and layer_cache.keys is not None
        if cu is not None and not is_intercepted(self.hook_pattern):
            # packed sequences, no hook on the pattern: each sequence's own causal attention, so the work is the
            # sum of the squared lengths (the block-diagonal pattern of the whole row is formed only for a hook)
            o = torch.cat([self._attend(h, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], None, 0)
                           for lo, hi in zip(cu[:-1], cu[1:]) if hi > lo], dim=1)
        else:
            same = None if cu is None else start[None, :] == start[:, None]
            o = self._attend(h, q, k, v, layer_cache if past else None, offset, same)
        o = self.hook_head_out(o)
        out = self.o_proj(o.reshape(B, T, -1))
        if not self.keep_final_state:
            return out, LayerCache("attention")
        if past:
            k = torch.cat([layer_cache.keys, k], dim=1)
            v = torch.cat([layer_cache.values, v], dim=1)
        return out, LayerCache("attention", keys=k, values=v)

    def _attend(self, h, q, k, v, layer_cache: Optional[LayerCache], offset, same=None) -> torch.Tensor:
        """Softmax attention of q (B, T, H, D) over the cached keys (layer_cache, or None) and k, v (B, T, Hkv, D)
        -> (B, T, H, D) in h's dtype, the pattern through hook_pattern. same (T, T): which packed positions share
        a sequence (block-diagonal); a tensor offset with a cache: rows' lengths, their padded slots masked."""
        B, T = q.shape[:2]
        past = layer_cache is not None
        P = layer_cache.keys.shape[1] if past else 0
        Tk, H, Hkv, D = P + T, self.num_heads, self.num_kv_heads, self.head_dim
        G = H // Hkv
        acc = torch.promote_types(h.dtype, torch.float32)
        # Queries grouped by their KV head (grouped_scores): the cache is scored apart, never concatenated.
        qg = q.to(acc).reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        # Every row continuing one cached row as a batch-expanded view (the head scan's growing batch) is read once.
        shared = past and B > 1 and layer_cache.keys.stride(0) == 0 and layer_cache.values.stride(0) == 0
        rows = slice(0, 1) if shared else slice(None)          # a shared cache is converted for its one row only
        pk = layer_cache.keys[rows].to(acc).transpose(1, 2) if past else None      # (B or 1, Hkv, P, D)
        pv = layer_cache.values[rows].to(acc).transpose(1, 2) if past else None
        scores = grouped_scores(qg, k.to(acc).transpose(1, 2), pk, shared)
        scores = scores.view(B, H, T, Tk) * D ** -0.5
        qpos = torch.arange(P, Tk, device=h.device)[:, None]
        kpos = torch.arange(Tk, device=h.device)[None, :]
        allowed = kpos <= qpos
        if self.window_size is not None:
            allowed = allowed & (kpos > qpos - self.window_size)
        if same is not None:                    # block-diagonal: each packed sequence attends within itself
            allowed = allowed & same
        elif isinstance(offset, torch.Tensor) and past:
            # rows whose caches are shorter than P: their first P - length slots are padding, never attended
            pad = P - offset.to(h.device).reshape(-1)                      # (B,)
            allowed = allowed[None, None] & (kpos[None, None] >= pad[:, None, None, None])
        scores = scores.masked_fill(~allowed, float("-inf"))
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        o = grouped_values(pattern.reshape(B, Hkv, G * T, Tk), v.to(acc).transpose(1, 2), pv, shared)
        return o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D).to(h.dtype)
