"""The key-value recall task and its donor/recipient pair builders (swap, neutral, update; single or all queries).

Sequences are assembled at the token level from separately encoded segments, so every key and value is one token,
donor and recipient have identical length and alignment, and every span in the metadata is exact. See docs/data.md.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, fields
from typing import Iterator, Sequence

import torch

from .filler import SPLITS, FillerSource, Source
from .tokenizer import encode_continuation, single_token_ids, token_strings
from .words import KEY_NAMES, NATURAL_TEMPLATES, TEMPLATES, VALUE_VOCABS, Template, recall_words

__all__ = [
    "Template",
    "TEMPLATES",
    "VARIANTS",
    "RecallPair",
    "PairBatch",
    "iter_pairs",
    "build_pairs",
    "build_multifact_pairs",
    "build_neutral_pairs",
    "build_update_pairs",
    "recall_words",
]

VARIANTS = ("swap", "neutral", "update")


# --- compiled templates: token ids with slot markers -------------------------------------------------------------

_KEY, _VALUE = -1, -2


def _compile(tokenizer, text: str, name: str) -> list[int]:
    """Encode a template string to ids, with _KEY / _VALUE marking the single-token slots."""
    out: list[int] = []
    pieces = re.split(r"(\{key\}|\{value\})", text)
    unk = getattr(tokenizer, "unk_token_id", None)
    for index, piece in enumerate(pieces):
        if piece == "{key}":
            out.append(_KEY)
        elif piece == "{value}":
            out.append(_VALUE)
        elif piece.strip():
            leading = index == 0 or piece[0].isspace()
            ids = encode_continuation(tokenizer, piece.strip(), leading_space=leading)
            if unk is not None and unk in ids:
                raise ValueError(f"template {name!r}: {piece.strip()!r} contains words unknown to this tokenizer "
                                 f"(tokens {token_strings(tokenizer, ids)}); add them to its vocabulary.")
            out.extend(ids)
    return out


def _fill(compiled: list[int], key_id: int, value_id: int | None) -> list[int]:
    return [key_id if t == _KEY else (value_id if t == _VALUE else t) for t in compiled]


# --- records ------------------------------------------------------------------------------------------------------

@dataclass
class RecallPair:
    """One donor/recipient pair (one queried fact). Spans are half-open [start, end) token positions.

    fact_spans[f][r] / value_spans[f][r]: r-th presentation (in position order) of fact f, whole fact / value token.
    query_pos: index of the last prompt token (its logits predict the answer); query_start: first query token.
    Answer indices point into candidate_ids; -1 means "none" (the neutral donor has no answer; stale only in update).
    """

    recipient_ids: list[int]
    donor_ids: list[int]
    fact_spans: list[list[tuple[int, int]]]
    value_spans: list[list[tuple[int, int]]]
    query_start: int
    query_pos: int
    candidate_ids: list[int]
    candidates: list[str]
    recipient_answer_index: int
    donor_answer_index: int
    stale_answer_index: int
    target_fact: int
    queried_fact: int
    keys: list[str]
    recipient_values: list[str]
    donor_values: list[str]
    source_id: int
    split: str
    origin: str
    template: str
    vocab: str
    variant: str
    group: int
    updated_presentations: list[int] = field(default_factory=list)

    @property
    def is_target(self) -> bool:
        return self.queried_fact == self.target_fact


@dataclass
class PairBatch:
    """A batch of pairs as tensors plus per-pair metadata. Positions are in padded (left-padded) coordinates."""

    recipient_ids: torch.Tensor          # (N, T) long
    donor_ids: torch.Tensor              # (N, T) long
    query_start: torch.Tensor            # (N,)
    query_pos: torch.Tensor              # (N,) last prompt token; logits here predict the answer
    candidate_ids: torch.Tensor          # (N, C)
    recipient_answer_index: torch.Tensor  # (N,) index into candidate_ids
    donor_answer_index: torch.Tensor     # (N,) index, -1 for the neutral donor's target row
    stale_answer_index: torch.Tensor     # (N,) index of the overwritten value in update pairs, else -1
    target_fact: torch.Tensor            # (N,)
    queried_fact: torch.Tensor           # (N,)
    is_target: torch.Tensor              # (N,) bool
    group: torch.Tensor                  # (N,) pair id; rows of one multi-fact pair share it and their context
    source_id: torch.Tensor              # (N,)
    fact_spans: torch.Tensor             # (N, K, R, 2), -1 where a row has fewer facts/presentations
    value_spans: torch.Tensor            # (N, K, R, 2)
    splits: list[str]
    origins: list[str]
    templates: list[str]
    vocabs: list[str]
    variants: list[str]
    keys: list[list[str]]
    candidates: list[list[str]]
    recipient_values: list[list[str]]
    donor_values: list[list[str]]
    report: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.recipient_ids.shape[0])

    def select(self, rows: Sequence[int]) -> "PairBatch":
        """The batch of `rows` (tensors indexed, per-row lists picked, the rest kept). Rows keep their padded
        positions, so a row computes as it does in the whole batch."""
        rows = [int(r) for r in rows]
        idx = torch.as_tensor(rows, dtype=torch.long)
        n = len(self)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
                value = value.index_select(0, idx.to(value.device))
            elif isinstance(value, list) and len(value) == n:
                value = [value[i] for i in rows]
            out[f.name] = value
        return type(self)(**out)

    @property
    def recipient_answer_id(self) -> torch.Tensor:
        return self.candidate_ids.gather(1, self.recipient_answer_index.clamp(min=0)[:, None])[:, 0]

    @property
    def donor_answer_id(self) -> torch.Tensor:
        """Donor answer token ids; -1 where the donor has none (neutral target rows)."""
        ids = self.candidate_ids.gather(1, self.donor_answer_index.clamp(min=0)[:, None])[:, 0]
        return torch.where(self.donor_answer_index >= 0, ids, torch.full_like(ids, -1))

    @property
    def target_value_spans(self) -> torch.Tensor:
        """(N, R, 2) spans of the target fact's value tokens."""
        return self.value_spans[torch.arange(len(self)), self.target_fact]

    @classmethod
    def collate(cls, pairs: Sequence[RecallPair], pad_id: int, report: dict | None = None) -> "PairBatch":
        """Stack pairs; rows of different lengths are padded on the LEFT with `pad_id` and positions shifted."""
        if not pairs:
            raise ValueError("collate needs at least one pair; received an empty sequence.")
        length = max(len(p.recipient_ids) for p in pairs)
        n_facts = max(len(p.fact_spans) for p in pairs)
        n_pres = max(len(s) for p in pairs for s in p.fact_spans)
        n = len(pairs)
        recipient = torch.full((n, length), pad_id, dtype=torch.long)
        donor = torch.full((n, length), pad_id, dtype=torch.long)
        fact_spans = torch.full((n, n_facts, n_pres, 2), -1, dtype=torch.long)
        value_spans = torch.full((n, n_facts, n_pres, 2), -1, dtype=torch.long)
        pads = []
        for i, p in enumerate(pairs):
            if len(p.recipient_ids) != len(p.donor_ids):
                raise ValueError(f"pair {i}: donor ({len(p.donor_ids)}) and recipient ({len(p.recipient_ids)}) "
                                 f"lengths differ; pairs must be aligned.")
            pad = length - len(p.recipient_ids)
            pads.append(pad)
            recipient[i, pad:] = torch.tensor(p.recipient_ids)
            donor[i, pad:] = torch.tensor(p.donor_ids)
            for f, (spans, vspans) in enumerate(zip(p.fact_spans, p.value_spans)):
                for r, (span, vspan) in enumerate(zip(spans, vspans)):
                    fact_spans[i, f, r] = torch.tensor(span) + pad
                    value_spans[i, f, r] = torch.tensor(vspan) + pad
        n_candidates = {len(p.candidate_ids) for p in pairs}
        if len(n_candidates) != 1:
            raise ValueError(f"all pairs must have the same number of candidates; received {sorted(n_candidates)}.")
        pad_t = torch.tensor(pads, dtype=torch.long)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in pairs], dtype=torch.long)

        return cls(
            recipient_ids=recipient, donor_ids=donor,
            query_start=column("query_start") + pad_t, query_pos=column("query_pos") + pad_t,
            candidate_ids=torch.tensor([p.candidate_ids for p in pairs], dtype=torch.long),
            recipient_answer_index=column("recipient_answer_index"),
            donor_answer_index=column("donor_answer_index"),
            stale_answer_index=column("stale_answer_index"),
            target_fact=column("target_fact"), queried_fact=column("queried_fact"),
            is_target=torch.tensor([p.is_target for p in pairs], dtype=torch.bool),
            group=column("group"), source_id=column("source_id"),
            fact_spans=fact_spans, value_spans=value_spans,
            splits=[p.split for p in pairs], origins=[p.origin for p in pairs],
            templates=[p.template for p in pairs], vocabs=[p.vocab for p in pairs],
            variants=[p.variant for p in pairs], keys=[list(p.keys) for p in pairs],
            candidates=[list(p.candidates) for p in pairs],
            recipient_values=[list(p.recipient_values) for p in pairs],
            donor_values=[list(p.donor_values) for p in pairs],
            report=dict(report or {}),
        )

    def to(self, device) -> "PairBatch":
        """A copy with every tensor moved to `device`."""
        moved = {}
        for name, value in self.__dict__.items():
            moved[name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return PairBatch(**moved)

    def to_frame(self):
        """One row per pair of metadata (no token ids) as a pandas DataFrame."""
        import pandas as pd

        rows = []
        for i in range(len(self)):
            k = len(self.keys[i])
            target = int(self.target_fact[i])
            queried = int(self.queried_fact[i])
            d_index = int(self.donor_answer_index[i])
            s_index = int(self.stale_answer_index[i])
            spans = self.fact_spans[i, :k]
            vspans = self.value_spans[i, :k]
            rows.append({
                "group": int(self.group[i]), "variant": self.variants[i], "split": self.splits[i],
                "source_id": int(self.source_id[i]), "origin": self.origins[i], "template": self.templates[i],
                "vocab": self.vocabs[i], "n_facts": k, "target_fact": target, "queried_fact": queried,
                "is_target": bool(self.is_target[i]), "target_key": self.keys[i][target],
                "queried_key": self.keys[i][queried], "query_start": int(self.query_start[i]),
                "query_pos": int(self.query_pos[i]),
                "candidates": list(self.candidates[i]), "candidate_ids": self.candidate_ids[i].tolist(),
                "recipient_answer_index": int(self.recipient_answer_index[i]),
                "donor_answer_index": d_index, "stale_answer_index": s_index,
                "recipient_answer": self.candidates[i][int(self.recipient_answer_index[i])],
                "donor_answer": self.candidates[i][d_index] if d_index >= 0 else None,
                "stale_answer": self.candidates[i][s_index] if s_index >= 0 else None,
                "keys": list(self.keys[i]), "recipient_values": list(self.recipient_values[i]),
                "donor_values": list(self.donor_values[i]),
                "fact_spans": [[tuple(s) for s in f.tolist() if s[0] >= 0] for f in spans],
                "value_spans": [[tuple(s) for s in f.tolist() if s[0] >= 0] for f in vspans],
            })
        return pd.DataFrame(rows)


# --- generation ---------------------------------------------------------------------------------------------------

def _resolve_template(template: str | Template) -> Template:
    if isinstance(template, Template):
        return template
    known = {**TEMPLATES, **NATURAL_TEMPLATES}
    if template not in known:
        raise ValueError(f"template must be a Template or one of {sorted(known)}; received {template!r}.")
    return known[template]


def _resolve_vocab(vocab: str | Sequence[str]) -> tuple[str, list[str]]:
    if isinstance(vocab, str):
        if vocab not in VALUE_VOCABS:
            raise ValueError(f"vocab must be a list of value words or one of {sorted(VALUE_VOCABS)}; "
                             f"received {vocab!r}.")
        return vocab, list(VALUE_VOCABS[vocab])
    values = list(vocab)
    if len(set(values)) != len(values):
        raise ValueError(f"vocab values must be distinct; received duplicates in {values}.")
    return "custom", values


def _balanced_sequence(rng: random.Random, items: list, n: int) -> list:
    """n draws that cycle through shuffled copies of `items`, so each appears floor or ceil n/len times."""
    out: list = []
    while len(out) < n:
        block = list(items)
        rng.shuffle(block)
        out.extend(block)
    return out[:n]


def _check_args(n_facts, presentations, filler_tokens, gap_tokens, lead_tokens, variant, queries, n_updated,
                pairs_per_source, n_candidates):
    for name, value, minimum in (("n_facts", n_facts, 1), ("presentations", presentations, 1),
                                 ("filler_tokens", filler_tokens, 0), ("gap_tokens", gap_tokens, 0),
                                 ("lead_tokens", lead_tokens, 0), ("pairs_per_source", pairs_per_source, 1),
                                 ("n_candidates", n_candidates, 2)):
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}; received {value!r}.")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; received {variant!r}.")
    if queries not in ("target", "all"):
        raise ValueError(f"queries must be 'target' (one row per pair) or 'all' (one row per fact, same context); "
                         f"received {queries!r}.")
    if variant == "update" and not 1 <= n_updated < presentations:
        raise ValueError(f"the update variant re-binds the last n_updated of the target's presentations, so "
                         f"1 <= n_updated < presentations is required; received n_updated={n_updated}, "
                         f"presentations={presentations}. Use presentations >= 2.")


