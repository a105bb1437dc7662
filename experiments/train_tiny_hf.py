"""How the bundled transformers-format tiny checkpoints were made: `tiny-qwen35`, a Qwen3.5-architecture hybrid (3
Gated DeltaNet layers, then 1 gated full-attention layer, Qwen3.5's 3:1 pattern with the attention last), and
`tiny-nemotronh`, a Nemotron-H hybrid (Mamba-2, MLP, Mamba-2, attention, MLP blocks), each trained on a CPU with the
staged recall curriculum of experiments/train_tiny.py, then scored on held-out recall at K=4, F=512.

The models are transformers' own classes on their PyTorch path (transformers would otherwise dispatch to fla's or
mamba_ssm's Triton kernels); the batches, losses, stage rule and evaluation are train_tiny's.

Usage:  python -m experiments.train_tiny_hf --model tiny-qwen35 --out runs/tiny-qwen35 [--max-minutes M] [--steps N]
                                            [--seed S] [--stop-recall R] [--bundle]
The run is resumable: it writes out/resume.pt every few minutes and continues from it when started again with
the same --out (--max-minutes counts training time over all resumed runs).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from experiments import train_tiny as tt  # the curriculum, losses and evaluation
from experiments.training import train_loop

from recurscope.interp.bridge.torch_path import use_torch_path
from recurscope.interp.data.layout import LAYOUT_FILE, LAYOUTS
from recurscope.interp.data import build_word_tokenizer, save_word_tokenizer
from recurscope.interp.loading import CHECKPOINT_DIR

#: name -> (transformers config class, causal-LM class, config arguments). The special token ids and the vocabulary
#: come from the word tokenizer.
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "tiny-qwen35": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        hidden_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02, max_position_embeddings=4096)),
    # Nemotron-H's block pattern in small (Mamba-2 and attention mixers each in a block of its own, MLP-only blocks
    # between them): Mamba-2 with 8 heads of 32 channels, states 32 x 32 (N x P), B and C in one group; attention
    # with 4 heads of 32 and no position encoding (Nemotron-H has none), so positions come from the Mamba-2 layers.
    "tiny-nemotronh": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hidden_size=128, layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp"], mamba_num_heads=8,
        mamba_head_dim=32, ssm_state_size=32, n_groups=1, conv_kernel=4, chunk_size=64, num_attention_heads=4,
        num_key_value_heads=4, head_dim=32, intermediate_size=256, tie_word_embeddings=False,
        initializer_range=0.02, rescale_prenorm_residual=False, max_position_embeddings=4096)),
}
ARCHITECTURE = ARCHITECTURES["tiny-qwen35"][2]
EARLY_TEMPLATES = ("belongs",)        # as tiny-gdn-hybrid: a value-before-key format from the start
RESUME_EVERY = 100                    # steps between resume points (out/resume.pt)


def build_model(tokenizer, name: str = "tiny-qwen35", vocab_map=None):
    """A freshly initialised model of architecture `name` (see init_weights), over the compact rows of `vocab_map`
    when given (experiments/compact_vocab.py)."""
    import transformers

    if name not in ARCHITECTURES:
        raise ValueError(f"model must be one of {sorted(ARCHITECTURES)}; received {name!r}.")
    config_class, model_class, arch = ARCHITECTURES[name]
    ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    size = len(tokenizer)
    if vocab_map is not None:
        ids = {k: vocab_map.compact_id(v) for k, v in ids.items()}
        size = vocab_map.size
    cfg = getattr(transformers, config_class)(vocab_size=size, **ids, **arch)
    model = getattr(transformers, model_class)(cfg)
    init_weights(model)
    return model


def init_weights(model, std: float = tt.INIT_STD) -> None:
    """train_tiny's recipe on transformers' modules: GPT-style N(0, std) for every Linear and the embedding, the
    residual writers (o_proj, out_proj, down_proj) shrunk by sqrt(2 * layers), and long-memory decays as
    train_tiny._long_memory_gates sets them: Gated DeltaNet A_log = 0, dt spread over 1e-3 .. 4e-2 (horizons of ~25
    to ~1000 tokens); Mamba-2 (the mixers with a D skip) dt = 0.5, which also scales its write, A spreading the
    log-decays dt A over the same range, and torch's Conv1d init for the conv. With transformers' N(0, 0.02) conv the
    recall gradient reaching B's and C's in_proj rows was 4e-4 of x's (0.14 / 0.11 with torch's), and the first
    tiny-nemotronh run sat at 0.5 training recall (two facts, stage 0) for 700 steps. transformers' own decays
    (A_log ~ log U(0.01, 16)) forget within a few tokens, and the first tiny-qwen35 run with them stayed at chance
    recall (25%) after 2249 steps."""
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
                if name.endswith(("o_proj", "out_proj", "down_proj")):
                    module.weight.div_(math.sqrt(2 * n_layers))
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, std)
            if hasattr(module, "A_log") and hasattr(module, "dt_bias") and hasattr(module, "D"):   # Mamba-2
                tt._long_memory_gates(module)   # the native Mamba-2's recipe: the same parameter names
            elif hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.zero_()
                n = module.dt_bias.numel()
                dt = torch.logspace(math.log10(1e-3), math.log10(4e-2), n)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))   # inverse softplus


class Logits(torch.nn.Module):
    """tokens -> logits, the call train_tiny's losses and evaluation make."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, tokens):
        return self.hf(input_ids=tokens, use_cache=False).logits


