"""Exact per-token readout attribution for one recurrent head: o_t split into what each token's write contributes,
computed with one backward (adjoint) sweep over the key side of the recurrence (How Linear Attention Remembers,
Sec. 2.1).

The recurrence (kernels/__init__.py) is, for one head, with states S in R^{K x V}:

    S_t = M_t S_{t-1} + W_t,    M_t = (I - k_t a_t^T) Diag(exp g_t)   (a = None: M_t = Diag(exp g_t), e.g. GLA)
    W_t = write_scale_t u_t x_t^T (+ u'_t y_t^T for an extra write),  u_t = k_t unless the write key is patched
    o_t = scale * S_t^T q_t

Unrolling, S_t = M_t...M_1 S_0 + sum_{i<=t} C_i^(t) with C_i^(t) = M_t...M_{i+1} W_i, so

    o_t = scale * S_0^T lam_{-1} + sum_i c_i,   c_i = scale * W_i^T lam_i = scale * write_scale_i (u_i^T lam_i) x_i,
    lam_t = q_t,   lam_{i-1} = M_i^T lam_i = Diag(exp g_i) (lam_i - a_i (k_i^T lam_i)).

Every M_i acts on the key dimension only, so the adjoint covector lam_i lives in R^K and the sweep costs O(t K) per
head; nothing is rerun per token. The "decay plus low-rank" form (kernels.recurrence_low_rank, RWKV-7), with
M_t = Diag(exp g_t) - b_t a_t^T, has lam_{i-1} = Diag(exp g_i) lam_i - a_i (b_i^T lam_i) instead. (Positions are
0-based here; S_0 above is the state before position 0.)

Caveat (read before using the numbers). The decomposition is exact along ONE fixed forward trajectory: the M_i are
those of this run. It is not identifiable from the state: adding a matrix E to C_i^(t) and subtracting it from C_j^(t)
leaves S_t, and every readout, unchanged, so "token i's share of the state" has no meaning beyond this sum. And an
intervention on token i changes the hidden states after i, hence later k, a, g, q and the transforms themselves, so the
causal effect of a token must be measured by rerunning the model with the intervention (interp.interventions), not by
subtracting c_i from o_t. See docs/attribution.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import pandas as pd
import torch

from recurscope.hooks.points import hook_name

__all__ = ["Contributions", "readout_contributions", "attribute_readout", "candidate_direction"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class Contributions:
    """The exact split of one head's readout o_t (all tensors in `dtype`, on the inputs' device).

    per_token: (t+1, V), row i = c_i, token i's contribution to o_t (the extra write's share included).
    initial: (V,), the initial state's carried term scale * S_0^T lam_{-1} (zeros when S_0 is None).
    coefficients: (t+1,), scale * write_scale_i * (u_i^T lam_i): c_i = coefficients_i * x_i without an extra write.
    adjoint: (t+1, K), row i = lam_i = M_{i+1}^T ... M_t^T q_t, the covector that reads a write made at i.
    adjoint_initial: (K,), lam_{-1}, which reads the initial state.
    """

    t: int
    scale: float
    per_token: torch.Tensor
    initial: torch.Tensor
    coefficients: torch.Tensor
    adjoint: torch.Tensor
    adjoint_initial: torch.Tensor

    def total(self) -> torch.Tensor:
        """sum_i c_i + initial: equals o_t of the same run (up to rounding)."""
        return self.per_token.sum(0) + self.initial


# ---------------------------------------------------------------------------------------------------------------
# Input handling
# ---------------------------------------------------------------------------------------------------------------


def _shape(t) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")


def _pick_head(name: str, t: Optional[torch.Tensor], batch: int, head: int, rank: int):
    """(B, T, H, ...) -> (T, ...) for one (batch, head); None passes through."""
    if t is None:
        return None
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} in batched (B, T, H, ...) form like q, got shape {_shape(t)}")
    return t[batch, :, head]


def _select(q, k, x, g, a, initial_state, write_scale, write_key, extra_write, batch, head):
    """Brings batched (B, T, H, .) inputs down to one head's (T, .) inputs; per-head inputs pass unchanged."""
    _check_tensor("q", q)
    if q.dim() == 2:
        if head is not None or batch is not None:
            raise ValueError(f"q has per-head shape (T, K) = {_shape(q)}, so pass no head/batch; they select from "
                             f"batched (B, T, H, K) inputs")
        return q, k, x, g, a, initial_state, write_scale, write_key, extra_write
    if q.dim() != 4:
        raise ValueError(f"q must have shape (T, K) for one head or (B, T, H, K) batched, got {_shape(q)}")
    B, T, H, K = q.shape
    if head is None:
        raise ValueError(f"q is batched with shape (B, T, H, K) = {_shape(q)}: pass head=h with 0 <= h < {H}")
    if not 0 <= int(head) < H:
        raise ValueError(f"head {head} is out of range: the inputs have heads 0..{H - 1} (q shape {_shape(q)})")
    if batch is None:
        if B != 1:
            raise ValueError(f"q has batch size B = {B}: pass batch=b with 0 <= b < {B} to choose the sequence")
        batch = 0
    if not 0 <= int(batch) < B:
        raise ValueError(f"batch {batch} is out of range: the inputs have batch entries 0..{B - 1}")
    batch, head = int(batch), int(head)
    for name, t in (("k", k), ("x", x), ("a", a), ("write_key", write_key)):
        if t is not None:
            _check_tensor(name, t)
            if t.dim() != 4 or tuple(t.shape[:3]) != (B, T, H):
                raise ValueError(f"{name} must have shape (B, T, H, .) = ({B}, {T}, {H}, .), got {_shape(t)}")
    _check_tensor("g", g)
    if g.dim() not in (3, 4) or tuple(g.shape[:3]) != (B, T, H):
        raise ValueError(f"g must have shape (B, T, H) or (B, T, H, K) = ({B}, {T}, {H}[, {K}]), got {_shape(g)}")
    if write_scale is not None:
        _check_tensor("write_scale", write_scale)
        if tuple(write_scale.shape) != (B, T, H):
            raise ValueError(f"write_scale must have shape (B, T, H) = ({B}, {T}, {H}), got {_shape(write_scale)}")
    sel = lambda n, t, r: _pick_head(n, t, batch, head, r)  # noqa: E731
    q1, k1, x1 = sel("q", q, 4), sel("k", k, 4), sel("x", x, 4)
    g1 = sel("g", g, g.dim())
    a1, u1 = sel("a", a, 4), sel("write_key", write_key, 4)
    ws1 = sel("write_scale", write_scale, 3)
    s1 = None
    if initial_state is not None:
        _check_tensor("initial_state", initial_state)
        if initial_state.dim() != 4 or tuple(initial_state.shape[:2]) != (B, H):
            raise ValueError(f"initial_state must have shape (B, H, K, V) = ({B}, {H}, {K}, V), got "
                             f"{_shape(initial_state)}")
        s1 = initial_state[batch, head]
    e1 = None
    if extra_write is not None:
        if not isinstance(extra_write, (tuple, list)) or len(extra_write) != 2:
            raise ValueError("extra_write must be a pair (u, y) as in kernels.recurrence")
        e1 = (sel("extra_write[0]", extra_write[0], 4), sel("extra_write[1]", extra_write[1], 4))
    return q1, k1, x1, g1, a1, s1, ws1, u1, e1