@dataclass(frozen=True)
class _Vocabulary:
    """The single-token keys and values of one call, as words and as token ids (index i of each list matches)."""

    name: str
    key_words: list[str]
    key_ids: list[int]
    value_words: list[str]
    value_ids: list[int]


def _vocabulary(tokenizer, keys: Sequence[str] | None, vocab: str | Sequence[str], on_multitoken: str, n_facts: int,
                n_candidates: int, variant: str, report: dict | None) -> _Vocabulary:
    """Resolve and filter the keys and values to single tokens; check there are enough for the task."""
    vocab_name, value_words = _resolve_vocab(vocab)
    key_words = list(KEY_NAMES if keys is None else keys)
    if len(set(key_words)) != len(key_words):
        raise ValueError(f"keys must be distinct; received duplicates in {key_words}.")
    value_words, value_ids, dropped_values = single_token_ids(tokenizer, value_words, on_multitoken, "value")
    key_words, key_ids, dropped_keys = single_token_ids(tokenizer, key_words, on_multitoken, "key")
    if set(value_ids) & set(key_ids):
        raise ValueError("a key and a value map to the same token id; keys and values must be distinct words.")
    if report is not None:
        report.update({"dropped_values": dropped_values, "dropped_keys": dropped_keys,
                       "n_filtered": len(dropped_values) + len(dropped_keys)})
    if n_facts > len(key_words):
        raise ValueError(f"n_facts={n_facts} bindings need {n_facts} distinct keys, but only {len(key_words)} "
                         f"single-token keys are available{' after filtering' if dropped_keys else ''}; "
                         f"lower n_facts or pass more keys.")
    if len(value_words) < n_candidates:
        raise ValueError(f"vocab {vocab_name!r} has {len(value_words)} single-token values"
                         f"{' after filtering' if dropped_values else ''}; at least n_candidates={n_candidates} "
                         f"are needed. Use a larger vocabulary.")
    min_values = 2 + (variant == "update") + (n_facts > 1)
    if len(value_words) < min_values:
        raise ValueError(f"vocab {vocab_name!r} has {len(value_words)} single-token values; variant={variant!r} "
                         f"with n_facts={n_facts} needs at least {min_values}. Use a larger vocabulary.")
    return _Vocabulary(vocab_name, key_words, key_ids, value_words, value_ids)


