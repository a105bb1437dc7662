"""How the bundled tiny checkpoints were made: small GLA / Gated DeltaNet / hybrid / GDN-2 / QED models trained on a CPU
on filler next-token prediction plus the key-value recall task, then scored on held-out recall at K=4, F=512.

Usage:  python -m experiments.train_tiny --model tiny-gla [--max-minutes M] [--steps N] [--seed S] [--out DIR]
                                          [--threads T] [--smoke]      # staged curriculum (the default)
        python -m experiments.train_tiny --model tiny-gla --ramp       # the old scheduled ramp (500 steps)
        python -m experiments.train_tiny --rewrite-summary DIR      # eval_summary.md again from DIR's json and log
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from recurscope.interp.data.layout import LAYOUT_FILE, LAYOUTS
from recurscope.interp.data import TEMPLATES, VALUE_VOCABS, FillerSource, build_pairs, build_word_tokenizer, save_word_tokenizer
from recurscope.interp.data import sources as filler_sources
from recurscope.interp.loading import CHECKPOINT_DIR, save_model
from recurscope.interp.models.optim import param_groups as shared_param_groups
from recurscope.interp.models import ModelConfig, RecurrentLM
from recurscope.interp.models.rwkv7 import LOG_DECAY_BOUND as RWKV7_LOG_DECAY_BOUND
from recurscope.interp.stats import source_bootstrap_ci

from experiments.training import finish_run, train_loop, warmup_constant, warmup_stable_decay

# Architectures. Sizes are chosen so that one shared CPU core trains a model in about a quarter of an hour.
ARCHITECTURES: dict[str, dict] = {
    # Unlike gla-340M, the tiny GLA uses fla's short convolution (width 4): with it one layer can bind a key to the
    # value a few tokens later ("KEY is in VALUE"); without it that binding needs two layers and learns far slower.
    "tiny-gla": dict(model_type="gla", hidden_size=128, num_hidden_layers=2, num_heads=2, expand_k=0.5, expand_v=1.0,
                     use_short_conv=True, hidden_ratio=2),
    "tiny-gdn": dict(model_type="gated_deltanet", hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=32,
                     expand_v=2.0, use_short_conv=True, hidden_ratio=2),
    "tiny-gdn-hybrid": dict(model_type="gated_deltanet", hidden_size=128, num_hidden_layers=3, num_heads=2,
                            head_dim=32, expand_v=2.0, use_short_conv=True, hidden_ratio=2,
                            attn={"layers": [1], "num_heads": 2}),
    "tiny-gdn2": dict(model_type="gated_deltanet2", hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=32,
                      expand_v=2.0, use_short_conv=True, hidden_ratio=2, erase_arm="gdn2"),
    "tiny-qed": dict(model_type="gated_deltanet2", hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=32,
                     expand_v=2.0, use_short_conv=True, hidden_ratio=2, erase_arm="full"),
    # 4 layers x 4 heads with the per-head sizes of tiny-gla / tiny-gdn (d_k 32, d_v 64): enough heads for the
    # head-level protocols (rankings, joint top-k, all-head scans) to have something to rank.
    "tiny-gla-wide": dict(model_type="gla", hidden_size=128, num_hidden_layers=4, num_heads=4, expand_k=1.0,
                          expand_v=2.0, use_short_conv=True, hidden_ratio=2),
    # GLA-7B's grouping (App. E.2): each state group is read by 4 query heads (fla's num_kv_heads). 4 layers x 2
    # groups give the top-k test 8 state groups to rank; each group's state is 32 x 32.
    "tiny-gla-groups": dict(model_type="gla", hidden_size=128, num_hidden_layers=4, num_heads=8, num_kv_heads=2,
                            expand_k=2.0, expand_v=2.0, use_short_conv=True, hidden_ratio=2),
    "tiny-gdn-wide": dict(model_type="gated_deltanet", hidden_size=128, num_hidden_layers=4, num_heads=4,
                          head_dim=32, expand_v=2.0, use_short_conv=True, hidden_ratio=2),
    # d_k = 16: K >= d_k facts fit in a sequence, so the load protocols can reach the state's capacity. A width of
    # 112 keeps the checkpoint directory under 4 MB.
    "tiny-gdn-narrow": dict(model_type="gated_deltanet", hidden_size=112, num_hidden_layers=2, num_heads=2,
                            head_dim=16, expand_v=2.0, use_short_conv=True, hidden_ratio=2),
    # RWKV-7 (fla's format): 4 heads of 32 (states 32 x 32), two layers. Its token shift reaches one token back (no
    # width-4 convolution), so binding "KEY is in VALUE" needs the first layer to carry the key forward; it sat at
    # the two-value plateau (training recall ~0.5) for its first ~5000 steps (docs/history.md, Checkpoint log).
    "tiny-rwkv7": dict(model_type="rwkv7", hidden_size=128, num_hidden_layers=2, num_heads=4, head_dim=32,
                       decay_low_rank_dim=16, gate_low_rank_dim=32, a_low_rank_dim=16, v_low_rank_dim=16,
                       hidden_ratio=2, hidden_act="sqrelu", norm_first=True, norm_bias=True,
                       elementwise_affine=True, norm_eps=1e-5),
    # Mamba-2 (fla's format): no MLP in its blocks, so four layers; 8 heads of 32 channels, states 32 x 32 (N x P),
    # B and C in one group. Its short convolution takes torch's Conv1d init (_long_memory_gates): with an N(0, 0.02)
    # conv the state readout, cubic in the conv's outputs, starts at 3.4e-4 of the D skip and recall never leaves
    # chance (docs/history.md, Checkpoint log).
    "tiny-mamba2": dict(model_type="mamba2", hidden_size=128, num_hidden_layers=4, num_heads=8, head_dim=32,
                        state_size=32, expand=2, n_groups=1, hidden_act="silu"),
}
DEFAULT_STEPS = {name: 500 for name in ARCHITECTURES}
SMOKE_STEPS = 3

# Evaluation: every template, each with its own value vocabulary (fixed, so the evaluation never changes).
EVAL_VOCAB = {"is_in": "cities", "colon": "colours", "belongs": "instruments", "likes": "fruits",
              "value_of": "shapes"}
EVAL = dict(split="heldout", n_sources=128, n_facts=4, presentations=3, filler_tokens=512, seed=0)

# Training distribution and curriculum.
FILLER_START, FILLER_END = 8, 512      # filler tokens between the last presentation and the query
GAP_START = 2                           # filler between presentations grows from this to GAP_RANGE[1] with the curriculum
CURRICULUM_FRACTION = 0.75              # the filler ceiling reaches FILLER_END after this fraction of the steps
BATCH_RECALL, BATCH_FILLER = 7, 1       # rows per step: recall sequences, pure filler (LM only) rows
FACT_COUNTS = (2, 3, 4, 4, 5, 6)
PRESENTATION_COUNTS = (2, 3, 3)
GAP_RANGE = (4, 24)
PEAK_LR, WARMUP_FRACTION, DECAY_FRACTION, FINAL_LR_FRACTION = 3e-3, 0.05, 0.25, 0.05
INIT_STD = 0.02
GATE_WINDOW, GATE_ACCURACY, GATE_LEVELS = 20, 0.8, 12   # gated curriculum (--gated)
EASY_STAGE = ("is_in", "cities", 2, 3)   # --gated level 0: template, vocab, facts, presentations
WEIGHT_DECAY, GRAD_CLIP, QED_LR_MULTIPLIER = 0.1, 1.0, 10.0

# Staged curriculum (the default): start from a setting known to learn binding within a few hundred steps (one template,
# two facts, short filler, 16 recall rows, lr 1e-3, recall loss weighted up), and widen one axis at a time once the
# running training recall is high. Templates are mixed before the filler grows because steps on short sequences are
# ~10x cheaper than at F=512, so each format is learned where it costs least.
ALL = None  # stage field value meaning "every template" / "every value vocabulary"
STAGES: tuple[dict, ...] = (
    dict(name="easy", templates=("is_in",), vocabs=("cities",), facts=(2,), presentations=(2,), gap=(2, 4),
         filler=(8, 32)),
    dict(name="K3", templates=("is_in",), vocabs=("cities",), facts=(2, 3), presentations=(2,), gap=(2, 4),
         filler=(8, 32)),
    dict(name="K4", templates=("is_in",), vocabs=("cities",), facts=(3, 4, 4), presentations=(2,), gap=(2, 4),
         filler=(8, 32)),
    dict(name="templates", templates=ALL, vocabs=ALL, facts=(3, 4, 4), presentations=(2,), gap=(2, 4),
         filler=(8, 32)),
    dict(name="R3-gap24", templates=ALL, vocabs=ALL, facts=(3, 4, 4), presentations=(2, 3, 3), gap=(4, 24),
         filler=(8, 32)),
    dict(name="F64", templates=ALL, vocabs=ALL, facts=(3, 4, 4), presentations=(2, 3, 3), gap=(4, 24),
         filler=(16, 64)),
    dict(name="F128", templates=ALL, vocabs=ALL, facts=(3, 4, 4), presentations=(2, 3, 3), gap=(4, 24),
         filler=(32, 128)),
    dict(name="F256", templates=ALL, vocabs=ALL, facts=(3, 4, 4), presentations=(2, 3, 3), gap=(4, 24),
         filler=(64, 256)),
    dict(name="F512", templates=ALL, vocabs=ALL, facts=(2, 3, 4, 4, 5), presentations=(2, 3, 3), gap=(4, 24),
         filler=(128, 512)),
)
EARLY_STAGES = 3                               # easy, K3, K4: the single-template binding stages


def staged_curriculum(early_templates: Optional[Sequence[str]] = None) -> tuple[dict, ...]:
    """STAGES, with the binding stages (0-2) drawing from `early_templates` instead of is_in alone. Learning a
    value-before-key format (belongs) from the start keeps a model from settling on a key-before-value solution that
    the later all-template stages cannot undo (tiny-gla's belongs stayed at 35% when it came only at stage 3)."""
    if early_templates is None:
        return STAGES
    unknown = [t for t in early_templates if t not in TEMPLATES]
    if unknown or not early_templates:
        raise ValueError(f"early_templates must be a non-empty list of {sorted(TEMPLATES)}; received "
                         f"{list(early_templates)!r}.")
    return tuple(dict(st, templates=tuple(early_templates)) if i < EARLY_STAGES else st
                 for i, st in enumerate(STAGES))


def paper_curriculum(vocabs: Optional[Sequence[str]] = None) -> tuple[dict, ...]:
    """STAGES on the `paper` layout's format (template key_value, "KEY VALUE." with the one-token query "KEY"): the
    same widening of facts, presentations, gap and filler, without the template-mixing stage (there is one format);
    values from cities in the binding stages, from every value vocabulary from R3-gap24 on, or from `vocabs` in
    every stage when given."""
    if vocabs is not None and (not vocabs or any(v not in VALUE_VOCABS for v in vocabs)):
        raise ValueError(f"vocabs must be a non-empty list of {sorted(VALUE_VOCABS)}; received {list(vocabs)!r}.")
    stages = []
    for st in STAGES:
        if st["name"] == "templates":
            continue
        stage = dict(st, templates=(LAYOUTS["paper"].template,))
        if vocabs is not None:
            stage["vocabs"] = tuple(vocabs)
        stages.append(stage)
    return tuple(stages)


LAYOUT_CURRICULA = {"where_is": None, "paper": paper_curriculum}


ADVANCE_WINDOW, ADVANCE_ACCURACY = 20, 0.85   # advance when the last 20 steps of a stage average >= 85% recall
FOCUS_FRACTION = 0.5                           # --focus-template: share of batches of that template
PER_TEMPLATE_WINDOW = 8                        # --advance-per-template: each template's last 8 steps, too
RESUME_EVERY = 100                        # steps between resume points (out/resume.pt, gone once the model is saved)
STAGED_LR, STAGED_WARMUP_STEPS = 1e-3, 20     # constant after warmup: the run length is set by the clock
STAGED_RECALL_ROWS, STAGED_RECALL_WEIGHT = 16, 4.0
STAGED_MAX_STEPS = 2_000                      # default step cap of a staged run (--steps / --max-minutes override)
#: --stop-recall: training ends once the last stage has run FINAL_MIN_STEPS steps and its last FINAL_WINDOW training
#: batches average at least the given recall (training batches only: the held-out evaluation is never looked at).
FINAL_MIN_STEPS, FINAL_WINDOW = 120, 80
TRAIN_SOURCE_OFFSET = 10 ** 9            # train-split source ids used for the pure filler rows


def model_config(name: str, tokenizer, vocab_map=None) -> ModelConfig:
    """The ModelConfig of architecture `name`, with the vocabulary and special ids of `tokenizer` (in the compact
    rows of `vocab_map` when given: see compact_vocab)."""
    if name not in ARCHITECTURES:
        raise ValueError(f"model must be one of {sorted(ARCHITECTURES)}; received {name!r}.")
    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    size = len(tokenizer)
    if vocab_map is not None:
        ids = {k: vocab_map.compact_id(v) for k, v in ids.items()}
        size = vocab_map.size
    raw = dict(ARCHITECTURES[name], vocab_size=size, **ids, tie_word_embeddings=False)
    return ModelConfig.from_dict(raw)


def init_weights(model: RecurrentLM, std: float = INIT_STD) -> None:
    """GPT-style init (as fla trains its models): every Linear and the embedding ~ N(0, std), biases zero, and the
    two residual writers per block (o_proj, down_proj) shrunk by sqrt(2 * layers). Gates, decays, convolutions and
    norms keep the initialisation their modules chose. torch's default N(0, 1) embedding would swamp the residual
    stream and make the token mixers' contribution tiny, which stalls learning of recall."""
    n_layers = model.cfg.num_hidden_layers
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
                if name.endswith("o_proj") or name.endswith("down_proj"):
                    module.weight.div_(math.sqrt(2 * n_layers))
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
        for block in model.blocks:
            if block.is_recurrent:
                _long_memory_gates(block.mixer)


def _long_memory_gates(mixer: torch.nn.Module) -> None:
    """Spreads the initial per-step log-decays from about -0.04 to -0.001 (memory horizons of ~25 to ~1000 tokens),
    so that some channels hold a binding across 512 filler tokens from the start. A decay that forgets within a few
    dozen tokens passes back an exponentially small gradient from a query hundreds of tokens later."""
    if hasattr(mixer, "gk_proj"):  # GLA: log-decay = logsigmoid(bias + ...) / gate_logit_normalizer
        bias = mixer.gk_proj[1].bias
        head_k = mixer.head_k if hasattr(mixer, "head_k") else bias.numel()
        spread = torch.linspace(0.0, 5.0, head_k)  # logsigmoid(0)/16 = -0.043 ... logsigmoid(5)/16 = -0.0004
        bias.copy_(spread.repeat(bias.numel() // head_k))
    elif hasattr(mixer, "w_lora"):  # RWKV-7: log-decay = -0.6065 sigmoid(w_lora(x)), per channel
        bias = mixer.w_lora.lora[2].bias
        head_k = mixer.head_k
        logw = torch.logspace(math.log10(1e-3), math.log10(4e-2), head_k)   # |log w| per key channel
        p = logw / RWKV7_LOG_DECAY_BOUND
        bias.copy_(torch.log(p / (1 - p)).repeat(bias.numel() // head_k))   # logit: sigmoid(bias) = p
    elif hasattr(mixer, "D") and hasattr(mixer, "dt_bias"):  # Mamba-2: log-decay dt A, and dt also scales the write
        # dt = 0.5 keeps the write dt x as strong as the D skip beside the readout (fla's dt of 0.001-0.1 leaves
        # the state's readout a hundredth of it); A spreads the log-decays over the same range as above.
        dt = torch.full_like(mixer.dt_bias, 0.5)
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        decay = torch.logspace(math.log10(1e-3), math.log10(4e-2), mixer.A_log.numel())
        mixer.A_log.copy_(torch.log(decay / dt))
        # The state's readout C^T S x is cubic in the conv's outputs (B, C and x all pass through it), so the
        # ShortConvolution's N(0, 0.02) weights leave it ~3e-4 of the D skip beside it (and B, C ~3e-4 of x's
        # gradient); the run with them stayed at chance. torch's Conv1d init (fla's and transformers' Mamba-2 use
        # nn.Conv1d) gives a readout ~2x the skip.
        conv = mixer.conv1d
        torch.nn.init.kaiming_uniform_(conv.weight, a=math.sqrt(5))
        if conv.bias is not None:
            bound = 1.0 / math.sqrt(conv.weight.shape[1] * conv.weight.shape[2])
            conv.bias.uniform_(-bound, bound)
    elif hasattr(mixer, "A_log") and hasattr(mixer, "dt_bias"):  # GDN / GDN-2: log-decay = -exp(A_log) softplus(dt)
        mixer.A_log.zero_()
        n = mixer.dt_bias.numel()
        per_head = mixer.head_k if n == mixer.head_k * mixer.num_heads else n  # GDN-2: per key channel
        dt = torch.logspace(math.log10(1e-3), math.log10(4e-2), per_head) if per_head > 1 else torch.tensor([1e-2])
        dt = dt.repeat(n // per_head)
        mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def learning_rate(step: int, steps: int, peak: float = PEAK_LR) -> float:
    """The ramp recipe's warmup-stable-decay schedule."""
    return warmup_stable_decay(step, steps, peak, WARMUP_FRACTION, DECAY_FRACTION, FINAL_LR_FRACTION)


def curriculum_progress(step: int, steps: int) -> float:
    """0 -> 1 over CURRICULUM_FRACTION of the run, quadratic so that more (cheap) steps see short sequences."""
    ramp = max(1, int(CURRICULUM_FRACTION * steps))
    return min(1.0, step / ramp) ** 2


def filler_ceiling(step: int, steps: int, start: int = FILLER_START, end: int = FILLER_END) -> int:
    """The longest filler gap (before the query) sampled at `step`."""
    return int(round(start + (end - start) * curriculum_progress(step, steps)))


def gap_ceiling(step: int, steps: int) -> int:
    """The longest filler between presentations sampled at `step`."""
    return int(round(GAP_START + (GAP_RANGE[1] - GAP_START) * curriculum_progress(step, steps)))


def param_groups(model: torch.nn.Module, lr: float, weight_decay: float = WEIGHT_DECAY,
                 qed_lr_multiplier: float = QED_LR_MULTIPLIER) -> list[dict]:
    """AdamW groups: decay on matrices, none on vectors; QED's `qed_theta` at `qed_lr_multiplier` times `lr`.

    Each group keeps its multiplier in "lr_scale" so a schedule can set lr = schedule * lr_scale.
    """
    return shared_param_groups(model, lr, weight_decay=weight_decay, theta_lr_mult=qed_lr_multiplier)


def make_batch(tokenizer, rng: random.Random, step: int, filler_tokens: int, max_gap: int = GAP_RANGE[1],
               n_recall: int = BATCH_RECALL, n_filler: int = BATCH_FILLER, seed: int = 0,
               easy: bool = False) -> dict:
    """One training batch: `n_recall` train-split recall rows of one random template/vocabulary/layout, and
    `n_filler` rows of plain train-split filler of the same length (LM loss only)."""
    template = rng.choice(sorted(TEMPLATES))
    vocab = rng.choice(sorted(VALUE_VOCABS))
    n_facts = rng.choice(FACT_COUNTS)
    presentations = rng.choice(PRESENTATION_COUNTS)
    if easy:  # the gated curriculum's first stage: one format, two facts
        template, vocab, n_facts, presentations = EASY_STAGE
    gap = rng.randint(min(GAP_RANGE[0], max_gap), max_gap)
    return _assemble_batch(tokenizer, step, filler_tokens, gap, template, vocab, n_facts, presentations,
                           n_recall, n_filler, seed)


def make_stage_batch(tokenizer, rng: random.Random, step: int, stage: dict, n_recall: int = STAGED_RECALL_ROWS,
                     n_filler: int = BATCH_FILLER, seed: int = 0, focus_template: Optional[str] = None) -> dict:
    """One training batch drawn from a STAGES entry: template, vocabulary, fact count, presentations, gap and filler
    length sampled from the stage's choices and ranges; plus `n_filler` plain filler rows (the LM-loss floor).
    focus_template: in a stage with every template, this one is drawn with probability FOCUS_FRACTION."""
    templates = sorted(TEMPLATES) if stage["templates"] is ALL else stage["templates"]
    if focus_template is not None and focus_template not in TEMPLATES:
        raise ValueError(f"focus_template must be one of {sorted(TEMPLATES)}; received {focus_template!r}.")
    if focus_template is not None and focus_template in templates and rng.random() < FOCUS_FRACTION:
        template = focus_template
    else:
        template = rng.choice(templates)
    vocab = rng.choice(sorted(VALUE_VOCABS) if stage["vocabs"] is ALL else stage["vocabs"])
    n_facts = rng.choice(stage["facts"])
    presentations = rng.choice(stage["presentations"])
    gap = rng.randint(*stage["gap"])
    filler_tokens = rng.randint(*stage["filler"])
    return _assemble_batch(tokenizer, step, filler_tokens, gap, template, vocab, n_facts, presentations,
                           n_recall, n_filler, seed)


def _assemble_batch(tokenizer, step: int, filler_tokens: int, gap: int, template: str, vocab: str, n_facts: int,
                    presentations: int, n_recall: int, n_filler: int, seed: int) -> dict:
    start = (seed * 100_003 + step) * n_recall
    batch = build_pairs(tokenizer, filler_sources("train", n_recall, seed=0, start=start), n_facts=n_facts,
                        presentations=presentations, filler_tokens=filler_tokens, gap_tokens=gap, template=template,
                        vocab=vocab, seed=seed * 100_003 + step)
    tokens = batch.recipient_ids
    T = tokens.shape[1]
    rows = [tokens]
    for j in range(n_filler):
        src = FillerSource(id=TRAIN_SOURCE_OFFSET + (seed * 100_003 + step) * max(1, n_filler) + j, split="train")
        rows.append(torch.tensor(src.token_ids(tokenizer, T), dtype=torch.long)[None])
    # Re-presented values (2nd and later presentation of a fact) are recall targets too: the token before each is
    # predicted from the earlier binding. Stored as (row, position of the token before the value, value id).
    spans = batch.value_spans[:, :, 1:, 0]                       # (N, K, R-1) start of each later value token
    row_index = torch.arange(len(batch))[:, None, None].expand_as(spans)
    keep = spans >= 0
    value_pos = spans[keep]
    represented = (row_index[keep], value_pos - 1, tokens[row_index[keep], value_pos])
    return {"tokens": torch.cat(rows), "query_pos": batch.query_pos, "answer_id": batch.recipient_answer_id,
            "represented": represented,
            "candidate_ids": batch.candidate_ids, "answer_index": batch.recipient_answer_index,
            "n_recall": len(batch), "template": template, "vocab": vocab, "n_facts": n_facts,
            "presentations": presentations, "gap": gap, "filler_tokens": filler_tokens}


def should_advance(stage_accuracies: list[float], window: int = ADVANCE_WINDOW,
                   threshold: float = ADVANCE_ACCURACY) -> bool:
    """True once a stage has run at least `window` steps and the mean training recall accuracy of its last `window`
    steps is >= `threshold`. `stage_accuracies` holds only the current stage's steps, so a new stage must earn its
    own window before the next advance."""
    if window < 1:
        raise ValueError(f"window must be >= 1; received {window}.")
    if len(stage_accuracies) < window:
        return False
    # a tolerance of 1e-9: accuracies are ratios of small counts, and e.g. ten 1.0s and ten 0.7s average to
    # 0.8499999... in floating point, which must count as the 0.85 it is
    return float(np.mean(stage_accuracies[-window:])) >= threshold - 1e-9


def should_advance_every_template(stage_records: list[tuple[str, float]], window: int = ADVANCE_WINDOW,
                                  per_template_window: int = PER_TEMPLATE_WINDOW,
                                  threshold: float = ADVANCE_ACCURACY) -> bool:
    """should_advance on the stage's accuracies, and also every template seen in the stage has at least
    `per_template_window` steps whose last `per_template_window` average >= `threshold` (so one format that lags,
    hidden in the pooled mean, holds the stage back). `stage_records`: (template, accuracy) per step of the stage."""
    if not should_advance([acc for _, acc in stage_records], window, threshold):
        return False
    by_template: dict[str, list[float]] = {}
    for template, acc in stage_records:
        by_template.setdefault(template, []).append(acc)
    return all(len(accs) >= per_template_window and float(np.mean(accs[-per_template_window:])) >= threshold
               for accs in by_template.values())


def staged_learning_rate(step: int, peak: float = STAGED_LR, warmup: int = STAGED_WARMUP_STEPS) -> float:
    """Linear warmup, then constant (the staged run's length is not known in advance)."""
    return warmup_constant(step, peak, warmup)


def batch_losses(model: RecurrentLM, batch: dict, recall_weight: float = 1.0) -> dict:
    """LM loss on every next-token target in the batch; the recall loss: full-vocabulary cross-entropy of the answer
    at query_pos plus that of every re-presented value (each half of the weight); recall accuracy over the
    candidates at query_pos. loss = lm_loss + recall_weight * recall_loss."""
    tokens = batch["tokens"]
    logits = model(tokens)
    V = logits.shape[-1]
    lm = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), tokens[:, 1:].reshape(-1))
    rows = torch.arange(batch["n_recall"])
    at_query = logits[rows, batch["query_pos"]].float()
    recall = F.cross_entropy(at_query, batch["answer_id"])
    rows_r, pos_r, ids_r = batch["represented"]
    if len(pos_r):
        recall = 0.5 * recall + 0.5 * F.cross_entropy(logits[rows_r, pos_r].float(), ids_r)
    with torch.no_grad():
        cand = at_query.gather(1, batch["candidate_ids"])
        acc = (cand.argmax(1) == batch["answer_index"]).float().mean()
    return {"loss": lm + recall_weight * recall, "lm_loss": lm, "recall_loss": recall, "recall_acc": acc}


@torch.no_grad()
def evaluate(model: RecurrentLM, tokenizer, n_sources: int = EVAL["n_sources"],
             filler_tokens: int = EVAL["filler_tokens"], batch_size: int = 16, progress: bool = True) -> dict:
    """Clean recall on held-out sources: argmax over the 4 candidate logits at query_pos, per template, with a 95%
    source-bootstrap CI (and over all templates pooled per source)."""
    from tqdm import tqdm

    model.eval()
    per_template, all_correct, all_sources = {}, [], []
    for template in sorted(TEMPLATES):
        pairs = build_pairs(tokenizer, split=EVAL["split"], n_sources=n_sources, n_facts=EVAL["n_facts"],
                            presentations=EVAL["presentations"], filler_tokens=filler_tokens,
                            template=template, vocab=EVAL_VOCAB[template], seed=EVAL["seed"])
        correct = []
        for lo in tqdm(range(0, len(pairs), batch_size), desc=f"eval {template}", disable=not progress, leave=False):
            hi = min(lo + batch_size, len(pairs))
            logits = model(pairs.recipient_ids[lo:hi])
            at_query = logits[torch.arange(hi - lo), pairs.query_pos[lo:hi]]
            cand = at_query.gather(1, pairs.candidate_ids[lo:hi])
            correct += (cand.argmax(1) == pairs.recipient_answer_index[lo:hi]).tolist()
        correct = np.asarray(correct, dtype=float)
        src = pairs.source_id.numpy()
        ci = source_bootstrap_ci(correct, src)
        per_template[template] = {"vocab": EVAL_VOCAB[template], "accuracy": ci.estimate, "ci_low": ci.low,
                                  "ci_high": ci.high, "n_examples": ci.n_examples, "n_sources": ci.n_sources,
                                  "ci_method": ci.method, "seq_len": int(pairs.recipient_ids.shape[1])}
        all_correct.append(correct)
        all_sources.append(src)
    ci = source_bootstrap_ci(np.concatenate(all_correct), np.concatenate(all_sources))
    overall = {"accuracy": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "n_examples": ci.n_examples,
               "n_sources": ci.n_sources, "ci_method": ci.method}
    return {"setting": {**EVAL, "n_sources": n_sources, "filler_tokens": filler_tokens, "n_candidates": 4,
                        "chance": 0.25, "metric": "argmax over the 4 candidate logits at query_pos",
                        "ci": "95% source bootstrap (interp.stats.source_bootstrap_ci, BCa, seed 0)"},
            "per_template": per_template, "overall": overall}


def _logits_at(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, V) logits at one position per row: a model with `logit_positions` (the model protocol) computes only
    those (a full-vocabulary head at every position of a Qwen-vocabulary batch would need gigabytes)."""
    import inspect

    if "logit_positions" in inspect.signature(model.forward).parameters:
        return model(ids, logit_positions=positions)
    return model(ids)[torch.arange(len(ids)), positions]


@torch.no_grad()
def evaluate_layout(model, tokenizer, layout: str = "paper", n_sources: int = EVAL["n_sources"],
                    filler_tokens: Optional[int] = None, batch_size: int = 16, progress: bool = True,
                    vocab_map=None, vocabs: Optional[Sequence[str]] = None) -> dict:
    """Clean recall under a named layout (interp.data.layout.LAYOUTS) on held-out sources, one row per value
    vocabulary (the layout's template with each), pooled per source, 95% source-bootstrap CI. `vocab_map` (a
    compact_vocab.CompactVocabulary): the model reads and writes compact rows, so prompt and candidate ids are
    mapped to them (the candidate logits are the full model's; see compact_vocab). vocabs: only these value
    vocabularies (default every one)."""
    from tqdm import tqdm

    spec = LAYOUTS[layout]
    filler = spec.filler_tokens if filler_tokens is None else filler_tokens
    model.eval()
    per_vocab, all_correct, all_sources = {}, [], []
    for vocab in sorted(VALUE_VOCABS) if vocabs is None else list(vocabs):
        pairs = build_pairs(tokenizer, split=EVAL["split"], n_sources=n_sources, layout=layout,
                            filler_tokens=filler, vocab=vocab, seed=EVAL["seed"])
        ids, cands = pairs.recipient_ids, pairs.candidate_ids
        if vocab_map is not None:
            ids, cands = vocab_map.to_compact(ids), vocab_map.to_compact(cands)
        correct = []
        for lo in tqdm(range(0, len(pairs), batch_size), desc=f"eval {vocab}", disable=not progress, leave=False):
            hi = min(lo + batch_size, len(pairs))
            at_query = _logits_at(model, ids[lo:hi], pairs.query_pos[lo:hi])
            correct += (at_query.gather(1, cands[lo:hi]).argmax(1) == pairs.recipient_answer_index[lo:hi]).tolist()
        correct = np.asarray(correct, dtype=float)
        src = pairs.source_id.numpy()
        ci = source_bootstrap_ci(correct, src)
        per_vocab[vocab] = {"template": spec.template, "vocab": vocab, "accuracy": ci.estimate, "ci_low": ci.low,
                            "ci_high": ci.high, "n_examples": ci.n_examples, "n_sources": ci.n_sources,
                            "ci_method": ci.method, "seq_len": int(ids.shape[1]),
                            "dropped_values": sorted(pairs.report.get("dropped_values", {})),
                            "dropped_keys": sorted(pairs.report.get("dropped_keys", {}))}
        all_correct.append(correct)
        all_sources.append(src)
    ci = source_bootstrap_ci(np.concatenate(all_correct), np.concatenate(all_sources))
    overall = {"accuracy": ci.estimate, "ci_low": ci.low, "ci_high": ci.high, "n_examples": ci.n_examples,
               "n_sources": ci.n_sources, "ci_method": ci.method}
    return {"setting": {"layout": spec.to_dict(), "split": EVAL["split"], "n_sources": n_sources,
                        "n_facts": spec.n_facts, "presentations": spec.presentations, "filler_tokens": filler,
                        "seed": EVAL["seed"], "n_candidates": 4, "chance": 0.25,
                        "metric": "argmax over the 4 candidate logits at query_pos, one row per value vocabulary",
                        "ci": "95% source bootstrap (interp.stats.source_bootstrap_ci, BCa, seed 0)"},
            "per_template": per_vocab, "overall": overall}


def training_curve_markdown(log_path: Path, stage_names: Sequence[str]) -> str:
    """The training curve per curriculum stage from train_log.csv: steps, wall time, mean losses, training recall
    (whole stage / its last 20 steps) and, per template, the recall of the stage's last 40 steps of that template."""
    import pandas as pd

    log = pd.read_csv(log_path)
    templates = sorted(log["template"].dropna().unique())
    lines = ["| stage | steps | wall s (end) | lm_loss | recall_loss | recall_acc (all / last 20) | filler mean | "
             + " | ".join(templates) + " |", "|---" * (7 + len(templates)) + "|"]
    for k, g in log.groupby("stage"):
        per_t = [g[g["template"] == t]["recall_acc"].tail(40) for t in templates]
        lines.append(f"| {k} {stage_names[int(k)]} | {g.step.min()}-{g.step.max()} | {g.seconds.max():.0f} | "
                     f"{g.lm_loss.mean():.2f} | {g.recall_loss.mean():.2f} | {g.recall_acc.mean():.2f} / "
                     f"{g.recall_acc.tail(20).mean():.2f} | {g.filler_len.mean():.0f} | "
                     + " | ".join(f"{x.mean():.2f}" if len(x) else "" for x in per_t) + " |")
    return "\n".join(lines)


def _summary_markdown(name: str, summary: dict, log_path: Optional[Path] = None) -> str:
    ev = summary["eval"]
    s = ev["setting"]
    lines = [f"# {name}: clean recall", "",
             f"Held-out sources: {s['n_sources']}, K={s['n_facts']} facts, {s['presentations']} presentations, "
             f"F={s['filler_tokens']} filler tokens, 4 candidates (chance 25%). 95% source-bootstrap CI.", "",
             "| template | vocab | seq len | accuracy | 95% CI |", "|---|---|---|---|---|"]
    for t, r in ev["per_template"].items():
        lines.append(f"| {r.get('template', t)} | {r['vocab']} | {r['seq_len']} | {100 * r['accuracy']:.1f}% | "
                     f"[{100 * r['ci_low']:.1f}, {100 * r['ci_high']:.1f}] |")
    o = ev["overall"]
    lines.append(f"| all (pooled per source) | | | {100 * o['accuracy']:.1f}% | "
                 f"[{100 * o['ci_low']:.1f}, {100 * o['ci_high']:.1f}] |")
    lines += ["", f"- command: `{summary['command']}`", f"- seed: {summary['seed']}, steps: {summary['steps']}, "
              f"threads: {summary['threads']}", f"- training wall time: {summary['train_seconds']:.0f} s, "
              f"evaluation: {summary['eval_seconds']:.0f} s", f"- parameters: {summary['parameters']:,}",
              f"- final training losses (mean of last 20 steps): {summary['final_losses']}"]
    if "curriculum" in summary:
        c = summary["curriculum"]
        lines.append(f"- staged curriculum: reached stage {c['stage_reached']} ({c['stage_reached_name']}) of "
                     f"{len(c['stages']) - 1}; advances (step, stage): "
                     + (", ".join(f"{a['step']}->{a['name']}" for a in c["advances"]) or "none")
                     + f"; stopped by {summary['stopped_by']}")
        if c.get("early_templates"):
            lines.append(f"- binding stages 0-2 drew the templates {c['early_templates']}")
        if log_path is not None and Path(log_path).is_file():
            lines += ["", "Training curve per stage (training batches; recall over the 4 candidates; per-template "
                      "columns: the stage's last 40 steps of that template):", "",
                      training_curve_markdown(log_path, [st["name"] for st in c["stages"]])]
    if summary.get("smoke"):
        lines.append("- SMOKE RUN: a handful of steps and a reduced evaluation; these numbers mean nothing.")
    return "\n".join(lines) + "\n"


def final_recall_reached(stage_accs: Sequence[tuple[str, float]], threshold: Optional[float]) -> bool:
    """The --stop-recall rule on the last stage's (template, training recall) history."""
    if threshold is None or len(stage_accs) < FINAL_MIN_STEPS:
        return False
    return float(np.mean([acc for _, acc in stage_accs[-FINAL_WINDOW:]])) >= threshold - 1e-9


LOG_COLUMNS = ["step", "loss", "lm_loss", "recall_loss", "recall_acc", "filler_len", "gap", "seq_len", "template",
               "lr", "seconds"]


class RecallRecipe:
    """What every recall curriculum shares as a training recipe (experiments.training.Recipe): the losses of
    batch_losses on `model` and the logged batch fields. Subclasses choose the batches and the schedule."""

    extra_columns: list[str] = []

    def __init__(self, model, recall_weight: float, data_rng: random.Random):
        self.model, self.recall_weight, self.data_rng = model, recall_weight, data_rng

    @property
    def columns(self) -> list[str]:
        return LOG_COLUMNS + self.extra_columns

    def losses(self, batch: dict) -> dict:
        return batch_losses(self.model, batch, recall_weight=self.recall_weight)

    def row(self, batch: dict) -> dict:
        return {"filler_len": batch["filler_tokens"], "gap": batch["gap"], "seq_len": int(batch["tokens"].shape[1]),
                "template": batch["template"]}

    def finished(self) -> bool:
        return False

    def record(self, row: dict) -> None:
        pass

    def postfix(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {"data_rng": self.data_rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.data_rng.setstate(state["data_rng"])


class StagedCurriculum(RecallRecipe):
    """The STAGES curriculum: advance one stage once the training recall passes should_advance (or
    should_advance_every_template); `on_advance(stage_index, step)` runs before each advance (train() saves the
    weights that passed the stage under out/stages/)."""

    extra_columns = ["stage"]
    vocab_map = None   # a compact_vocab.CompactVocabulary: batches are mapped to its compact rows

    def __init__(self, model, tokenizer, data_rng: random.Random, stages: tuple[dict, ...],
                 start_stage: int, recall_rows: int, seed: int, peak_lr: float, focus_template: Optional[str],
                 advance_per_template: bool, early_templates: Optional[Sequence[str]], init_from: Optional[Path],
                 stop_recall: Optional[float] = None, recall_weight: float = 1.0, on_advance=None):
        super().__init__(model, recall_weight, data_rng)
        self.tokenizer, self.on_advance = tokenizer, on_advance
        self.stages, self.start_stage, self.stage_index = stages, start_stage, start_stage
        self.recall_rows, self.seed, self.peak_lr = recall_rows, seed, peak_lr
        self.focus_template, self.advance_per_template = focus_template, advance_per_template
        self.early_templates, self.init_from, self.stop_recall = early_templates, init_from, stop_recall
        self.stage_accs: list[tuple[str, float]] = []
        self.advances: list[dict] = []

    def learning_rate(self, step: int) -> float:
        return staged_learning_rate(step, self.peak_lr)

    def next_batch(self, step: int, history: list[dict], elapsed) -> dict:
        ready = (should_advance_every_template(self.stage_accs) if self.advance_per_template
                 else should_advance([acc for _, acc in self.stage_accs]))
        if self.stage_index + 1 < len(self.stages) and ready:
            if self.on_advance is not None:
                self.on_advance(self.stage_index, step)
            self.stage_index, self.stage_accs = self.stage_index + 1, []
            self.advances.append({"step": step, "stage": self.stage_index,
                                  "name": self.stages[self.stage_index]["name"], "seconds": round(elapsed(), 1)})
        batch = make_stage_batch(self.tokenizer, self.data_rng, step, self.stages[self.stage_index],
                                 n_recall=self.recall_rows, seed=self.seed, focus_template=self.focus_template)
        return batch if self.vocab_map is None else self.vocab_map.remap_batch(batch)

    def finished(self) -> bool:
        return self.stage_index == len(self.stages) - 1 and final_recall_reached(self.stage_accs, self.stop_recall)

    def record(self, row: dict) -> None:
        row["stage"] = self.stage_index
        self.stage_accs.append((row["template"], row["recall_acc"]))

    def postfix(self) -> dict:
        return {"stage": self.stage_index}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "stage_index": self.stage_index, "stage_accs": self.stage_accs,
                "advances": self.advances}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.stage_index, self.stage_accs, self.advances = state["stage_index"], state["stage_accs"], state["advances"]

    def summary(self, recall_weight: float) -> dict:
        return {
            "curriculum": {"kind": "staged", "stage_reached": self.stage_index,
                           "stage_reached_name": self.stages[self.stage_index]["name"], "advances": self.advances,
                           "stages": [{k: (v if v is not ALL else "all") for k, v in st.items()}
                                      for st in self.stages],
                           "early_templates": None if self.early_templates is None else list(self.early_templates),
                           "advance_rule": {"window": ADVANCE_WINDOW, "accuracy": ADVANCE_ACCURACY,
                                            "per_template_window": PER_TEMPLATE_WINDOW
                                            if self.advance_per_template else None},
                           "init_from": None if self.init_from is None else str(self.init_from),
                           "start_stage": self.start_stage, "focus_template": self.focus_template,
                           "focus_fraction": FOCUS_FRACTION if self.focus_template else None},
            "training": {"batch_recall_rows": self.recall_rows, "batch_filler_rows": BATCH_FILLER,
                         "recall_weight": recall_weight, "init_std": INIT_STD, "peak_lr": self.peak_lr,
                         "recall_rows": self.recall_rows, "schedule": f"linear warmup {STAGED_WARMUP_STEPS} steps, "
                         "then constant", "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP,
                         "qed_theta_lr_multiplier": QED_LR_MULTIPLIER, "split": "train"},
        }

    def meta(self) -> dict:
        return {"stage_reached": self.stage_index}


class RampCurriculum(RecallRecipe):
    """The original scheduled ramp (the recipe of the first bundled checkpoints): filler and gap ceilings grow with
    curriculum_progress, under the warmup-stable-decay learning rate."""

    gated = False

    def __init__(self, model, tokenizer, data_rng: random.Random, steps: int, recall_rows: int, seed: int,
                 peak_lr: float, filler_end: int, recall_weight: float = 1.0):
        super().__init__(model, recall_weight, data_rng)
        self.tokenizer, self.steps = tokenizer, steps
        self.recall_rows, self.seed, self.peak_lr, self.filler_end = recall_rows, seed, peak_lr, filler_end

    def learning_rate(self, step: int) -> float:
        return learning_rate(step, self.steps, self.peak_lr)

    def ceilings(self, step: int, history: list[dict]) -> tuple[int, int]:
        """The longest filler before the query and the longest gap between presentations at `step`."""
        return filler_ceiling(step, self.steps, end=self.filler_end), gap_ceiling(step, self.steps)

    def next_batch(self, step: int, history: list[dict], elapsed) -> dict:
        ceiling, max_gap = self.ceilings(step, history)
        filler_len = self.data_rng.randint(max(FILLER_START, ceiling // 2), ceiling)
        return make_batch(self.tokenizer, self.data_rng, step, filler_len, max_gap=max_gap,
                          n_recall=self.recall_rows, seed=self.seed, easy=self.easy())

    def easy(self) -> bool:
        return False

    def summary(self, recall_weight: float) -> dict:
        return {"training": {
            "batch_recall_rows": BATCH_RECALL, "batch_filler_rows": BATCH_FILLER,
            "filler_curriculum": [FILLER_START, self.filler_end, CURRICULUM_FRACTION, "quadratic"],
            "gap_curriculum": [GAP_START, GAP_RANGE[1]],
            "fact_counts": FACT_COUNTS, "presentation_counts": PRESENTATION_COUNTS,
            "gap_range": GAP_RANGE, "templates": sorted(TEMPLATES), "vocabs": sorted(VALUE_VOCABS),
            "init_std": INIT_STD, "peak_lr": self.peak_lr, "recall_rows": self.recall_rows,
            "gated_curriculum": self.gated,
            "gate": [GATE_WINDOW, GATE_ACCURACY, GATE_LEVELS, EASY_STAGE] if self.gated else None, "schedule": "WSD",
            "warmup": WARMUP_FRACTION, "decay": DECAY_FRACTION, "weight_decay": WEIGHT_DECAY, "grad_clip": GRAD_CLIP,
            "qed_theta_lr_multiplier": QED_LR_MULTIPLIER, "split": "train", "recall_weight": recall_weight}}

    def meta(self) -> dict:
        return {}


class GatedCurriculum(RampCurriculum):
    """The ramp, capped by a level that rises by 1/GATE_LEVELS only while the training recall of the last GATE_WINDOW
    steps is >= GATE_ACCURACY; level 0 trains on EASY_STAGE alone."""

    gated = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.level, self.since_level = 0.0, 0

    def ceilings(self, step: int, history: list[dict]) -> tuple[int, int]:
        recent = [r["recall_acc"] for r in history[-GATE_WINDOW:]]
        if self.since_level >= GATE_WINDOW and np.mean(recent) >= GATE_ACCURACY:
            self.level, self.since_level = min(1.0, self.level + 1.0 / GATE_LEVELS), 0
        self.since_level += 1
        progress_now = min(self.level, math.sqrt(curriculum_progress(step, self.steps))) ** 2
        ceiling = int(round(FILLER_START + (self.filler_end - FILLER_START) * progress_now))
        max_gap = int(round(GAP_START + (GAP_RANGE[1] - GAP_START) * progress_now))
        return ceiling, max_gap

    def easy(self) -> bool:
        return self.level == 0

    def state_dict(self) -> dict:
        return {**super().state_dict(), "level": self.level, "since_level": self.since_level}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.level, self.since_level = state["level"], state["since_level"]


def training_tokenizer(tokenizer_dir):
    """(tokenizer, vocab_map): the project's word tokenizer with no map, or a real tokenizer directory's tokenizer with
    the compact map of the task's and filler's token rows (experiments.compact_vocab)."""
    if tokenizer_dir is None:
        return build_word_tokenizer(), None
    from transformers import AutoTokenizer

    from experiments.compact_vocab import CompactVocabulary

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return tokenizer, CompactVocabulary.for_tokenizer(tokenizer)


def train(name: str, steps: Optional[int] = None, seed: int = 0, out: Optional[Path] = None, smoke: bool = False,
          threads: Optional[int] = None, progress: bool = True, command: Optional[str] = None,
          gated: bool = False, peak_lr: Optional[float] = None, recall_rows: Optional[int] = None,
          staged: Optional[bool] = None, max_minutes: Optional[float] = None,
          advance_per_template: bool = False, init_from: Optional[Path] = None, start_stage: int = 0,
          focus_template: Optional[str] = None,
          early_templates: Optional[Sequence[str]] = None,
          stop_recall: Optional[float] = None, tokenizer_dir: Optional[Path] = None,
          layout: str = "where_is", vocabs: Optional[Sequence[str]] = None) -> tuple[RecurrentLM, dict]:
    """Trains `name`, saves it with its tokenizer, log and evaluation into `out`; returns (model, summary).

    gated=True: the curriculum only advances while the training recall accuracy (mean of the last GATE_WINDOW steps)
    is at least GATE_ACCURACY, so the model first learns recall on short sequences; the scheduled ramp stays a cap
    (GatedCurriculum). staged=True (the default unless gated): the STAGES curriculum (StagedCurriculum, see
    should_advance); the weights at each advance are saved under out/stages/<k>-<name>/ so a run cut short keeps the
    furthest stage reached. staged=False without gated: the original scheduled ramp (RampCurriculum, the recipe of
    the first bundled checkpoints).
    advance_per_template: a staged advance also needs every template of the stage to pass on its own
    (should_advance_every_template).
    init_from: a checkpoint directory (e.g. a stage snapshot) whose weights replace the fresh init; start_stage: the
    STAGES index to begin at; focus_template: draw this template in FOCUS_FRACTION of the all-template batches;
    early_templates: the templates of the binding stages 0-2 (default is_in only; see staged_curriculum).
    max_minutes: training stops cleanly at the first step that would start after this wall-clock time; the model is
    then evaluated and saved as usual. A file named STOP in `out` stops it the same way.
    tokenizer_dir: a real tokenizer (e.g. GPT-2's, converted by tests/real_tokenizers.py) instead of the word-level
    one; the model is then trained over the task's rows of that vocabulary (compact_vocab) and saved compact under
    out/compact/, to be bundled at full vocabulary by `--bundle` (bundle_real_vocab). layout: the format trained and
    evaluated ("where_is": the five templates and train_tiny's evaluation; "paper": paper_curriculum and
    evaluate_layout), recorded in pair_layout.json. vocabs (layout "paper" only): the value vocabularies of every
    stage and of the evaluation (default: cities in the binding stages, then every one; evaluated on every one).
    """
    if vocabs is not None and layout != "paper":
        raise ValueError("vocabs applies to the paper layout's curriculum; pass layout='paper' or leave vocabs out.")
    if layout not in LAYOUT_CURRICULA:
        raise ValueError(f"layout must be one of {sorted(LAYOUT_CURRICULA)}; received {layout!r}.")
    if name not in ARCHITECTURES:
        raise ValueError(f"model must be one of {sorted(ARCHITECTURES)}; received {name!r}.")
    if gated and staged:
        raise ValueError("gated and staged are two different curricula; pass at most one of them.")
    staged = (not gated) if staged is None else bool(staged)
    if steps is None:
        steps = SMOKE_STEPS if smoke else (STAGED_MAX_STEPS if staged else DEFAULT_STEPS[name])
    steps = int(steps)
    peak_lr = (STAGED_LR if staged else PEAK_LR) if peak_lr is None else float(peak_lr)
    recall_rows = (STAGED_RECALL_ROWS if staged else BATCH_RECALL) if recall_rows is None else int(recall_rows)
    recall_weight = STAGED_RECALL_WEIGHT if staged else 1.0
    if threads is not None:
        torch.set_num_threads(int(threads))
    out = Path(out) if out is not None else CHECKPOINT_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    data_rng = random.Random(f"train-tiny/{name}/{seed}")

    tokenizer, vocab_map = training_tokenizer(tokenizer_dir)
    model = RecurrentLM(model_config(name, tokenizer, vocab_map))
    init_weights(model)
    if init_from is not None:
        from recurscope.interp.loading import load_model
        start = load_model(init_from)
        if start.cfg.to_dict() != model.cfg.to_dict():
            raise ValueError(f"init_from {init_from} holds a different architecture than {name}; pass a checkpoint "
                             f"of {name} (e.g. one of its stage snapshots).")
        model.load_state_dict(start.state_dict())
    stages = staged_curriculum(early_templates) if layout == "where_is" else paper_curriculum(vocabs)
    if not 0 <= start_stage < len(stages):
        raise ValueError(f"start_stage must be in [0, {len(stages) - 1}]; received {start_stage}.")
    model.set_backend("chunked")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(param_groups(model, peak_lr), lr=peak_lr, betas=(0.9, 0.95), eps=1e-8)
    filler_end = 64 if smoke else FILLER_END
    trained = model
    if vocab_map is not None:
        from experiments.compact_vocab import CompactLM

        trained = CompactLM(model, vocab_map)
    if staged:
        curriculum = StagedCurriculum(trained, tokenizer, data_rng, stages, start_stage, recall_rows, seed, peak_lr,
                                      focus_template, advance_per_template, early_templates, init_from,
                                      stop_recall, recall_weight,
                                      on_advance=lambda stage, step: _save_stage_snapshot(
                                          model, tokenizer, out, stage, step, stages, vocab_map))
        curriculum.vocab_map = vocab_map
    else:
        curriculum = (GatedCurriculum if gated else RampCurriculum)(model, tokenizer, data_rng, steps, recall_rows,
                                                                    seed, peak_lr, filler_end, recall_weight)

    log_path = out / "train_log.csv"
    resume_key = {"model": name, "seed": seed, "steps": steps, "smoke": smoke, "gated": gated, "staged": staged,
                  "peak_lr": peak_lr, "recall_rows": recall_rows, "init_from": None if init_from is None
                  else str(init_from), "start_stage": start_stage, "focus_template": focus_template,
                  "early_templates": None if early_templates is None else list(early_templates),
                  "advance_per_template": advance_per_template, "stop_recall": stop_recall}
    # max_minutes is not part of the run's identity: a run resumed with a larger limit continues (the limit counts
    # training time over all resumed runs, as in train_tiny_hf)
    if tokenizer_dir is not None or layout != "where_is":
        resume_key.update(tokenizer_dir=None if tokenizer_dir is None else str(tokenizer_dir), layout=layout)
    if vocabs is not None:
        resume_key["vocabs"] = list(vocabs)
    from tqdm import tqdm

    bar = tqdm(total=steps, desc=f"train {name}", disable=not progress)

    def show(row: dict) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.3f}", recall=f"{row['recall_loss']:.3f}", acc=f"{row['recall_acc']:.2f}",
                        F=row["filler_len"], **curriculum.postfix())

    loop = train_loop(model, optimizer, curriculum, steps=steps, run_dir=out, grad_clip=GRAD_CLIP, name=name,
                      max_minutes=max_minutes, resume_key=resume_key, resume_every=RESUME_EVERY, on_row=show)
    bar.close()
    history, stopped, train_seconds = loop.history, loop.stopped_by, loop.seconds
    steps_done = len(history)
    model.eval()
    if vocab_map is None:
        model.tokenizer = tokenizer

    tail = history[-20:]
    final = {k: round(float(np.mean([r[k] for r in tail])), 4) for k in ("loss", "lm_loss", "recall_loss", "recall_acc")}
    t1 = time.time()
    if layout == "where_is" and vocab_map is None:
        ev = evaluate(model, tokenizer, n_sources=4 if smoke else EVAL["n_sources"],
                      filler_tokens=32 if smoke else EVAL["filler_tokens"], progress=progress)
    else:
        ev = evaluate_layout(trained, tokenizer, layout, n_sources=4 if smoke else EVAL["n_sources"],
                             filler_tokens=32 if smoke else None, progress=progress, vocab_map=vocab_map,
                             vocabs=vocabs)
    eval_seconds = time.time() - t1
    summary = {"model": name, "command": command or f"python -m experiments.train_tiny --model {name}",
               "seed": seed, "steps": steps_done, "max_steps": steps, "max_minutes": max_minutes,
               "stopped_by": stopped, "threads": torch.get_num_threads(), "smoke": smoke,
               "train_seconds": round(train_seconds, 1), "eval_seconds": round(eval_seconds, 1),
               "parameters": n_params, "final_losses": final, "eval": ev}
    summary.update(curriculum.summary(recall_weight))
    if loop.skipped_steps:
        summary["skipped_steps"] = loop.skipped_steps
    if vocab_map is not None:
        summary["vocabulary"] = real_vocab_summary(tokenizer_dir, vocab_map)
    summary["layout"] = layout
    if vocabs is not None:
        summary["vocabs"] = list(vocabs)
    meta = {k: summary[k] for k in ("model", "command", "seed", "steps", "train_seconds", "parameters", "smoke")}
    meta["clean_recall_k4_f512"] = ev["overall"]["accuracy"]
    meta["layout"] = layout
    meta.update(curriculum.meta())
    if vocab_map is None:
        save_model(model, out, extra_config={"recurscope": meta})
        save_word_tokenizer(tokenizer, out)
    else:   # compact weights and their rows; --bundle writes the full-vocabulary checkpoint
        save_compact(model, vocab_map, tokenizer_dir, out / "compact", meta)
    (out / "eval_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The layout the model is evaluated on (where_is: is_in at 4 x 3, 512 filler; paper: key_value), which the CLI
    # then uses.
    (out / LAYOUT_FILE).write_text(json.dumps(LAYOUTS[layout].to_dict(), indent=1) + "\n")
    (out / "eval_summary.md").write_text(_summary_markdown(name, summary, log_path))
    finish_run(out)
    return model, summary


def _save_stage_snapshot(model: RecurrentLM, tokenizer, out: Path, stage_index: int, step: int,
                         stages: Sequence[dict] = STAGES, vocab_map=None) -> Path:
    """Saves the weights that passed stage `stage_index` (loadable like any checkpoint; compact ones with
    `--bundle`) under out/stages/."""
    path = out / "stages" / f"{stage_index}-{stages[stage_index]['name']}"
    meta = {"stage_passed": stage_index, "stage_name": stages[stage_index]["name"], "step": step}
    if vocab_map is not None:
        save_compact(model, vocab_map, None, path, meta)
        model.train()
        return path
    save_model(model, path, extra_config={"recurscope": meta})
    save_word_tokenizer(tokenizer, path)
    model.train()  # in case saving switched modes
    return path


COMPACT_ROWS_FILE = "compact_rows.json"


def real_vocab_summary(tokenizer_dir, vocab_map) -> dict:
    return {"tokenizer_dir": None if tokenizer_dir is None else str(tokenizer_dir),
            "full_size": vocab_map.full_size, "task_rows": len(vocab_map.full_ids), "n_other": vocab_map.n_other,
            "other_logit_offset": round(vocab_map.other_offset, 6), "tokens_mapped_to_other_in_training":
            vocab_map.unmapped}


def save_compact(model: RecurrentLM, vocab_map, tokenizer_dir, path: Path, meta: dict) -> Path:
    """The compact model (config.json and model.safetensors over the compact rows) and compact_rows.json: which
    token each row is, the vocabulary size and the tokenizer it was trained with."""
    save_model(model, path, extra_config={"recurscope": meta})
    (Path(path) / COMPACT_ROWS_FILE).write_text(json.dumps(
        {**real_vocab_summary(tokenizer_dir, vocab_map), "full_ids": vocab_map.full_ids}) + "\n")
    return Path(path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(ARCHITECTURES) + ["all"])
    parser.add_argument("--rewrite-summary", type=Path, default=None, metavar="DIR",
                        help="only rewrite DIR/eval_summary.md from its eval_summary.json and train_log.csv")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: per model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="checkpoint dir (default interp/checkpoints/<name>)")
    parser.add_argument("--smoke", action="store_true", help="a handful of steps and a tiny evaluation")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.add_argument("--gated", action="store_true", help="advance the curriculum only once recall is learned")
    parser.add_argument("--ramp", action="store_true",
                        help="the original scheduled filler ramp (500 steps, lr 3e-3) instead of the staged curriculum")
    parser.add_argument("--advance-per-template", action="store_true",
                        help="staged: advance only when every template of the stage also passes on its own")
    parser.add_argument("--init-from", type=Path, default=None, help="start from this checkpoint's weights")
    parser.add_argument("--start-stage", type=int, default=0, help="staged: the STAGES index to begin at")
    parser.add_argument("--focus-template", default=None, choices=sorted(TEMPLATES),
                        help="staged: draw this template in half of the all-template batches")
    parser.add_argument("--early-templates", default=None,
                        help="staged: comma-separated templates for the binding stages 0-2 (default is_in); the "
                             "bundled models since tiny-gla's retraining use belongs")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="stop training after this many wall-clock minutes, then evaluate and save")
    parser.add_argument("--stop-recall", type=float, default=None, metavar="R",
                        help=f"staged: stop once the last stage has run {FINAL_MIN_STEPS} steps and its last "
                             f"{FINAL_WINDOW} training batches average recall >= R (then evaluate and save)")
    parser.add_argument("--lr", type=float, default=None,
                        help=f"peak learning rate (default {STAGED_LR}; {PEAK_LR} with --ramp/--gated)")
    parser.add_argument("--recall-rows", type=int, default=None,
                        help=f"recall rows per step (default {STAGED_RECALL_ROWS}; {BATCH_RECALL} with --ramp/--gated)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="a real tokenizer (tokenizer.json) instead of the word-level one: the model is trained "
                             "over the task's rows of its vocabulary (experiments/compact_vocab.py)")
    parser.add_argument("--layout", choices=sorted(LAYOUT_CURRICULA), default="where_is",
                        help="the prompt format trained and evaluated (paper: key_value, one-token query)")
    parser.add_argument("--vocabs", default=None,
                        help="--layout paper: comma-separated value vocabularies of every stage and of the evaluation "
                             "(default: cities in the binding stages, then every one)")
    args = parser.parse_args(argv)
    if args.rewrite_summary is not None:  # eval_summary.md again from a run's eval_summary.json and train_log.csv
        d = args.rewrite_summary
        summary = json.loads((d / "eval_summary.json").read_text())
        (d / "eval_summary.md").write_text(_summary_markdown(summary["model"], summary, d / "train_log.csv"))
        print(f"rewrote {d / 'eval_summary.md'}")
        return 0
    if args.ramp and args.gated:
        parser.error("--ramp and --gated are alternative curricula to the staged default; pass at most one.")
    if args.model is None:
        parser.error("--model is required (unless --rewrite-summary)")
    staged = not (args.ramp or args.gated)
    names = sorted(ARCHITECTURES) if args.model == "all" else [args.model]
    command = "python -m experiments.train_tiny " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    for name in names:
        if args.out is None:
            out = CHECKPOINT_DIR / name
        else:
            out = args.out / name if len(names) > 1 else args.out
        _, summary = train(name, steps=args.steps, seed=args.seed, out=out, smoke=args.smoke, threads=args.threads,
                           progress=not args.no_progress, command=command, gated=args.gated, peak_lr=args.lr,
                           recall_rows=args.recall_rows, staged=staged, max_minutes=args.max_minutes,
                           advance_per_template=args.advance_per_template, init_from=args.init_from,
                           start_stage=args.start_stage, focus_template=args.focus_template,
                           stop_recall=args.stop_recall, tokenizer_dir=args.tokenizer, layout=args.layout,
                           vocabs=None if args.vocabs is None else [v.strip() for v in args.vocabs.split(",")],
                           early_templates=None if args.early_templates is None
                           else [t.strip() for t in args.early_templates.split(",") if t.strip()])
        o = summary["eval"]["overall"]
        print(f"{name}: clean recall {100 * o['accuracy']:.1f}% [{100 * o['ci_low']:.1f}, {100 * o['ci_high']:.1f}] "
              f"after {summary['steps']} steps, {summary['train_seconds']:.0f} s; saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