def _validate_head(q, k, x, g, a, initial_state, write_scale, write_key, extra_write, t):
    """Shape checks for one head's (T, .) inputs; returns (T, K, V, position)."""
    T, K = q.shape
    for name, tt in (("k", k), ("x", x), ("g", g)):
        _check_tensor(name, tt)
    if tuple(k.shape) != (T, K):
        raise ValueError(f"k must have shape (T, K) = ({T}, {K}) like q, got {_shape(k)}")
    if x.dim() != 2 or x.shape[0] != T:
        raise ValueError(f"x must have shape (T, V) = ({T}, V), got {_shape(x)}")
    V = x.shape[1]
    if tuple(g.shape) not in ((T,), (T, K)):
        raise ValueError(f"g must have shape (T,) for a per-head decay or (T, K) = ({T}, {K}) per channel, "
                         f"got {_shape(g)}")
    for name, tt in (("a", a), ("write_key", write_key)):
        if tt is not None:
            _check_tensor(name, tt)
            if tuple(tt.shape) != (T, K):
                raise ValueError(f"{name} must have shape (T, K) = ({T}, {K}), got {_shape(tt)}")
    if write_scale is not None:
        _check_tensor("write_scale", write_scale)
        if tuple(write_scale.shape) != (T,):
            raise ValueError(f"write_scale must have shape (T,) = ({T},), got {_shape(write_scale)}")
    if initial_state is not None and tuple(initial_state.shape) != (K, V):
        raise ValueError(f"initial_state must have shape (K, V) = ({K}, {V}), got {_shape(initial_state)}")
    if extra_write is not None:
        if not isinstance(extra_write, (tuple, list)) or len(extra_write) != 2:
            raise ValueError("extra_write must be a pair (u, y) as in kernels.recurrence")
        u2, y2 = extra_write
        _check_tensor("extra_write[0]", u2)
        _check_tensor("extra_write[1]", y2)
        if tuple(u2.shape) != (T, K) or tuple(y2.shape) != (T, V):
            raise ValueError(f"extra_write must be (u, y) with shapes (T, K) = ({T}, {K}) and (T, V) = ({T}, {V}), "
                             f"got {_shape(u2)} and {_shape(y2)}")
    if isinstance(t, bool) or not isinstance(t, int):
        try:
            t = int(t)
        except (TypeError, ValueError):
            raise ValueError(f"t must be an integer position, got {t!r}") from None
    if not 0 <= t < T:
        raise ValueError(f"t = {t} is out of range: the sequence has positions 0..{T - 1}; pass 0 <= t < {T}")
    return T, K, V, t