@dataclass(frozen=True)
class _Layout:
    """Token layout shared by every sequence of one call: [bos] lead, then each presentation followed by a gap (the
    last one by the long filler), then the query prompt."""

    fact_ids: list[int]     # compiled fact template, with _KEY / _VALUE slots
    query_ids: list[int]    # compiled query template, with a _KEY slot
    value_offset: int       # position of the value token inside a fact
    bos: list[int]
    filler_lengths: list[int]  # token counts of the filler pieces, in layout order
    length: int             # tokens per sequence

    @property
    def fact_len(self) -> int:
        return len(self.fact_ids)


def _layout(tokenizer, tmpl: Template, n_facts: int, presentations: int, filler_tokens: int, gap_tokens: int,
            lead_tokens: int, add_bos: bool, max_length: int | None) -> _Layout:
    fact_ids = _compile(tokenizer, tmpl.fact, tmpl.name)
    query_ids = _compile(tokenizer, tmpl.query, tmpl.name)
    n_pres_total = n_facts * presentations
    bos = []
    if add_bos:
        if getattr(tokenizer, "bos_token_id", None) is None:
            raise ValueError("add_bos=True but this tokenizer has no bos_token_id; pass add_bos=False.")
        bos = [tokenizer.bos_token_id]
    filler_lengths = [lead_tokens] + [gap_tokens] * (n_pres_total - 1) + [filler_tokens]
    length = len(bos) + sum(filler_lengths) + n_pres_total * len(fact_ids) + len(query_ids)
    if max_length is not None and length > max_length:
        raise ValueError(
            f"filler_tokens={filler_tokens} with n_facts={n_facts}, presentations={presentations}, "
            f"gap_tokens={gap_tokens} makes sequences {length} tokens long, more than max_length={max_length}; "
            f"lower filler_tokens to at most {filler_tokens - (length - max_length)} or shrink the layout.")
    return _Layout(fact_ids, query_ids, fact_ids.index(_VALUE), bos, filler_lengths, length)


