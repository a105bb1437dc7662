"""Log-likelihoods of answers that may be several tokens, from logits at the scored positions only.

A candidate answer c_1 .. c_m after a prompt is scored by its full conditional log-likelihood
log p(c_1 .. c_m | prompt) = sum_j log softmax(z_{q+j-1})[c_j], where q is the prompt's last position. Only the m
positions are unembedded (the models' `logit_positions`), so memory grows with what is scored, not with the
prompt's length times the vocabulary. Logits stay in the model's dtype; the picked logits and each position's
log-normaliser are accumulated in float32 (float64 for a float64 model).
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch

__all__ = ["sequence_loglik", "continuation_batch", "forward_at_positions"]

#: Elements of the float32 copy one logsumexp step holds at once (64 MiB): bounds the accumulation's memory at any V.
_CHUNK_ELEMENTS = 1 << 24


def sequence_loglik(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(R,) sum over p of log softmax(logits[r, p])[tokens[r, p]] where mask[r, p], from logits (R, P, V) at the
    scored positions only (any dtype), tokens (R, P) long and mask (R, P) bool (default all)."""
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits must be (R, P, V) and tokens (R, P); received {tuple(logits.shape)} and "
                         f"{tuple(tokens.shape)}")
    acc = torch.promote_types(logits.dtype, torch.float32)
    tokens = tokens.to(logits.device)
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).to(acc)
    flat = logits.reshape(-1, logits.shape[-1])
    step = max(1, _CHUNK_ELEMENTS // max(1, logits.shape[-1]))
    norm = torch.cat([torch.logsumexp(flat[lo:lo + step].to(acc), dim=-1) for lo in range(0, flat.shape[0], step)]
                     ) if flat.shape[0] else flat.new_zeros(0, dtype=acc)
    logp = picked - norm.view(picked.shape)
    if mask is not None:
        logp = torch.where(mask.to(logp.device), logp, torch.zeros_like(logp))
    return logp.sum(-1)


def continuation_batch(prompts: torch.Tensor, continuations: Sequence[Sequence[int]]):
    """Prompts (R, T) each followed by its continuation, right-padded with the continuation's last token (which no
    scored position sees: causal). Returns ids (R, T + P), positions (R, P) whose logits predict each continuation
    token (padding slots repeat the last real one), tokens (R, P) and mask (R, P)."""
    R, T = prompts.shape
    if len(continuations) != R or any(len(c) == 0 for c in continuations):
        raise ValueError(f"need one non-empty continuation per prompt ({R}); received {len(continuations)}")
    P = max(len(c) for c in continuations)
    tokens = torch.tensor([list(c) + [c[-1]] * (P - len(c)) for c in continuations], dtype=torch.long)
    lengths = torch.tensor([len(c) for c in continuations])
    mask = torch.arange(P)[None, :] < lengths[:, None]
    steps = torch.minimum(torch.arange(P)[None, :], (lengths - 1)[:, None])
    positions = (T - 1) + steps
    ids = torch.cat([prompts.cpu(), tokens], dim=1)
    return ids, positions, tokens, mask


def forward_at_positions(forward, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits (R, P, V) at `positions` (R, P): passed as `logit_positions` where `forward` takes it (the project's
    models, and so only those positions are unembedded); otherwise forward(ids) (R, T, V) is indexed."""
    try:
        params = inspect.signature(forward).parameters
        takes = "logit_positions" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes = False
    if takes:
        return forward(ids, logit_positions=positions.to(ids.device))
    logits = forward(ids)
    rows = torch.arange(ids.shape[0], device=logits.device)[:, None]
    return logits[rows, positions.to(logits.device)]