# ---------------------------------------------------------------------------------------------------------------
# The adjoint sweep
# ---------------------------------------------------------------------------------------------------------------


def readout_contributions(
    q, k, x, g, a=None, *, t: int, scale: Optional[float] = None, initial_state=None, write_scale=None,
    write_key=None, extra_write=None, head: Optional[int] = None, batch: Optional[int] = None,
    dtype: torch.dtype = torch.float64, b=None,
) -> Contributions:
    """Splits o_t = scale * S_t^T q_t of one head into per-token contributions c_0..c_t and the initial-state term.

    Inputs follow kernels.recurrence's contract, for one head: q, k (T, K); x (T, V); g (T,) or (T, K); a (T, K) or
    None; initial_state (K, V); write_scale (T,); write_key u (T, K), the write direction when it differs from k
    (the model's hook_write_key patch: the erase keeps k, the write becomes u x^T); extra_write (u', y) with shapes
    (T, K), (T, V). Or pass kernels.recurrence's batched shapes (B, T, H, .), initial_state (B, H, K, V) and
    write_scale (B, T, H), with head=h (and batch=b when B > 1) choosing the sequence and head.
    t: the 0-based readout position. scale defaults to K ** -0.5, as in kernels.recurrence. All work is in `dtype`.
    b: the erase direction of kernels.recurrence_low_rank's transition Diag(exp g) - b a^T (shaped like a, which is
    then its read direction); None for kernels.recurrence's (I - k a^T) Diag(exp g).
    """
    if b is not None and a is None:
        raise ValueError("b (the low-rank transition's erase direction) needs a, its read direction")
    if b is not None:
        _check_tensor("b", b)
        if tuple(b.shape) != tuple(a.shape):
            raise ValueError(f"b must have a's shape {_shape(a)}, got {_shape(b)}")
        if b.dim() == 4:
            b = _pick_head("b", b, 0 if batch is None else int(batch), 0 if head is None else int(head), 4)
    q, k, x, g, a, initial_state, write_scale, write_key, extra_write = _select(
        q, k, x, g, a, initial_state, write_scale, write_key, extra_write, batch, head)
    T, K, V, t = _validate_head(q, k, x, g, a, initial_state, write_scale, write_key, extra_write, t)
    scale = K ** -0.5 if scale is None else float(scale)
    f = lambda z: None if z is None else z.to(dtype)  # noqa: E731
    q, k, x, g, a, b, write_scale, write_key = map(f, (q, k, x, g, a, b, write_scale, write_key))
    u = k if write_key is None else write_key
    u2, y2 = (None, None) if extra_write is None else map(f, extra_write)
    decay = g.exp()
    if decay.dim() == 1:
        decay = decay[:, None].expand(T, K)

    adjoint = q.new_empty(t + 1, K)
    lam = q[t]
    for i in range(t, -1, -1):
        adjoint[i] = lam
        if b is not None:
            # M_i = D_i - b_i a_i^T, so M_i^T lam = D_i lam - a_i (b_i^T lam).
            lam = decay[i] * lam - a[i] * (b[i] @ lam)
            continue
        # lam_{i-1} = M_i^T lam_i with M_i = (I - k_i a_i^T) D_i, so M_i^T = D_i (I - a_i k_i^T).
        if a is not None:
            lam = lam - a[i] * (k[i] @ lam)
        lam = decay[i] * lam
    adjoint_initial = lam

    coefficients = scale * (u[: t + 1] * adjoint).sum(-1)
    if write_scale is not None:
        coefficients = coefficients * write_scale[: t + 1]
    per_token = coefficients[:, None] * x[: t + 1]
    if u2 is not None:
        per_token = per_token + scale * (u2[: t + 1] * adjoint).sum(-1)[:, None] * y2[: t + 1]
    if initial_state is None:
        initial = q.new_zeros(V)
    else:
        initial = scale * initial_state.to(dtype).T @ adjoint_initial
    return Contributions(t, scale, per_token, initial, coefficients, adjoint, adjoint_initial)