@dataclass(frozen=True)
class _Schedule:
    """Per-pair draws balanced over the whole call (index = pair number)."""

    target: list[int]            # the fact whose value the donor changes
    recipient_answer: list[int]  # value index of the recipient's answer
    donor_answer: list[int]      # value index of the donor's answer, never the recipient's
    slots: list[tuple[int, int]]  # candidate slots of (recipient answer, donor answer)


def _schedule(n_pairs: int, n_values: int, n_candidates: int, n_facts: int, rng: random.Random) -> _Schedule:
    # Recipient answer: shuffled blocks of every value; donor answer: the same block shifted by a nonzero offset,
    # so both are balanced over values and never equal.
    recipient_answer, donor_answer = [], []
    while len(recipient_answer) < n_pairs:
        block = list(range(n_values))
        rng.shuffle(block)
        shift = rng.randrange(1, n_values)
        recipient_answer.extend(block)
        donor_answer.extend(block[(i + shift) % n_values] for i in range(n_values))
    # (recipient slot, donor slot): every run of n_candidates pairs uses each slot once for the recipient answer and
    # once for the donor answer; every run of n_candidates * (n_candidates - 1) pairs uses each ordered slot pair once.
    slots: list[tuple[int, int]] = []
    while len(slots) < n_pairs:
        shifts = list(range(1, n_candidates))
        rng.shuffle(shifts)
        for shift in shifts:
            perm = list(range(n_candidates))
            rng.shuffle(perm)
            slots.extend((r, (r + shift) % n_candidates) for r in perm)
    targets = _balanced_sequence(rng, list(range(n_facts)), n_pairs)
    return _Schedule(targets, recipient_answer, donor_answer, slots[:n_pairs])


