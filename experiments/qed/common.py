"""Shared pieces of the QED experiment suite: the arms, the one architecture and recipe, the theta learning-rate
groups, fast last-position logits, and the per-token quantities (b, d, e, rho) the diagnostics need."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # so the scripts run as `python experiments/qed/x.py` and import each other
    sys.path.insert(0, str(ROOT))

from recurscope import kernels  # noqa: E402
from recurscope.interp.models import ModelConfig, RecurrentLM  # noqa: E402
from recurscope.interp.models.mixers import GatedDeltaNet2Mixer, _split_heads  # noqa: E402
from recurscope.interp.models.optim import param_groups  # noqa: E402

#: Every arm, baseline first. "noproj" (gate without projection) is the arm the paper never ran.
ARMS = ("gdn2", "full", "nogate", "nogate_noproj", "rand", "noproj")
QED_ARMS = tuple(a for a in ARMS if a != "gdn2")
#: Figure-2 contrasts (arm_a, arm_b): the paper's four, plus the two the noproj arm makes possible.
CONTRASTS = (("full", "gdn2"), ("full", "rand"), ("full", "nogate"), ("nogate", "nogate_noproj"),
             ("noproj", "nogate_noproj"), ("full", "noproj"))
STRENGTHS = (-1.0, 0.0, 0.5, 1.0, 1.5, 2.0)
TRAIN_LENGTH = 256
LENGTH_MULTIPLIERS = (1, 2, 4, 8, 16)

#: One architecture for every arm (only erase_arm differs); the same shape as the bundled tiny-qed model.
ARCHITECTURE = dict(model_type="gated_deltanet2", hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=32,
                    expand_v=2.0, use_short_conv=True, hidden_ratio=2, qed_lambda_max=0.25, qed_theta_init=-2.0)
THETA_LR_MULT = 10.0
WEIGHT_DECAY = 0.1


def check_arm(arm: str) -> str:
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}; received {arm!r}.")
    return arm


def model_config(arm: str, tokenizer) -> ModelConfig:
    """The suite's ModelConfig for `arm`, with the vocabulary and special ids of `tokenizer`."""
    raw = dict(ARCHITECTURE, erase_arm=check_arm(arm), vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    return ModelConfig.from_dict(raw)


def qed_param_groups(model: torch.nn.Module, lr: float, theta_lr_mult: float = THETA_LR_MULT,
                     weight_decay: float = WEIGHT_DECAY) -> list[dict]:
    """AdamW groups: weight decay on matrices (not embeddings), none on vectors, and every `qed_theta` in its own
    group at `theta_lr_mult` x `lr` without decay. Each group keeps its multiplier in "lr_scale" so a schedule sets
    group["lr"] = schedule(step) * group["lr_scale"]."""
    return param_groups(model, lr, weight_decay=weight_decay, theta_lr_mult=theta_lr_mult)


def qed_mixers(model: RecurrentLM) -> list[tuple[int, GatedDeltaNet2Mixer]]:
    return [(b.layer, b.mixer) for b in model.blocks if isinstance(b.mixer, GatedDeltaNet2Mixer)]


def qed_lambdas(model: RecurrentLM) -> dict[int, Optional[list[float]]]:
    """lam_h per layer (strength applied), None for the gdn2 arm."""
    out = {}
    for layer, m in qed_mixers(model):
        lam = m.qed_lambda()
        out[layer] = None if lam is None else [float(x) for x in lam.detach()]
    return out


def qed_scalar_count(model: RecurrentLM) -> int:
    """How many qed_theta scalars the model has (H per layer for a QED arm, 0 for gdn2)."""
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith("qed_theta"))


@torch.no_grad()
def last_logits(model: RecurrentLM, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits at one position per row, (B, V): the decoder without the full (B, T, V) LM head, which dominates
    memory and time at long lengths. Every block (and its hook points) runs as in model.forward."""
    resid = model.hook_embed(model.embed(tokens))
    for block in model.blocks:
        resid, _ = block(resid)
    picked = resid[torch.arange(tokens.shape[0]), positions.to(tokens.device)]
    return model.lm_head(model.norm(picked))


def erase_gate_from_block(block, resid_pre: torch.Tensor) -> torch.Tensor:
    """b_t (B, T, H, K) of a GDN-2 block, recomputed from `blocks.{l}.hook_resid_pre` with the block's own
    attn_norm and b_proj (b has no hook point of its own)."""
    mixer = block.mixer
    b = torch.sigmoid(_split_heads(mixer.b_proj(block.attn_norm(resid_pre)).float(), mixer.head_k))
    if mixer.groups > 1:
        b = b.repeat_interleave(mixer.groups, dim=2)
    return b * 2.0 if mixer.allow_neg_eigval else b


def qed_direction(k: torch.Tensor, q: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """d_t = P_perp_k(b * q): the full arm's added direction (gate first, then project)."""
    return kernels.project_out(k, b * q)


def gdn2_eigenvalue(k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """e_t = 1 - sum_i b_i k_i^2, the GDN-2 value that the projected arms keep."""
    return 1.0 - (b * k * k).sum(-1)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), tokens[:, 1:].reshape(-1))


def lengths_from(train_length: int, multipliers: Sequence[int]) -> list[int]:
    return [int(train_length * m) for m in multipliers]


def markdown_table(frame, digits: int = 4) -> str:
    """A GitHub markdown table (pandas' to_markdown needs tabulate, which is not a dependency)."""
    def fmt(v):
        if isinstance(v, float):
            return "" if v != v else f"{v:.{digits}g}"
        return str(v)
    cols = list(frame.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v) for v in row) + " |")
    return "\n".join(lines) + "\n"