# ---------------------------------------------------------------------------------------------------------------
# Through a model
# ---------------------------------------------------------------------------------------------------------------

_MIXER_POINTS = ("hook_q", "hook_k", "hook_v", "hook_decay", "hook_erase", "hook_erase_gate", "hook_write_key",
                 "hook_write_value", "hook_write_scale", "hook_head_out", "hook_z")


def _norm_gate_map(model, cache, layer: int, head: int, position: int, batch: int):
    """The frozen output path of a family whose hook_z is norm(o) * act(gate) (its spec's readout_norm and
    readout_gate): z = s * o with s = norm weight * act(gate) / rms(o_t)."""
    mixer = model.blocks[layer].mixer
    spec = model.family
    o_t = cache[hook_name("hook_head_out", layer)][batch, position, head].double()
    norm = spec.readout_norm(mixer)
    s = torch.rsqrt(o_t.pow(2).mean() + norm.eps).expand(o_t.shape[0]).clone()
    if norm.weight is not None:
        s = s * norm.weight.double()
    resid_pre = cache[hook_name("hook_resid_pre", layer)][batch, position]
    gate = spec.readout_gate(mixer, model.blocks[layer].attn_norm(resid_pre))
    if gate is not None:
        s = s * norm.act(gate[head].double())
    return s, torch.zeros_like(s), False


def _bridged_map(model, cache, layer: int, head: int, position: int, batch: int):
    """A bridged transformers mixer: hook_z = c * (o + D x), c per channel once the gated norm's rms is frozen
    (weight * act(gate) / rms over the head, or over the group of heads that Mamba-2's norm spans), D x Mamba-2's
    skip (none in the other families). c is read off this run as hook_z / (o + D x), which the gated norms' diagonal
    form makes exact; tests/interp/test_bridge*.py check it against hand computations from the models' own gates."""
    mixer = model.blocks[layer].mixer
    o = cache[hook_name("hook_head_out", layer)][batch, position, head].double()
    if o.shape[-1] != cache[hook_name("hook_z", layer)].shape[-1]:
        raise ValueError(f"layer {layer}: hook_z is no per-channel scale of hook_head_out here ({model.family.name} "
                         f"divides its readout by a normaliser), so candidate_direction cannot freeze it; pass an "
                         f"explicit direction")
    skip = torch.zeros_like(o)
    if getattr(mixer, "D", None) is not None:
        skip = mixer.D.double().reshape(mixer.num_heads, -1)[head] * \
            cache[hook_name("hook_v", layer)][batch, position, head].double()
    y = o + skip
    if bool((y == 0).any()):
        raise ValueError(f"layer {layer} head {head}: the readout is exactly 0 in a channel at position {position}, so "
                         f"its frozen output scale cannot be read off hook_z; pass an explicit direction")
    s = cache[hook_name("hook_z", layer)][batch, position, head].double() / y
    return s, s * skip, False


def _frozen_final_norm(norm, resid: torch.Tensor):
    """(scale (D,), centred): the final norm as the linear map delta -> scale * (delta - centred * mean(delta)) with
    its statistics frozen at `resid`. A LayerNorm centres; any other norm is taken as an RMS norm x -> x * r(x) * w
    (whatever its weight's parametrisation, 1 + w included), whose frozen scale r(resid) * w is read by applying it
    to the constant vector with resid's mean square: r is the same there, so norm(e) / e = r(resid) * w exactly."""
    x = resid.double()
    if isinstance(norm, torch.nn.LayerNorm):
        scale = torch.rsqrt(x.var(unbiased=False) + norm.eps).expand(x.shape[0]).clone()
        if norm.weight is not None:
            scale = scale * norm.weight.double()
        return scale, True
    rms = x.pow(2).mean().sqrt()
    probe = rms.expand(x.shape[0]).to(resid.dtype)
    return norm(probe).double() / rms, False