@dataclass
class _Context:
    """One pair's donor and recipient context (everything before the query prompt) and what it binds."""

    recipient: list[int]
    donor: list[int]
    fact_spans: list[list[tuple[int, int]]]
    value_spans: list[list[tuple[int, int]]]
    fact_keys: list[int]    # key index of each fact
    fact_values: list[int]  # recipient value index of each fact
    stale_value: int        # the overwritten value (update), else -1
    updated_rounds: list[int]


def _context(rng: random.Random, layout: _Layout, words: _Vocabulary, pieces: list[list[int]],
             spare: list[list[int]], target: int, r_value: int, d_value: int, n_facts: int, presentations: int,
             variant: str, n_updated: int) -> _Context:
    """Draw the other facts' keys and values and the presentation order, and write both contexts."""
    n_values = len(words.value_ids)
    used = {r_value, d_value}
    stale_value = -1
    if variant == "update":
        stale_value = rng.choice([v for v in range(n_values) if v not in used])
        used.add(stale_value)
    free = [v for v in range(n_values) if v not in used]
    others = rng.sample(free, n_facts - 1) if len(free) >= n_facts - 1 else rng.choices(free, k=n_facts - 1)
    fact_values = others[:target] + [r_value] + others[target:]
    fact_keys = rng.sample(range(len(words.key_words)), n_facts)
    order = []
    for rnd in range(presentations):
        perm = list(range(n_facts))
        rng.shuffle(perm)
        order.extend((rnd, f) for f in perm)
    updated_rounds = list(range(presentations - n_updated, presentations)) if variant == "update" else []

    recipient: list[int] = list(layout.bos)
    donor: list[int] = list(layout.bos)
    piece_iter = iter(pieces)
    spare_iter = iter(spare)

    def add_filler() -> None:
        chunk = next(piece_iter)
        recipient.extend(chunk)
        donor.extend(chunk)

    fact_len, value_offset = layout.fact_len, layout.value_offset
    fact_spans = [[None] * presentations for _ in range(n_facts)]
    value_spans = [[None] * presentations for _ in range(n_facts)]
    add_filler()
    for rnd, f in order:
        start = len(recipient)
        key_id = words.key_ids[fact_keys[f]]
        if f == target and variant == "update" and rnd not in updated_rounds:
            r_val, d_val = words.value_ids[stale_value], words.value_ids[stale_value]
        elif f == target and variant in ("swap", "update"):
            r_val, d_val = words.value_ids[r_value], words.value_ids[d_value]
        else:
            r_val = d_val = words.value_ids[fact_values[f]]
        recipient.extend(_fill(layout.fact_ids, key_id, r_val))
        if f == target and variant == "neutral":
            donor.extend(next(spare_iter))
        else:
            donor.extend(_fill(layout.fact_ids, key_id, d_val))
        fact_spans[f][rnd] = (start, start + fact_len)
        value_spans[f][rnd] = (start + value_offset, start + value_offset + 1)
        add_filler()
    assert len(recipient) == len(donor) == layout.length - len(layout.query_ids)
    return _Context(recipient, donor, fact_spans, value_spans, fact_keys, fact_values, stale_value, updated_rounds)


