"""Evaluation and training tasks of the QED suite, sized in tokens, each a pure function of (split, seed, length).

- Retrieval (`RetrievalSpec`), RULER S-NIAH analogues: needles "the special magic number for KEY is VALUE." in a
  haystack; the query names one key. `sniah1` is S-NIAH-1 (repeated noise sentences, one needle, one-token value),
  the task of the earlier runs. The harder variants put the needles in generated filler text (S-NIAH-2's essay-like
  haystack), add distractor needles with other keys (multi-key NIAH) and use two-number values (8,100 values, two
  tokens each, S-NIAH-3's multi-token values). A multi-token answer is scored under teacher forcing: correct when
  every value token is the argmax over the number tokens at its position.
- Document recall (`doc`, FDA/SWDE-like): a short semi-structured document of records "record KEY . city : Paris .
  colour : red ...", separated by filler; the query asks one field of one record.
- Comprehension (`qa`, SQuAD-like control): facts stated in prose inside filler ("Alice lives in Paris."), a question
  phrased with other words ("question : which city is home to Alice ? answer :").

Splits: an item's identity is (queried key, answer value). `item_split` assigns every identity to exactly one of
train / dev / eval by a stable hash, and each generator only emits items of its split, so dev (where the task was
chosen) and evaluation items never coincide; the filler haystacks come from the filler generator's matching split.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from recurscope.interp.data import FillerSource, encode_continuation
from recurscope.interp.data.niah import NEEDLE, NIAH_QUERY, NOISE_SENTENCES
from recurscope.interp.data.words import KEY_NAMES, NUMBER_WORDS, VALUE_VOCABS

SPLITS = ("train", "dev", "eval")
#: filler split feeding each task split's haystacks (interp.data.filler.SPLITS)
FILLER_SPLIT = {"train": "train", "dev": "dev", "eval": "heldout"}
#: the document fields and their value vocabularies (single words, disjoint, reserved from filler)
FIELDS = {"city": "cities", "colour": "colours", "shape": "shapes", "animal": "animals", "instrument": "instruments",
          "fruit": "fruits"}
#: comprehension: the fact as stated in the passage, and the question that asks for it in other words
FACTS = {"city": ("{key} lives in {value} .", "which city is home to {key} ?"),
         "colour": ("{key} painted the door {value} .", "what colour is the door of {key} ?"),
         "animal": ("{key} keeps a {value} .", "which pet belongs to {key} ?"),
         "instrument": ("{key} plays the {value} .", "what does {key} perform on ?"),
         "fruit": ("{key} grows {value} trees .", "what fruit comes from the garden of {key} ?")}


def task_words() -> list[str]:
    """Words the document and comprehension tasks add to the word tokenizer (build_word_tokenizer(extra_words))."""
    text = " ".join(["record question answer :"] + list(FIELDS) + [f + " " + q for f, q in FACTS.values()])
    return sorted({w for w in text.replace("{key}", " ").replace("{value}", " ").split()})


def _stable_int(text: str, modulus: int) -> int:
    """A hash of `text` in [0, modulus), the same in every process (Python's str hash is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % modulus


def item_split(key: str, value: Sequence[str]) -> str:
    """train (70%), dev (10%) or eval (20%) for an item identity, by a stable hash."""
    bucket = _stable_int(f"{key}|{' '.join(value)}", 10)
    return "dev" if bucket == 0 else "eval" if bucket <= 2 else "train"


@dataclass(frozen=True)
class RetrievalSpec:
    name: str
    haystack: str       # "noise" (S-NIAH-1's repeated sentences) or "filler" (generated text)
    needles: int        # needles in the haystack: the queried one plus needles - 1 distractors with other keys
    value_tokens: int   # 1: a number 10..99; 2: two numbers (a multi-token value)

    def __post_init__(self):
        if self.haystack not in ("noise", "filler"):
            raise ValueError(f"haystack must be 'noise' or 'filler'; received {self.haystack!r}.")
        if not 1 <= self.needles <= 32 or self.value_tokens not in (1, 2):
            raise ValueError(f"needles must lie in [1, 32] and value_tokens in (1, 2); received {self}.")


#: the retrieval variants; the evaluation's discriminating task is chosen among them on the dev seed
RETRIEVAL = {s.name: s for s in (
    RetrievalSpec("sniah1", "noise", 1, 1),
    RetrievalSpec("sniah2", "filler", 1, 1),
    RetrievalSpec("mk2", "filler", 2, 1),
    RetrievalSpec("mk4", "filler", 4, 1),
    RetrievalSpec("mk8", "filler", 8, 1),
    RetrievalSpec("sniah3", "filler", 1, 2),
    RetrievalSpec("mk2v2", "filler", 2, 2),
    RetrievalSpec("mk4v2", "filler", 4, 2),
)}
EXTRACTION = ("doc", "qa")
TASKS = tuple(RETRIEVAL) + EXTRACTION


@dataclass
class TaskBatch:
    """N examples of one length T. Logits at `positions` (N, P) predict `answer_ids` (N, P) under teacher forcing;
    an answer token counts when it is the argmax over the row's candidates (`candidate_mask`, (N, vocab))."""

    task: str
    split: str
    input_ids: torch.Tensor
    positions: torch.Tensor
    answer_ids: torch.Tensor
    candidate_mask: torch.Tensor
    items: list[tuple[str, tuple[str, ...]]]      # (queried key, answer value) per row
    depth: torch.Tensor                           # (N,) where the queried fact sits, as a fraction of the context
    report: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def correct(self, logits: torch.Tensor) -> torch.Tensor:
        """(N,) bool from logits at `positions`, (N, P, V): every answer token is its row's candidate argmax."""
        if logits.shape[:2] != self.positions.shape:
            raise ValueError(f"logits must be (N, P, V) at positions {tuple(self.positions.shape)}; received "
                             f"{tuple(logits.shape)}.")
        masked = logits.float().masked_fill(~self.candidate_mask[:, None, :].to(logits.device), float("-inf"))
        return (masked.argmax(-1).cpu() == self.answer_ids).all(-1)

    def select(self, lo: int, hi: int) -> "TaskBatch":
        return TaskBatch(self.task, self.split, self.input_ids[lo:hi], self.positions[lo:hi], self.answer_ids[lo:hi],
                         self.candidate_mask[lo:hi], self.items[lo:hi], self.depth[lo:hi], self.report)


class _Vocab:
    """Token ids of the template pieces, keys and values for one tokenizer (encoded once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        self.keys = [self.one(k) for k in KEY_NAMES]
        self.numbers = [self.one(n) for n in NUMBER_WORDS]
        self.values = {f: [self.one(v) for v in VALUE_VOCABS[vocab]] for f, vocab in FIELDS.items()}
        self.noise = [self.ids(s) for s in NOISE_SENTENCES]
        self.period = self.one(".")
        self.size = len(tokenizer)

    def ids(self, text: str) -> list[int]:
        if text not in self._cache:
            self._cache[text] = encode_continuation(self.tokenizer, text)
        return self._cache[text]

    def one(self, word: str) -> int:
        ids = self.ids(word)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if len(ids) != 1 or ids[0] == unk:
            raise ValueError(f"{word!r} is not one token of this tokenizer; build it with "
                             f"build_word_tokenizer(extra_words=tasks.task_words()).")
        return ids[0]

    def fill(self, template: str, key: int, value: Sequence[int]) -> list[int]:
        out = []
        for piece in re.split(r"(\{key\}|\{value\})", template):
            out += [key] if piece == "{key}" else list(value) if piece == "{value}" else \
                self.ids(piece.strip()) if piece.strip() else []
        return out

    def mask(self, ids: Sequence[int]) -> torch.Tensor:
        m = torch.zeros(self.size, dtype=torch.bool)
        m[list(ids)] = True
        return m


_VOCABS: dict[int, _Vocab] = {}


def _vocab(tokenizer) -> _Vocab:
    if id(tokenizer) not in _VOCABS:
        _VOCABS[id(tokenizer)] = _Vocab(tokenizer)
    return _VOCABS[id(tokenizer)]


def _check(task: str, split: str, n: int, length: int) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}; received {task!r}.")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; received {split!r}.")
    if not isinstance(n, int) or n < 1 or not isinstance(length, int) or length < 16:
        raise ValueError(f"n must be >= 1 and length >= 16 (integers); received n={n!r}, length={length!r}.")


def _draw_item(rng: random.Random, split: str, n_keys: int, values: Sequence[str], value_tokens: int
               ) -> tuple[int, tuple[int, ...]]:
    """A (key index, value indices) whose identity belongs to `split` (rejection sampling; ~1 in 10 for dev)."""
    for _ in range(10_000):
        k = rng.randrange(n_keys)
        v = tuple(rng.randrange(len(values)) for _ in range(value_tokens))
        if item_split(KEY_NAMES[k], [values[i] for i in v]) == split:
            return k, v
    raise RuntimeError(f"no {split} item found in 10,000 draws")  # pragma: no cover - the hash is uniform


def _haystack(voc: _Vocab, kind: str, split: str, length: int, source_id: int) -> tuple[list[int], list[int]]:
    """`length` haystack tokens and the sentence boundaries (indices where a needle may go), 0 and length included."""
    if length <= 0:
        return [], [0]
    if kind == "noise":
        hay: list[int] = []
        sentence = 0
        while len(hay) < length:   # S-NIAH-1: the noise sentences in a fixed cycle
            hay += voc.noise[sentence % len(voc.noise)]
            sentence += 1
        hay = hay[:length]
    else:
        hay = FillerSource(id=source_id, split=FILLER_SPLIT[split]).token_ids(voc.tokenizer, length)
    bounds = sorted({0, length} | {i + 1 for i, t in enumerate(hay) if t == voc.period and i + 1 < length})
    return hay, bounds


def _place(hay: list[int], bounds: list[int], pieces: list[tuple[float, list[int]]]) -> tuple[list[int], list[int]]:
    """Inserts each (depth, tokens) at the boundary nearest depth * len(hay); returns the ids and each piece's start
    (in input order). Pieces at the same boundary keep their input order."""
    L = len(hay)
    cuts = [min(bounds, key=lambda b: (abs(b - d * L), b)) for d, _ in pieces]
    order = sorted(range(len(pieces)), key=lambda i: (cuts[i], i))
    out, starts, prev = [], [0] * len(pieces), 0
    for i in order:
        out += hay[prev:cuts[i]]
        starts[i] = len(out)
        out += pieces[i][1]
        prev = cuts[i]
    return out + hay[prev:], starts


def build_task(tokenizer, task: str, n: int, length: int, *, split: str = "eval", seed: int = 0,
               depths: Optional[Sequence[float]] = None) -> TaskBatch:
    """`n` examples of `task` with exactly `length` tokens each, from `split`; deterministic in (task, split, seed,
    length, n). depths: the queried fact's depth per row (cycled), default evenly spaced over [0, 1]."""
    _check(task, split, n, length)
    voc = _vocab(tokenizer)
    rng = random.Random(f"qed-task/{task}/{split}/{seed}/{length}/{n}")
    depth_list = [i / (n - 1) if n > 1 else 0.5 for i in range(n)] if depths is None else \
        [float(depths[i % len(depths)]) for i in range(n)]
    rows, positions, answers, masks, items = [], [], [], [], []
    for i in range(n):
        source_id = _stable_int(f"{task}/{seed}/{length}/{n}/{i}", 2 ** 40)   # the filler generator's id range
        if task in RETRIEVAL:
            spec = RETRIEVAL[task]
            k, v = _draw_item(rng, split, len(voc.keys), NUMBER_WORDS, spec.value_tokens)
            others = rng.sample([j for j in range(len(voc.keys)) if j != k], spec.needles - 1)
            value_ids = [voc.numbers[j] for j in v]
            pieces = [(depth_list[i], voc.fill(NEEDLE, voc.keys[k], value_ids))]
            pieces += [(rng.random(), voc.fill(NEEDLE, voc.keys[j], [voc.numbers[rng.randrange(90)]
                                                                     for _ in range(spec.value_tokens)]))
                       for j in others]
            query = voc.fill(NIAH_QUERY, voc.keys[k], []) + value_ids[:-1]
            kind, cand = spec.haystack, voc.numbers
            item = (KEY_NAMES[k], tuple(NUMBER_WORDS[j] for j in v))
        else:
            fields = list(FACTS) if task == "qa" else list(FIELDS)
            f = rng.choice(fields)
            vocab = VALUE_VOCABS[FIELDS[f]]
            k, (v,) = _draw_item(rng, split, len(voc.keys), vocab, 1)
            value_ids = [voc.values[f][v]]
            others = rng.sample([j for j in range(len(voc.keys)) if j != k], 2)
            pieces = []
            for j, key in enumerate([k] + others):
                vals = {g: (v if (key == k and g == f) else rng.randrange(len(VALUE_VOCABS[FIELDS[g]])))
                        for g in fields}
                if task == "doc":   # one record per key, its fields in a random order
                    order = rng.sample(fields, len(fields))
                    rec = voc.ids("record") + [voc.keys[key]] + [voc.period]
                    for g in order:
                        rec += voc.ids(g) + voc.ids(":") + [voc.values[g][vals[g]]] + [voc.period]
                    pieces.append((depth_list[i] if j == 0 else rng.random(), rec))
                else:               # one prose sentence per fact, scattered through the passage
                    for g in fields:
                        sent = voc.fill(FACTS[g][0], voc.keys[key], [voc.values[g][vals[g]]])
                        pieces.append((depth_list[i] if (j == 0 and g == f) else rng.random(), sent))
            if task == "doc":
                query = voc.ids("the") + voc.ids(f) + voc.ids("of") + [voc.keys[k]] + voc.ids("is")
            else:
                query = voc.ids("question") + voc.ids(":") + voc.fill(FACTS[f][1], voc.keys[k], []) + \
                    voc.ids("answer") + voc.ids(":")
            kind, cand = "filler", voc.values[f]
            item = (KEY_NAMES[k], (vocab[v],))
        hay_len = length - sum(len(p) for _, p in pieces) - len(query)
        if hay_len < 0:
            raise ValueError(f"length={length} is too short for task {task!r}: its needles and query take "
                             f"{length - hay_len} tokens; ask for at least that many.")
        hay, bounds = _haystack(voc, kind, split, hay_len, source_id)
        ids, _ = _place(hay, bounds, pieces)
        ids = ids + query
        assert len(ids) == length, (len(ids), length)
        P = len(value_ids)
        rows.append(ids)
        positions.append([length - P + j for j in range(P)])
        answers.append(value_ids)
        masks.append(voc.mask(cand))
        items.append(item)
    return TaskBatch(task, split, torch.tensor(rows, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                     torch.tensor(answers, dtype=torch.long), torch.stack(masks), items,
                     torch.tensor(depth_list, dtype=torch.float32),
                     report={"seed": seed, "length": length, "chance": float((1 / torch.stack(masks).sum(-1)).mean())})