@torch.no_grad()
def candidate_direction(model, cache, layer: int, head: int, position: int, batch: int,
                        candidates: tuple[int, int]) -> torch.Tensor:
    """The (V,) direction d with d . o = direct logit difference logit[a] - logit[b] at `position` caused by a head
    output o, with every normalisation statistic and the output gate frozen at their values in this run.

    o -> z = s * o + c (centred first where the head's norm centres: RWKV-7's group norm) -> o_proj (this head's
    columns) -> the final norm with its statistics frozen -> unembedding rows a minus b (unembed_weight, output
    multipliers included). A native family's spec gives the frozen map o -> z (readout_map, or readout_norm and
    readout_gate for norm(o) * act(gate)); a bridged mixer's is read off the run (_bridged_map), and its block's
    mixer_output_scale scales the path. The terms c that do not depend on o (Mamba-2's D skip, RWKV-7's bonus and
    norm bias) drop out of d. Later layers are not on this path (direct effect only), as in direct logit attribution;
    the frozen map reproduces hook_z exactly, which is checked.
    """
    spec = model.family
    if getattr(model, "bridge_family", None) is not None:
        s, offset, centred = _bridged_map(model, cache, layer, head, position, batch)
    elif spec.readout_map is not None:
        s, offset, centred = spec.readout_map(model, cache, layer, head, position, batch)
    elif spec.readout_norm is not None:
        s, offset, centred = _norm_gate_map(model, cache, layer, head, position, batch)
    else:
        raise ValueError(f"family {spec.name!r} declares no output path (readout_map or readout_norm in its spec), so "
                         f"candidate_direction cannot freeze it; pass an explicit direction to attribute_readout")
    block = model.blocks[layer]
    mixer = block.mixer
    V = mixer.head_v
    o_t = cache[hook_name("hook_head_out", layer)][batch, position, head].double()
    z_t = cache[hook_name("hook_z", layer)][batch, position, head].double()
    frozen = s * (o_t - o_t.mean() if centred else o_t) + offset
    if not torch.allclose(frozen, z_t, rtol=1e-4, atol=1e-6 * float(z_t.abs().max()) + 1e-12):
        raise RuntimeError(f"layer {layer}: the frozen output map does not reproduce hook_z "
                           f"(max error {float((frozen - z_t).abs().max()):.3g}); this mixer's output path is not "
                           f"the one its family's spec describes to candidate_direction")
    resid_final = cache[hook_name("hook_resid_post", len(model.blocks) - 1)][batch, position]
    final_scale, final_centred = _frozen_final_norm(model.final_norm, resid_final[..., :model.cfg.hidden_size])
    good, bad = (int(c) for c in candidates)
    W_U = model.unembed_weight.double()
    vocab = W_U.shape[0]
    for c in (good, bad):
        if not 0 <= c < vocab:
            raise ValueError(f"candidates must be token ids in [0, {vocab - 1}], got {candidates!r}")
    w = final_scale * (W_U[good] - W_U[bad])
    if final_centred:          # the centring projector is symmetric: (P r) . w = r . (P w)
        w = w - w.mean()
    if getattr(block, "norm_layout", "pre") != "pre":
        raise ValueError(f"layer {layer} norms its mixer's output after o_proj (a post-norm block); "
                         f"candidate_direction follows pre-norm blocks only: pass an explicit direction")
    out_proj = getattr(mixer, getattr(mixer, "out_attr", "o_proj"))   # a bridged mixer names its own
    # (D, V): head h's slice of the output projection's input, times what the block scales the mixer's output by
    # (a bridged block's mixer_output_scale: Granite-4.0-H's residual_multiplier, Falcon-H1's ssm_out_multiplier)
    W_O = out_proj.weight.double()[:, head * V:(head + 1) * V] * getattr(block, "mixer_output_scale", 1.0)
    d = s * (W_O.T @ w)
    return d - d.mean() if centred else d