def _candidates(rng: random.Random, queried: int, target: int, r_value: int, d_value: int, slots: tuple[int, int],
                ctx: _Context, n_values: int, n_candidates: int, variant: str) -> tuple[list[int], int, int, int]:
    """The value index in each candidate slot for a query of fact `queried`, and the slots of the recipient's answer,
    the donor's answer and the stale value (-1 for none).

    A target query puts its answers in the scheduled `slots` (and the stale value of an update in a random free
    slot); another fact's answer goes to a random slot. Distractors fill the rest: values bound to other keys in
    this context first, then the rest of the vocabulary.
    """
    if queried == target:
        r_slot, d_slot = slots
        fixed = {r_slot: r_value}
        if variant != "neutral":
            fixed[d_slot] = d_value
        if variant == "update":
            fixed[rng.choice([s for s in range(n_candidates) if s not in fixed])] = ctx.stale_value
        answer_value = r_value
    else:
        answer_value = ctx.fact_values[queried]
        fixed = {rng.randrange(n_candidates): answer_value}
    taken = set(fixed.values())
    in_context = [v for v in dict.fromkeys(ctx.fact_values) if v not in taken]
    rng.shuffle(in_context)
    rest = [v for v in range(n_values) if v not in taken and v not in in_context]
    rng.shuffle(rest)
    fillers = iter(in_context + rest)
    chosen = [fixed[s] if s in fixed else next(fillers) for s in range(n_candidates)]
    answer_slot = chosen.index(answer_value)
    if queried != target:
        return chosen, answer_slot, answer_slot, -1
    donor_slot = -1 if variant == "neutral" else chosen.index(d_value)
    stale_slot = chosen.index(ctx.stale_value) if variant == "update" else -1
    return chosen, answer_slot, donor_slot, stale_slot


