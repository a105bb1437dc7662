"""Shared pieces of the QED experiment suite: the arms and lambda-study runs, the one architecture and recipe, the
theta learning-rate groups, logits at chosen positions, and the per-token quantities (d, e) the diagnostics need
(b comes from the mixer's hook_erase_gate)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]

from recurscope import kernels
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.hooks import hook_name
from recurscope.interp.models.mixers import GatedDeltaNet2Mixer
from recurscope.interp.models.optim import param_groups

#: Every arm, baseline first (kernels.ERASE_ARMS). "noproj" (gate without projection) is the arm the paper never ran.
ARMS = kernels.ERASE_ARMS
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


#: The lambda_max study (paper Sec. 7): the full arm with lam_0 = lambda_max * sigmoid(theta_0) set through theta_0.
#: "full" itself is the (lambda_max 0.25, lam_0 0.03) cell.
LAMBDA_STUDY = {f"full-lm{lm:g}-l{l0:g}": (lm, l0) for lm in (0.25, 0.5) for l0 in (0.03, 0.1, 0.2)
                if (lm, l0) != (0.25, 0.03)}
#: Every trainable run name: the six arms and the lambda-study variants of full.
RUNS = ARMS + tuple(LAMBDA_STUDY)


def check_run(run: str) -> str:
    if run not in RUNS:
        raise ValueError(f"run must be an arm {ARMS} or a lambda-study variant {tuple(LAMBDA_STUDY)}; received {run!r}.")
    return run


def theta_for(lambda_0: float, lambda_max: float) -> float:
    """theta_0 with lambda_max * sigmoid(theta_0) = lambda_0."""
    if not 0 < lambda_0 < lambda_max:
        raise ValueError(f"lambda_0 must lie in (0, lambda_max={lambda_max}); received {lambda_0}.")
    p = lambda_0 / lambda_max
    return math.log(p / (1 - p))


def run_settings(run: str) -> dict:
    """erase_arm, qed_lambda_max and qed_theta_init of a run name (an arm or a lambda-study variant)."""
    check_run(run)
    if run in LAMBDA_STUDY:
        lm, l0 = LAMBDA_STUDY[run]
        return {"erase_arm": "full", "qed_lambda_max": lm, "qed_theta_init": theta_for(l0, lm)}
    return {"erase_arm": run, "qed_lambda_max": ARCHITECTURE["qed_lambda_max"],
            "qed_theta_init": ARCHITECTURE["qed_theta_init"]}


def model_config(arm: str, tokenizer) -> ModelConfig:
    """The suite's ModelConfig for `arm` (or a lambda-study run name), with the vocabulary and special ids of
    `tokenizer`."""
    raw = dict(ARCHITECTURE, **run_settings(arm), vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
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
    """Logits at `positions` only ((B,) -> (B, V), (B, P) -> (B, P, V)): the model's `logit_positions` option,
    which skips the full (B, T, V) LM head that dominates memory and time at long lengths."""
    return model(tokens, logit_positions=positions)


def erase_gate_name(layer: int) -> str:
    """The hook holding b_t (B, T, H, K) of a GDN-2 layer, the erase gate entering the erase vector."""
    return hook_name("hook_erase_gate", layer)


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
