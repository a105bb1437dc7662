"""Optimiser parameter groups for training recurscope models, with QED's theta at a higher learning rate."""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, lr: float, weight_decay: float = 0.1,
                 theta_lr_mult: float = 10.0) -> list[dict]:
    """AdamW groups: weight decay on matrices (not embeddings), none on vectors, and every QED `qed_theta` in its
    own group at `theta_lr_mult` x `lr` without decay (10x in the QED paper, since lam barely moves otherwise).

    Each group keeps its multiplier in "lr_scale", so a schedule sets group["lr"] = schedule(step) * lr_scale.
    Empty groups are left out.
    """
    if not lr > 0:
        raise ValueError(f"lr must be > 0; received {lr!r}.")
    if not theta_lr_mult > 0:
        raise ValueError(f"theta_lr_mult must be > 0 (10 in the QED paper); received {theta_lr_mult!r}.")
    decay, no_decay, theta = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("qed_theta"):
            theta.append(p)
        elif p.dim() >= 2 and not name.startswith("embed."):
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "lr": lr, "lr_scale": 1.0, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "lr": lr, "lr_scale": 1.0, "name": "no_decay"},
              {"params": theta, "weight_decay": 0.0, "lr": lr * theta_lr_mult, "lr_scale": float(theta_lr_mult),
               "name": "qed_theta"}]
    return [g for g in groups if g["params"]]