def iter_pairs(tokenizer, split: str = "dev", n_sources: int = 16, *, sources: Sequence[Source] | None = None,
               n_facts: int = 4, presentations: int = 3, filler_tokens: int = 512, gap_tokens: int = 24,
               lead_tokens: int | None = None, template: str | Template = "is_in",
               vocab: str | Sequence[str] = "cities", keys: Sequence[str] | None = None, variant: str = "swap",
               queries: str = "target", n_updated: int = 1, pairs_per_source: int = 1, n_candidates: int = 4,
               seed: int = 0, max_length: int | None = None, on_multitoken: str = "error",
               add_bos: bool = False, report: dict | None = None) -> Iterator[RecallPair]:
    """Yield recall pairs: `pairs_per_source` per source (rows per pair: 1, or n_facts with queries='all').

    Filler comes from `sources` when given (e.g. interp.data.corpora), else from generated filler sources 0..n-1 of
    `split` under `seed`. Layout: lead filler, then `presentations` rounds presenting every fact once (order shuffled
    per round) separated by `gap_tokens` of filler, then `filler_tokens` of filler, then the query prompt.
    Every sequence of one call has the same length. Pass a dict as `report` to receive what was filtered.
    """
    lead_tokens = gap_tokens if lead_tokens is None else lead_tokens
    _check_args(n_facts, presentations, filler_tokens, gap_tokens, lead_tokens, variant, queries, n_updated,
                pairs_per_source, n_candidates)
    if sources is None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {sorted(SPLITS)}; received {split!r}.")
        if not isinstance(n_sources, int) or n_sources < 1:
            raise ValueError(f"n_sources must be an integer >= 1; received {n_sources!r}.")
        sources = [FillerSource(id=i, split=split, seed=seed) for i in range(n_sources)]
    sources = list(sources)
    if not sources:
        raise ValueError("sources is empty; pass at least one Source.")
    tmpl = _resolve_template(template)
    words = _vocabulary(tokenizer, keys, vocab, on_multitoken, n_facts, n_candidates, variant, report)
    layout = _layout(tokenizer, tmpl, n_facts, presentations, filler_tokens, gap_tokens, lead_tokens, add_bos,
                     max_length)
    reserved = frozenset(words.key_ids) | frozenset(words.value_ids)
    n_values = len(words.value_ids)
    n_pairs = len(sources) * pairs_per_source
    schedule = _schedule(n_pairs, n_values, n_candidates, n_facts, random.Random(
        f"recall-schedule/{seed}/{tmpl.name}/{words.name}/{variant}/{n_pairs}"))

    pair_index = 0
    for source in sources:
        # Filler pieces in layout order, each an exact token count on word boundaries; shared by the source's pairs.
        stream = source.stream(tokenizer, reserved)
        pieces = [stream.take(n) for n in layout.filler_lengths]
        spare = [stream.take(layout.fact_len) for _ in range(presentations)] if variant == "neutral" else []
        for j in range(pairs_per_source):
            i = pair_index
            pair_index += 1
            rng = random.Random(f"recall-pair/{seed}/{source.split}/{source.origin}/{source.id}/{j}/{tmpl.name}/"
                                f"{words.name}/{variant}/{i}")
            target = schedule.target[i]
            r_value, d_value = schedule.recipient_answer[i], schedule.donor_answer[i]
            ctx = _context(rng, layout, words, pieces, spare, target, r_value, d_value, n_facts, presentations,
                           variant, n_updated)
            query_start = len(ctx.recipient)
            keys_out = [words.key_words[ctx.fact_keys[f]] for f in range(n_facts)]
            r_values_out = [words.value_words[ctx.fact_values[f]] for f in range(n_facts)]
            d_values_out = list(r_values_out)
            d_values_out[target] = "" if variant == "neutral" else words.value_words[d_value]
            for q in [target] if queries == "target" else range(n_facts):
                prompt = _fill(layout.query_ids, words.key_ids[ctx.fact_keys[q]], None)
                chosen, answer_slot, donor_slot, stale_slot = _candidates(
                    rng, q, target, r_value, d_value, schedule.slots[i], ctx, n_values, n_candidates, variant)
                yield RecallPair(
                    recipient_ids=ctx.recipient + prompt, donor_ids=ctx.donor + prompt,
                    fact_spans=[list(s) for s in ctx.fact_spans], value_spans=[list(s) for s in ctx.value_spans],
                    query_start=query_start, query_pos=query_start + len(prompt) - 1,
                    candidate_ids=[words.value_ids[v] for v in chosen],
                    candidates=[words.value_words[v] for v in chosen],
                    recipient_answer_index=answer_slot, donor_answer_index=donor_slot,
                    stale_answer_index=stale_slot, target_fact=target, queried_fact=q, keys=keys_out,
                    recipient_values=r_values_out, donor_values=d_values_out, source_id=source.id,
                    split=source.split, origin=source.origin, template=tmpl.name, vocab=words.name,
                    variant=variant, group=i, updated_presentations=ctx.updated_rounds,
                )


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return 0 if pad is None else int(pad)