@torch.no_grad()
def attribute_readout(
    model, tokens, layer: int, head: int, position: int, *, direction: Optional[torch.Tensor] = None,
    candidates: Optional[Sequence[int]] = None, batch: Optional[int] = None,
) -> pd.DataFrame:
    """One row per token 0..position: its exact contribution c_i to head (layer, head)'s readout o_t at `position`.

    tokens: (T,) or (B, T) ids (batch=b chooses the row when B > 1). Columns: position, token_id, token (when the
    model has a tokenizer), contribution (c_i as a (V,) float64 array), norm (|c_i|), coefficient (the scalar with
    c_i = coefficient * x_i), projection (c_i . d).
    d is `direction` (a (V,) tensor, used as given) or, with candidates=(a, b), candidate_direction's frozen-scale
    direct logit-difference direction (projection in logit units); by default the unit direction of o_t, so the
    projections sum to |o_t|. The rows sum to hook_head_out at `position`: the model starts from a zero state.
    Read the module docstring's caveat before reading these numbers as causal effects.
    """
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.as_tensor(tokens)
    if tokens.dim() == 1:
        tokens = tokens[None]
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have shape (T,) or (B, T), got {_shape(tokens)}")
    B, T = tokens.shape
    model.check_head(int(layer), int(head))
    if getattr(model, "query_group", 1) > 1:
        raise ValueError(f"attribute_readout decomposes one query head's readout of its own state, but each state of "
                         f"this model is read by {model.query_group} query heads (num_kv_heads < num_heads); run it "
                         "on a model with one query head per state")
    layer, head = int(layer), int(head)
    if batch is None:
        if B != 1:
            raise ValueError(f"tokens has B = {B} rows: pass batch=b with 0 <= b < {B}")
        batch = 0
    if not 0 <= int(batch) < B:
        raise ValueError(f"batch {batch} is out of range: tokens has rows 0..{B - 1}")
    batch = int(batch)
    if not 0 <= int(position) < T:
        raise ValueError(f"position {position} is out of range: tokens has positions 0..{T - 1}")
    position = int(position)
    if direction is not None and candidates is not None:
        raise ValueError("pass either direction or candidates, not both")

    names = {hook_name(p, layer) for p in _MIXER_POINTS} | {hook_name("hook_resid_pre", layer)}
    names.add(hook_name("hook_resid_post", len(model.blocks) - 1))
    _, cache = model.run_with_cache(tokens, names_filter=lambda n: n in names)
    get = lambda p: cache[hook_name(p, layer)] if hook_name(p, layer) in cache else None  # noqa: E731
    mixer = model.blocks[layer].mixer
    q, k = get("hook_q"), get("hook_k")
    scale = getattr(mixer, "readout_scale", None)
    if scale is None:
        scale = getattr(mixer, "head_k", q.shape[-1]) ** -0.5
    b = get("hook_erase") * get("hook_erase_gate") if getattr(mixer, "low_rank_transition", False) else None
    contrib = readout_contributions(
        q, k, get("hook_write_value"), get("hook_decay"), get("hook_erase"), t=position, scale=scale,
        write_scale=get("hook_write_scale"), write_key=get("hook_write_key"), head=head, batch=batch, b=b)
    c = contrib.per_token
    if candidates is not None:
        if len(candidates) != 2:
            raise ValueError(f"candidates must be a pair of token ids (a, b), got {candidates!r}")
        d = candidate_direction(model, cache, layer, head, position, batch, tuple(candidates)).to(c.dtype)
    elif direction is not None:
        d = torch.as_tensor(direction, dtype=c.dtype, device=c.device)
        if tuple(d.shape) != (c.shape[1],):
            raise ValueError(f"direction must have shape (V,) = ({c.shape[1]},), got {_shape(d)}")
    else:
        o_t = get("hook_head_out")[batch, position, head].to(c.dtype)
        n = o_t.norm()
        d = o_t / n if float(n) > 0 else o_t
    ids = tokens[batch, : position + 1].tolist()
    frame = {"position": list(range(position + 1)), "token_id": ids}
    if getattr(model, "tokenizer", None) is not None:
        from recurscope.interp.data.tokenizer import token_strings

        frame["token"] = token_strings(model.tokenizer, ids)
    frame["contribution"] = list(c.cpu().numpy())
    frame["norm"] = c.norm(dim=-1).cpu().numpy()
    frame["coefficient"] = contrib.coefficients.cpu().numpy()
    frame["projection"] = (c @ d).cpu().numpy()
    return pd.DataFrame(frame)