def train(out: Path, steps: int = 100_000, seed: int = 0, max_minutes: Optional[float] = None,
          threads: int = 1, command: str = "", stop_recall: Optional[float] = None, name: str = "tiny-qwen35",
          tokenizer_dir: Optional[Path] = None, layout: str = "where_is", vocabs=None) -> dict:
    """train_tiny's staged curriculum (per-template advances, belongs early) on transformers' modules of
    architecture `name`, through the shared loop; resumable from out/resume.pt, the finished model in out/model.

    tokenizer_dir and layout as in train_tiny.train: with a real tokenizer the model is trained over the task's rows
    of its vocabulary and saved compact in out/compact (bundled at full vocabulary by `train_tiny --bundle`); with
    layout "paper", train_tiny.paper_curriculum and evaluate_layout (vocabs: as train_tiny.train's)."""
    if layout not in tt.LAYOUT_CURRICULA:
        raise ValueError(f"layout must be one of {sorted(tt.LAYOUT_CURRICULA)}; received {layout!r}.")
    torch.set_num_threads(threads)
    use_torch_path()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer, vocab_map = tt.training_tokenizer(tokenizer_dir)
    torch.manual_seed(seed)
    hf = build_model(tokenizer, name, vocab_map)
    model = Logits(hf)
    if vocab_map is not None:
        from experiments.compact_vocab import CompactLM

        model = CompactLM(model, vocab_map)
    optimizer = torch.optim.AdamW(tt.param_groups(model, tt.STAGED_LR), lr=tt.STAGED_LR, betas=(0.9, 0.95), eps=1e-8)
    stages = tt.staged_curriculum(EARLY_TEMPLATES) if layout == "where_is" else tt.paper_curriculum(vocabs)
    data_rng = random.Random(f"train-tiny/{name}/{seed}")
    curriculum = tt.StagedCurriculum(model, tokenizer, data_rng, stages, 0, tt.STAGED_RECALL_ROWS, seed, tt.STAGED_LR,
                                     None, True, EARLY_TEMPLATES, None, stop_recall, tt.STAGED_RECALL_WEIGHT)
    curriculum.vocab_map = vocab_map
    key = {"model": name, "seed": seed, "stop_recall": stop_recall}
    if tokenizer_dir is not None or layout != "where_is":
        key.update(tokenizer_dir=None if tokenizer_dir is None else str(tokenizer_dir), layout=layout)
    if vocabs is not None:
        key["vocabs"] = list(vocabs)

    def announce(row: dict) -> None:
        if curriculum.advances and curriculum.advances[-1]["step"] == row["step"]:
            print(f"step {row['step']}: stage {row['stage']} {stages[row['stage']]['name']}", flush=True)

    model.train()
    loop = train_loop(model, optimizer, curriculum, steps=steps, run_dir=out, grad_clip=tt.GRAD_CLIP, name=name,
                      max_minutes=max_minutes, resume_key=key,
                      resume_every=RESUME_EVERY, on_row=announce)
    history = loop.history
    model.eval()
    t1 = time.time()
    if layout == "where_is" and vocab_map is None:
        ev = tt.evaluate(model, tokenizer, progress=False)
    else:
        ev = tt.evaluate_layout(model, tokenizer, layout, progress=False, vocab_map=vocab_map, vocabs=vocabs)
    tail = history[-20:]
    final = {k: round(float(np.mean([r[k] for r in tail])), 4) for k in ("loss", "lm_loss", "recall_loss", "recall_acc")}
    summary = {"model": name, "command": command, "seed": seed, "steps": len(history), "max_steps": steps,
               "max_minutes": max_minutes, "stopped_by": loop.stopped_by, "threads": threads, "smoke": False,
               "train_seconds": round(loop.seconds, 1), "eval_seconds": round(time.time() - t1, 1),
               "parameters": sum(p.numel() for p in hf.parameters()), "final_losses": final, "eval": ev,
               "curriculum": {"kind": "staged", "stage_reached": curriculum.stage_index,
                              "stage_reached_name": stages[curriculum.stage_index]["name"],
                              "advances": curriculum.advances,
                              "stages": [{k: (v if v is not tt.ALL else "all") for k, v in st.items()} for st in stages],
                              "early_templates": list(EARLY_TEMPLATES) if layout == "where_is" else None},
               "architecture": ARCHITECTURES[name][2], "layout": layout, "vocabs": vocabs}
    if loop.skipped_steps:
        summary["skipped_steps"] = loop.skipped_steps
    if vocab_map is not None:   # compact weights and their rows; train_tiny --bundle writes the full checkpoint
        summary["vocabulary"] = tt.real_vocab_summary(tokenizer_dir, vocab_map)
        compact = out / "compact"
        hf.save_pretrained(compact)
        (compact / tt.COMPACT_ROWS_FILE).write_text(json.dumps(
            {**summary["vocabulary"], "full_ids": vocab_map.full_ids}) + "\n")
        (out / "eval_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / LAYOUT_FILE).write_text(json.dumps(LAYOUTS[layout].to_dict(), indent=1) + "\n")
        (out / "eval_summary.md").write_text(tt._summary_markdown(name, summary, out / "train_log.csv"))
        return summary
    final_dir = out / "model"
    hf.save_pretrained(final_dir)
    save_word_tokenizer(tokenizer, final_dir)
    (final_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # The layout the model is evaluated on (EVAL: where_is, is_in at 4 x 3, 512 filler), which the CLI then uses.
    (final_dir / LAYOUT_FILE).write_text(json.dumps(LAYOUTS["where_is"].to_dict(), indent=1) + "\n")
    (final_dir / "eval_summary.md").write_text(tt._summary_markdown(name, summary, out / "train_log.csv"))
    shutil.copy(out / "train_log.csv", final_dir / "train_log.csv")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(ARCHITECTURES), default="tiny-qwen35")
    p.add_argument("--out", type=Path, default=None, help="run directory (default runs/<model>)")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stop-recall", type=float, default=None, metavar="R", help="as train_tiny.py --stop-recall")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR", help="as train_tiny.py --tokenizer")
    p.add_argument("--layout", choices=sorted(tt.LAYOUT_CURRICULA), default="where_is", help="as train_tiny.py --layout")
    p.add_argument("--vocabs", default=None, help="as train_tiny.py --vocabs")
    p.add_argument("--bundle", action="store_true", help=f"copy out/model to {CHECKPOINT_DIR}/<model> when done")
    args = p.parse_args(argv)
    name = args.model
    out = Path("runs") / name if args.out is None else args.out
    summary = train(out, args.steps, args.seed, args.max_minutes, args.threads,
                    command="python -m experiments.train_tiny_hf " + " ".join(argv or sys.argv[1:]),
                    stop_recall=args.stop_recall, name=name, tokenizer_dir=args.tokenizer, layout=args.layout,
                    vocabs=None if args.vocabs is None else [v.strip() for v in args.vocabs.split(",")])
    o = summary["eval"]["overall"]
    print(f"{name}: clean recall {100 * o['accuracy']:.1f}% [{100 * o['ci_low']:.1f}, {100 * o['ci_high']:.1f}] "
          f"on {o['n_sources']} held-out sources after {summary['steps']} steps", flush=True)
    if args.bundle and args.tokenizer is None:
        shutil.copytree(out / "model", CHECKPOINT_DIR / name, dirs_exist_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