def build_pairs(tokenizer, sources: Sequence[Source] | None = None, *, split: str = "dev", n_sources: int = 16,
                **kwargs) -> PairBatch:
    """All pairs of `iter_pairs` collated into a PairBatch (same arguments; see iter_pairs).

    report (on the batch): dropped keys/values with their tokenisations, the count filtered, and the filler's
    unknown-token count and rate (filler_unknown_rate).
    """
    report: dict = {}
    pairs = list(iter_pairs(tokenizer, split, n_sources, sources=sources, report=report, **kwargs))
    batch = PairBatch.collate(pairs, _pad_id(tokenizer), report=report)
    batch.report.update(filler_unknown_rate(batch, tokenizer))
    return batch


def filler_unknown_rate(batch: PairBatch, tokenizer) -> dict:
    """How much of the filler (the recipient's tokens before the query, outside the fact spans) is the
    tokenizer's unknown token. Corpus text outside a word-level vocabulary becomes [UNK] and stops reading as text,
    so a high rate means the filler is not what the command line says it is."""
    ids = batch.recipient_ids
    pos = torch.arange(ids.shape[1])
    filler = pos[None, :] < batch.query_start[:, None]   # rows are unpadded: all tokens before the query
    spans = batch.fact_spans.reshape(len(batch), -1, 2)
    in_fact = ((pos[None, None, :] >= spans[..., :1]) & (pos[None, None, :] < spans[..., 1:])).any(dim=1)
    filler &= ~in_fact
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        filler &= ids != bos
    unk = getattr(tokenizer, "unk_token_id", None)
    n = int(filler.sum())
    k = 0 if unk is None else int((filler & (ids == unk)).sum())
    return {"filler_tokens": n, "filler_unknown_tokens": k, "filler_unknown_rate": k / n if n else 0.0,
            "filler_origins": sorted(set(batch.origins))}


def build_multifact_pairs(tokenizer, sources: Sequence[Source] | None = None, **kwargs) -> PairBatch:
    """Swap pairs with one row per fact: every row shares the pair's context and queries a different key."""
    return build_pairs(tokenizer, sources, queries="all", **kwargs)


def build_neutral_pairs(tokenizer, sources: Sequence[Source] | None = None, **kwargs) -> PairBatch:
    """Pairs whose donor replaces every presentation of the target fact with filler of equal token length."""
    return build_pairs(tokenizer, sources, variant="neutral", **kwargs)


def build_update_pairs(tokenizer, sources: Sequence[Source] | None = None, **kwargs) -> PairBatch:
    """Pairs where the target's last `n_updated` presentations re-bind it to a new value, the answer; the donor's
    new value differs. The overwritten value is among the candidates (stale_answer_index)."""
    return build_pairs(tokenizer, sources, variant="update", **kwargs)
