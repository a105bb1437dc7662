"""Peak memory of NIAH candidate scoring (`NiahBatch.candidate_loglik`) at Qwen3.5's vocabulary (V = 248,077),
against the prompt length T and the scoring batch size, the scorer before issue 41 and today's side by side.

    old   forward(ids) -> logits (B, T + m, V) over every position, then a float64 log-softmax over all of them
          (the scorer as it was: memory grows with B x T x V)
    new   forward(ids, logit_positions) -> logits (B, m, V) at the m answer positions only, the picked logits and
          log-normalisers accumulated in float32 (data.scoring.sequence_loglik): memory grows with B x m x V

The model is a random 1-layer GLA (interp.models.RecurrentLM, hidden 64) with V = 248,077, so its LM head and
embedding are Qwen3.5's width and everything else is small; each batch holds `--examples` prompts of T random ids,
4 candidates each, every candidate 3 tokens (Qwen's " 42": a space token and two digits). Each (scorer, T, batch)
runs in its own process; the figure is that process's peak resident memory (ru_maxrss) above its peak before the
call (the model and the batch built, nothing scored). Where the old scorer's predicted size B x (T + m) x V x 20
bytes (float32 logits, their float64 copy and the float64 log-softmax) is over --old-limit-gb it is not run and the
prediction is printed instead. Both scorers' log-likelihoods are compared on every configuration that runs both.

Usage:  python -m experiments.bench.niah_memory [--lengths 64 512 4096] [--batch-sizes 1 8 32] [--examples 8]
            [--old-limit-gb 3]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

VOCAB = 248_077
ANSWER_TOKENS = 3
CHOICES = 4


def old_candidate_loglik(batch, forward, batch_size: int) -> torch.Tensor:
    """The scorer before issue 41, kept here only to be measured: full logits, float64 log-softmax over (B, T, V)."""
    n, c = batch.choices.shape
    seqs, owners = [], []
    for i in range(n):
        for slot in range(c):
            seqs.append(batch.input_ids[i].tolist() + batch.candidate_tokens[int(batch.choices[i, slot])])
            owners.append((i, slot))
    loglik = torch.zeros(n, c, dtype=torch.float64)
    prompt = batch.input_ids.shape[1]
    for lo in range(0, len(seqs), batch_size):
        chunk = seqs[lo:lo + batch_size]
        width = max(len(x) for x in chunk)
        ids = torch.tensor([x + [x[-1]] * (width - len(x)) for x in chunk], dtype=torch.long)
        with torch.no_grad():
            logp = torch.log_softmax(forward(ids).double(), dim=-1)
        for row, seq in enumerate(chunk):
            i, slot = owners[lo + row]
            tokens = torch.tensor(seq[prompt:], dtype=torch.long)
            positions = torch.arange(prompt - 1, prompt - 1 + len(tokens))
            loglik[i, slot] = logp[row, positions, tokens].sum().cpu()
    return loglik


def build(length: int, examples: int):
    from recurscope.interp.data.niah import NiahBatch
    from recurscope.interp.models import ModelConfig, RecurrentLM

    torch.manual_seed(0)
    model = RecurrentLM(ModelConfig.from_dict(dict(model_type="gla", vocab_size=VOCAB, hidden_size=64,
                                                   num_hidden_layers=1, num_heads=2))).eval()
    gen = torch.Generator().manual_seed(1)
    numbers = 10
    candidate_tokens = [[220, 15 + a, 15 + b] for a, b in zip(range(numbers), reversed(range(numbers)))]
    choices = torch.stack([torch.randperm(numbers, generator=gen)[:CHOICES] for _ in range(examples)])
    zeros = torch.zeros(examples, dtype=torch.long)
    batch = NiahBatch(
        input_ids=torch.randint(0, VOCAB, (examples, length), generator=gen), answer_ids=zeros, answer_index=zeros,
        candidate_ids=torch.zeros(numbers, dtype=torch.long), needle_span=torch.zeros(examples, 2, dtype=torch.long),
        value_pos=zeros, query_start=zeros, query_pos=torch.full((examples,), length - 1), depth=zeros.float(),
        actual_depth=zeros.float(), candidates=[str(i) for i in range(numbers)], keys=[""] * examples,
        values=[""] * examples, candidate_tokens=candidate_tokens, choices=choices, choice_answer=zeros)
    return model, batch


def measure(scorer: str, length: int, batch_size: int, examples: int) -> dict:
    """One configuration in this process: peak RSS above the peak before scoring, and the log-likelihoods."""
    torch.set_num_threads(1)
    model, batch = build(length, examples)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if scorer == "old":
        loglik = old_candidate_loglik(batch, model, batch_size)
    else:
        loglik = batch.candidate_loglik(model, batch_size=batch_size)["loglik"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - before) / 1024, "loglik": loglik.flatten().tolist()}


def predicted_old_gib(length: int, batch_size: int) -> float:
    return batch_size * (length + ANSWER_TOKENS) * VOCAB * 20 / 2 ** 30


def run(scorer: str, length: int, batch_size: int, examples: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "experiments.bench.niah_memory", "--one", scorer, str(length),
                          str(batch_size), str(examples)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--examples", type=int, default=8, help="prompts per batch (each scored on 4 candidates)")
    p.add_argument("--old-limit-gb", type=float, default=3.0, help="run the old scorer only where it is predicted "
                   "to need at most this many GiB")
    p.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        scorer, length, batch_size, examples = args.one
        print(json.dumps(measure(scorer, int(length), int(batch_size), int(examples))))
        return
    print(f"V = {VOCAB}, {args.examples} prompts x {CHOICES} candidates of {ANSWER_TOKENS} tokens; peak RSS above "
          "the loaded model, MiB")
    print("| T | batch | old (measured, or predicted) | new | old / new | max abs difference |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        for batch_size in args.batch_sizes:
            new = run("new", length, batch_size, args.examples)
            guess = predicted_old_gib(length, batch_size)
            if guess <= args.old_limit_gb:
                old = run("old", length, batch_size, args.examples)
                diff = max(abs(a - b) for a, b in zip(old["loglik"], new["loglik"]))
                old_text, ratio, diff_text = (f"{old['peak_mib']:.0f}", f"{old['peak_mib'] / max(new['peak_mib'], 1):.0f}x",
                                              f"{diff:.1e}")
            else:
                old_text, ratio, diff_text = f"not run (predicted {guess * 1024:.0f})", "–", "–"
            print(f"| {length} | {batch_size} | {old_text} | {new['peak_mib']:.0f} | {ratio} | {diff_text} |",
                  flush=True)


if __name__ == "__main__":
    main()
