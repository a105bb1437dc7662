"""The key-value recall task and its donor/recipient pair builders (swap, neutral, update; single or all queries).

Each prompt (facts, filler and query) is written as text and tokenised once by the model's own tokenizer, with its
specials as its config says, so the ids are the tokenizer's own for that text. Spans are recovered from the
tokenizer's character offsets: every key and value must be one token where the template puts it (words that are not
are dropped and listed, or refused by name), and the donor is written and tokenised the same way and checked to
differ from the recipient only at the target value (its whole fact for neutral pairs), at identical length and
alignment. See docs/data.md.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, fields
from typing import Iterator, Sequence

import torch

from .filler import SPLITS, FillerSource, Source
from .layout import LAYOUTS, PairLayout, resolve_layout
from .tokenizer import (check_distinct_tokens, decode_text, encode_continuation, encode_text, require_tokenizer,
                        span_tokens, token_strings, vocabulary_hash)
from .words import KEY_NAMES, LAYOUT_TEMPLATES, NATURAL_TEMPLATES, TEMPLATES, VALUE_VOCABS, Template, recall_words

__all__ = [
    "Template",
    "TEMPLATES",
    "VARIANTS",
    "RecallPair",
    "PairBatch",
    "iter_pairs",
    "build_pairs",
    "PairLayout",
    "MisalignedPairError",
    "build_multifact_pairs",
    "build_neutral_pairs",
    "build_update_pairs",
    "recall_words",
]

VARIANTS = ("swap", "neutral", "update")


# --- templates as text: the filled sentence and where its key and value sit ---------------------------------------

_SLOT = re.compile(r"\{key\}|\{value\}")


def _render(text: str, key: str, value: str | None) -> tuple[str, tuple[int, int] | None, list[tuple[int, int]]]:
    """`text` with its slots filled; the character span of the value (None without one) and of each key."""
    out, pos, length = [], 0, 0
    value_span, key_spans = None, []
    for match in _SLOT.finditer(text):
        literal = text[pos:match.start()]
        out.append(literal)
        length += len(literal)
        word = key if match.group() == "{key}" else value
        if match.group() == "{key}":
            key_spans.append((length, length + len(word)))
        else:
            value_span = (length, length + len(word))
        out.append(word)
        length += len(word)
        pos = match.end()
    out.append(text[pos:])
    return "".join(out), value_span, key_spans


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
    # (N,) each row's own token count (its tokens are the last `lengths[i]` of the row, after the left padding);
    # None: every row fills the width. The scan and the confirmation run rows of different lengths packed
    # (cu_seqlens), so the padding is never computed.
    lengths: torch.Tensor | None = None
    # (N, C) token lists: each candidate's answer tokens after query_pos where some answer is several tokens (S-NIAH
    # on a digit-splitting vocabulary); candidates are then scored by their full conditional log-likelihood, and
    # candidate_ids (their first tokens) cannot tell them apart. None: every answer is its candidate_ids token.
    candidate_tokens: list[list[list[int]]] | None = None

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

    def row_lengths(self) -> torch.Tensor:
        """(N,) each row's own token count (the width where `lengths` is None)."""
        n, T = self.recipient_ids.shape
        return torch.full((n,), T, dtype=torch.long) if self.lengths is None else self.lengths.cpu()

    def is_ragged(self) -> bool:
        """True when some row is shorter than the width (left-padded): runs must then pack the rows."""
        return self.lengths is not None and bool((self.lengths.cpu() < self.recipient_ids.shape[1]).any())

    def trimmed(self) -> "PairBatch":
        """The batch cut to its longest row: padding every row carries is dropped and positions shift with it
        (a one-row batch becomes its own natural length)."""
        T = self.recipient_ids.shape[1]
        cut = T - int(self.row_lengths().max())
        if cut == 0:
            return self
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("recipient_ids", "donor_ids"):
                value = value[:, cut:]
            elif f.name in ("query_start", "query_pos"):
                value = value - cut
            elif f.name in ("fact_spans", "value_spans"):
                value = torch.where(value >= 0, value - cut, value)
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
            lengths=torch.tensor([len(p.recipient_ids) for p in pairs], dtype=torch.long),
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
    known = {**TEMPLATES, **NATURAL_TEMPLATES, **LAYOUT_TEMPLATES}
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
    """The keys and values of one call that are single tokens in the template's context and leave their neighbours'
    tokens as they are, as words and as token ids (index i of each list matches)."""

    name: str
    key_words: list[str]
    key_ids: list[int]
    value_words: list[str]
    value_ids: list[int]
    fact_len: int     # tokens of one fact sentence in context
    query_len: int    # tokens of the query prompt in context


# Context a word is checked in: filler-like words around the template, as in a prompt.
_BEFORE, _BETWEEN = "the old man said that", "and the"


def _probe(tokenizer, tmpl: Template, key: str, value: str):
    """Tokenise one fact and the query of `key` in a prompt-like context; the token span of the value, of every key
    occurrence, of the fact and of the query (None where a token also holds a neighbour's characters), and the
    ids with the value's tokens cut out (what must not depend on the value)."""
    fact, value_span, fact_keys = _render(tmpl.fact, key, value)
    query, _, query_keys = _render(tmpl.query, key, None)
    fact_at = len(_BEFORE) + 1
    query_at = fact_at + len(fact) + 1 + len(_BETWEEN) + 1
    text = f"{_BEFORE} {fact} {_BETWEEN} {query}"
    ids, offsets = encode_text(tokenizer, text)
    value_tokens = span_tokens(text, offsets, fact_at + value_span[0], fact_at + value_span[1])
    key_tokens = [span_tokens(text, offsets, at + s, at + e) for at, spans in ((fact_at, fact_keys),
                                                                            (query_at, query_keys)) for s, e in spans]
    fact_tokens = span_tokens(text, offsets, fact_at, fact_at + len(fact))
    query_tokens = span_tokens(text, offsets, query_at, query_at + len(query))
    rest = None if value_tokens is None else (tuple(ids[:value_tokens[0]]), tuple(ids[value_tokens[1]:]))
    return ids, offsets, value_tokens, key_tokens, fact_tokens, query_tokens, rest


def _tokens_near(tokenizer, ids, offsets, start: int, end: int) -> list[str]:
    """The token strings overlapping characters [start, end) (for messages)."""
    return token_strings(tokenizer, [t for t, (s, e) in zip(ids, offsets) if e > s and s < end and e > start])


def _check_words(tokenizer, tmpl: Template, words: list[str], role: str, other: str, on_multitoken: str,
                 list_name: str) -> tuple[list[str], list[int], dict[str, list[str]]]:
    """Keep the words (keys when role='key', values otherwise) that are one token wherever the template puts them
    and leave every other token of the prompt as it is; `other` fills the other slot. Returns (kept, ids, dropped
    word -> its tokens in context)."""
    if on_multitoken not in ("error", "filter"):
        raise ValueError(f"on_multitoken must be 'error' or 'filter'; received {on_multitoken!r}.")
    unk = getattr(tokenizer, "unk_token_id", None)
    kept, ids_out, dropped, rests = [], [], {}, {}
    for word in words:
        key, value = (word, other) if role == "key" else (other, word)
        ids, offsets, value_tokens, key_tokens, *_ , rest = _probe(tokenizer, tmpl, key, value)
        spans = key_tokens if role == "key" else [value_tokens]
        single = all(sp is not None and sp[1] - sp[0] == 1 for sp in spans)
        token_ids = {ids[sp[0]] for sp in spans if sp is not None}
        if single and len(token_ids) == 1 and (unk is None or unk not in token_ids):
            kept.append(word)
            ids_out.append(token_ids.pop())
            if role == "value":
                rests[word] = rest
        else:
            text = _render(f"{_BEFORE} {tmpl.fact}", key, value)[0]
            at = text.find(word, len(_BEFORE) + 1)
            dropped[word] = _tokens_near(tokenizer, ids, offsets, at, at + len(word))
    if role == "value" and rests:
        # The prompt around a value must tokenise the same whatever the value: a value that changes a neighbour's
        # tokens would make donor and recipient differ outside the value.
        common = max(set(rests.values()), key=list(rests.values()).count)
        for word in [w for w in kept if rests[w] != common]:
            i = kept.index(word)
            del kept[i], ids_out[i]
            dropped[word] = ["(changes the tokens around it)"]
    if dropped and on_multitoken == "error":
        detail = "; ".join(f"{w!r} -> {t}" for w, t in dropped.items())
        raise ValueError(
            f"{len(dropped)} {role}(s) of {list_name} are not single known tokens in template {tmpl.name!r} for this "
            f"tokenizer, or change the tokens around them: {detail}. Use other words (--keys/--values), or pass "
            f"on_multitoken='filter' (--on-multitoken filter, the default) to drop them.")
    check_distinct_tokens(kept, ids_out, role)
    return kept, ids_out, dropped


def _vocabulary(tokenizer, tmpl: Template, keys: Sequence[str] | None, vocab: str | Sequence[str],
                on_multitoken: str, n_facts: int, n_candidates: int, variant: str,
                report: dict | None) -> _Vocabulary:
    """Resolve the keys and values, keep those that are single tokens in the template's context; check there are
    enough for the task."""
    vocab_name, value_words = _resolve_vocab(vocab)
    key_words = list(KEY_NAMES if keys is None else keys)
    if not key_words:
        raise ValueError("keys is empty; pass at least n_facts distinct key words.")
    if len(set(key_words)) != len(key_words):
        raise ValueError(f"keys must be distinct; received duplicates in {key_words}.")
    key_list = "the default key names" if keys is None else "the given keys (--keys)"
    value_list = f"vocab {vocab_name!r}" if vocab_name != "custom" else "the given values (--values)"
    key_words, key_ids, dropped_keys = _check_words(tokenizer, tmpl, key_words, "key", value_words[0],
                                                    on_multitoken, key_list)
    if not key_words:
        raise ValueError(f"none of the {len(dropped_keys)} words of {key_list} is a single token in template "
                         f"{tmpl.name!r} for this tokenizer (e.g. {next(iter(dropped_keys.items()))}); "
                         f"pass single-token keys with --keys.")
    value_words, value_ids, dropped_values = _check_words(tokenizer, tmpl, value_words, "value", key_words[0],
                                                          on_multitoken, value_list)
    if set(value_ids) & set(key_ids):
        raise ValueError("a key and a value map to the same token id; keys and values must be distinct words.")
    if report is not None:
        report.update({"dropped_values": dropped_values, "dropped_keys": dropped_keys,
                       "n_filtered": len(dropped_values) + len(dropped_keys),
                       "value_list": value_list, "key_list": key_list,
                       "n_values_kept": len(value_words), "n_keys_kept": len(key_words)})
    after = " after dropping the words that are not single tokens" if (dropped_keys or dropped_values) else ""
    if n_facts > len(key_words):
        raise ValueError(f"n_facts={n_facts} bindings need {n_facts} distinct keys, but {key_list} has only "
                         f"{len(key_words)} single-token keys{after} (dropped: {sorted(dropped_keys)}); "
                         f"lower n_facts or pass more keys (--keys).")
    if len(value_words) < n_candidates:
        raise ValueError(f"{value_list} has {len(value_words)} single-token values{after} (dropped: "
                         f"{sorted(dropped_values)}); at least n_candidates={n_candidates} are needed. Use another "
                         f"vocabulary or pass values (--values).")
    min_values = 2 + (variant == "update") + (n_facts > 1)
    if len(value_words) < min_values:
        raise ValueError(f"{value_list} has {len(value_words)} single-token values{after}; variant={variant!r} "
                         f"with n_facts={n_facts} needs at least {min_values}. Use another vocabulary or pass values "
                         f"(--values).")
    ids, offsets, _, _, fact_tokens, query_tokens, _ = _probe(tokenizer, tmpl, key_words[0], value_words[0])
    if fact_tokens is None or query_tokens is None:
        raise ValueError(f"template {tmpl.name!r}: its fact or query merges with the surrounding text in this "
                         "tokenizer's tokens; choose another template.")
    template_ids = ids[fact_tokens[0]:fact_tokens[1]] + ids[query_tokens[0]:query_tokens[1]]
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is not None and unk in template_ids:
        raise ValueError(f"template {tmpl.name!r} contains words unknown to this tokenizer (tokens "
                         f"{token_strings(tokenizer, template_ids)}); add them to its vocabulary or choose another "
                         "template.")
    return _Vocabulary(vocab_name, key_words, key_ids, value_words, value_ids,
                       fact_tokens[1] - fact_tokens[0], query_tokens[1] - query_tokens[0])


@dataclass(frozen=True)
class _Layout:
    """The planned token layout of one call: [bos] lead, then each presentation followed by a gap (the last one by
    the long filler), then the query prompt. Filler pieces are exact token counts; the whole prompt is then
    tokenised as text, so the actual length can differ by the merges the tokenizer makes across piece borders."""

    template: Template
    fact_len: int
    query_len: int
    filler_lengths: list[int]  # token counts of the filler pieces, in layout order
    length: int             # planned tokens per sequence


def _layout(tokenizer, tmpl: Template, words: _Vocabulary, n_facts: int, presentations: int, filler_tokens: int,
            gap_tokens: int, lead_tokens: int, add_bos: bool, max_length: int | None) -> _Layout:
    n_pres_total = n_facts * presentations
    if add_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("add_bos=True but this tokenizer has no bos_token_id; pass add_bos=False.")
    specials = len(encode_text(tokenizer, "the")[0]) - len(encode_continuation(tokenizer, "the", leading_space=False))
    bos = max(specials, int(add_bos))
    filler_lengths = [lead_tokens] + [gap_tokens] * (n_pres_total - 1) + [filler_tokens]
    length = bos + sum(filler_lengths) + n_pres_total * words.fact_len + words.query_len
    if max_length is not None and length > max_length:
        raise ValueError(
            f"filler_tokens={filler_tokens} with n_facts={n_facts}, presentations={presentations}, "
            f"gap_tokens={gap_tokens} makes sequences {length} tokens long, more than max_length={max_length}; "
            f"lower filler_tokens to at most {filler_tokens - (length - max_length)} or shrink the layout.")
    return _Layout(tmpl, words.fact_len, words.query_len, filler_lengths, length)


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
    """One pair's donor and recipient context as text (everything before the query prompt), what it binds and where
    (character spans: facts and values in the recipient's text, the target's values in the donor's)."""

    recipient: str
    donor: str
    fact_chars: list[list[tuple[int, int]]]
    value_chars: list[list[tuple[int, int]]]
    donor_value_chars: list[tuple[int, int] | None]  # the target's presentations, in round order
    fact_keys: list[int]    # key index of each fact
    fact_values: list[int]  # recipient value index of each fact
    stale_value: int        # the overwritten value (update), else -1
    updated_rounds: list[int]


def _context(rng: random.Random, layout: _Layout, words: _Vocabulary, pieces: list[str], spare: list[str],
             target: int, r_value: int, d_value: int, n_facts: int, presentations: int, variant: str,
             n_updated: int) -> _Context:
    """Draw the other facts' keys and values and the presentation order, and write both contexts as text."""
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

    # Segments in order: (recipient text, donor text, (fact, round, recipient value span, donor value span) or None).
    segments: list[tuple[str, str, tuple | None]] = []
    piece_iter, spare_iter = iter(pieces), iter(spare)

    def add_filler() -> None:
        chunk = next(piece_iter)
        segments.append((chunk, chunk, None))

    add_filler()
    value_word = words.value_words
    for rnd, f in order:
        key = words.key_words[fact_keys[f]]
        if f == target and variant == "update" and rnd not in updated_rounds:
            r_val = d_val = value_word[stale_value]
        elif f == target and variant in ("swap", "update"):
            r_val, d_val = value_word[r_value], value_word[d_value]
        else:
            r_val = d_val = value_word[fact_values[f]]
        r_text, r_span, _ = _render(layout.template.fact, key, r_val)
        d_text, d_span, _ = _render(layout.template.fact, key, d_val)
        if f == target and variant == "neutral":
            d_text, d_span = next(spare_iter), None
        segments.append((r_text, d_text, (f, rnd, r_span, d_span)))
        add_filler()

    fact_chars = [[None] * presentations for _ in range(n_facts)]
    value_chars = [[None] * presentations for _ in range(n_facts)]
    donor_value_chars: list = [None] * presentations
    r_parts, d_parts, r_len, d_len = [], [], 0, 0
    for r_text, d_text, tag in segments:
        if not r_text and not d_text:
            continue
        if r_parts:   # segments are joined by one space
            r_len, d_len = r_len + 1, d_len + 1
        if tag is not None:
            f, rnd, r_span, d_span = tag
            fact_chars[f][rnd] = (r_len, r_len + len(r_text))
            value_chars[f][rnd] = (r_len + r_span[0], r_len + r_span[1])
            if f == target and d_span is not None:
                donor_value_chars[rnd] = (d_len + d_span[0], d_len + d_span[1])
        r_parts.append(r_text)
        d_parts.append(d_text)
        r_len, d_len = r_len + len(r_text), d_len + len(d_text)
    return _Context(" ".join(r_parts), " ".join(d_parts), fact_chars, value_chars, donor_value_chars, fact_keys,
                    fact_values, stale_value, updated_rounds)


def _tokenise_prompt(tokenizer, text: str, add_bos: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """The model tokenizer's ids of `text` (its own specials), with a BOS in front when `add_bos` asks for one and
    the tokenizer did not add it."""
    ids, offsets = encode_text(tokenizer, text)
    if add_bos and (not ids or ids[0] != tokenizer.bos_token_id):
        ids, offsets = [tokenizer.bos_token_id] + ids, [(0, 0)] + offsets
    return ids, offsets


class MisalignedPairError(ValueError):
    """A donor/recipient pair whose tokens differ outside the target value (or fact, for neutral pairs)."""


def _token_span(text: str, offsets, chars: tuple[int, int], what: str) -> tuple[int, int]:
    span = span_tokens(text, offsets, *chars)
    if span is None:
        raise MisalignedPairError(f"{what} ({text[chars[0]:chars[1]]!r}) shares a token with the text around it in "
                                  "this tokenizer, so its tokens cannot be told apart; choose another template or "
                                  "other words.")
    return span


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
               layout: "PairLayout | str | None" = None, n_facts: int | None = None,
               presentations: int | None = None, filler_tokens: int | None = None, gap_tokens: int | None = None,
               lead_tokens: int | None = None, template: str | Template | None = None,
               vocab: str | Sequence[str] = "cities", keys: Sequence[str] | None = None,
               values: Sequence[str] | None = None, variant: str = "swap", queries: str = "target",
               n_updated: int = 1, pairs_per_source: int = 1, n_candidates: int = 4, seed: int = 0,
               max_length: int | None = None, on_multitoken: str = "filter", add_bos: bool = False,
               report: dict | None = None, equal_length: bool = True) -> Iterator[RecallPair]:
    """Yield recall pairs: `pairs_per_source` per source (rows per pair: 1, or n_facts with queries='all').

    Layout: `layout` (a PairLayout or a name in interp.data.layout.LAYOUTS; default "where_is"), with any of
    n_facts, presentations, filler_tokens, gap_tokens, lead_tokens, template given here overriding its field: lead
    filler, then `presentations` rounds presenting every fact once (order shuffled per round) separated by
    `gap_tokens` of filler, then `filler_tokens` of filler, then the query prompt.

    Every prompt is written as text and tokenised once by `tokenizer` itself (its BOS and special tokens as its
    config says; `add_bos` adds a BOS when the tokenizer does not), so the ids are `tokenizer(text).input_ids`; every
    span (facts, values, query) comes from the tokens' character offsets. Donor and recipient differ only at the
    target value's token (the target fact's tokens for neutral pairs), which is checked on every pair.

    Words: keys (default the recall key names) and values (`values`, or the vocabulary `vocab`: a name or a list)
    must each be one token where the template puts them and must not change the tokens around them.
    on_multitoken='filter' (the default) drops the others and lists them in `report` (dropped_keys, dropped_values,
    each word with its tokens); a call refuses only when fewer remain than the task needs, naming the list and the
    count. on_multitoken='error' refuses any such word by name.

    Filler comes from `sources` when given (e.g. interp.data.corpora), else from generated filler sources 0..n-1 of
    `split` under `seed`; filler pieces are exact token counts on word boundaries before the prompt is tokenised as a
    whole, so a prompt can be a few tokens shorter than planned where the tokenizer merges across piece borders
    (rows of one batch are then left-padded). Pass a dict as `report` to receive what was filtered.

    equal_length=True (the default) lengthens or shortens the last filler piece, a word at a time, until every prompt
    has the planned token count; equal_length=False keeps each prompt at its natural length (the filler pieces as
    drawn). Rows of a batch then differ in length (PairBatch.lengths): the scan and the confirmation run them packed
    (cu_seqlens), never computing their padding; other analyses run the left-padded rows as they are.
    """
    if not isinstance(equal_length, bool):
        raise ValueError(f"equal_length must be True or False; received {equal_length!r}.")
    require_tokenizer(tokenizer)
    base = resolve_layout(layout) if layout is not None else LAYOUTS["where_is"]
    if isinstance(template, Template):
        tmpl = template
        template = None
    else:
        tmpl = None
    base = base.with_(n_facts=n_facts, presentations=presentations, filler_tokens=filler_tokens,
                      gap_tokens=gap_tokens, lead_tokens=lead_tokens, template=template)
    n_facts, presentations, filler_tokens, gap_tokens = (base.n_facts, base.presentations, base.filler_tokens,
                                                         base.gap_tokens)
    lead_tokens = gap_tokens if base.lead_tokens is None else base.lead_tokens
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
    tmpl = tmpl or _resolve_template(base.template)
    words = _vocabulary(tokenizer, tmpl, keys, vocab if values is None else list(values), on_multitoken, n_facts,
                        n_candidates, variant, report)
    plan = _layout(tokenizer, tmpl, words, n_facts, presentations, filler_tokens, gap_tokens, lead_tokens, add_bos,
                   max_length)
    if report is not None:
        report["layout"] = {**base.to_dict(), "template": tmpl.name, "lead_tokens": lead_tokens}
    reserved = frozenset(words.key_ids) | frozenset(words.value_ids)
    n_values = len(words.value_ids)
    n_pairs = len(sources) * pairs_per_source
    schedule = _schedule(n_pairs, n_values, n_candidates, n_facts, random.Random(
        f"recall-schedule/{seed}/{tmpl.name}/{words.name}/{variant}/{n_pairs}"))

    pair_index = 0
    for source in sources:
        # Filler pieces in layout order, each an exact token count on word boundaries; shared by the source's pairs.
        stream = source.stream(tokenizer, reserved)
        piece_ids = [stream.take(n) for n in plan.filler_lengths]
        pieces = [decode_text(tokenizer, ids).strip() for ids in piece_ids]
        spare = ([decode_text(tokenizer, stream.take(plan.fact_len)).strip() for _ in range(presentations)]
                 if variant == "neutral" else [])
        slack = _slack(stream) if plan.filler_lengths[-1] and equal_length else []
        for j in range(pairs_per_source):
            i = pair_index
            pair_index += 1
            seed_text = (f"recall-pair/{seed}/{source.split}/{source.origin}/{source.id}/{j}/{tmpl.name}/"
                         f"{words.name}/{variant}/{i}")
            target = schedule.target[i]
            r_value, d_value = schedule.recipient_answer[i], schedule.donor_answer[i]
            rng, ctx = _fit_context(tokenizer, seed_text, plan, words, pieces, slack, spare, target,
                                    r_value, d_value, n_facts, presentations, variant, n_updated, add_bos)
            keys_out = [words.key_words[ctx.fact_keys[f]] for f in range(n_facts)]
            r_values_out = [words.value_words[ctx.fact_values[f]] for f in range(n_facts)]
            d_values_out = list(r_values_out)
            d_values_out[target] = "" if variant == "neutral" else words.value_words[d_value]
            for q in [target] if queries == "target" else range(n_facts):
                query_text = _render(tmpl.query, words.key_words[ctx.fact_keys[q]], None)[0]
                spans = _prompt_spans(tokenizer, ctx, query_text, words, target, variant, add_bos,
                                      f"pair {i} (source {source.id} of {source.split}, key "
                                      f"{keys_out[target]!r})")
                recipient_ids, donor_ids, fact_spans, value_spans, query_start, query_pos = spans
                chosen, answer_slot, donor_slot, stale_slot = _candidates(
                    rng, q, target, r_value, d_value, schedule.slots[i], ctx, n_values, n_candidates, variant)
                yield RecallPair(
                    recipient_ids=recipient_ids, donor_ids=donor_ids,
                    fact_spans=fact_spans, value_spans=value_spans,
                    query_start=query_start, query_pos=query_pos,
                    candidate_ids=[words.value_ids[v] for v in chosen],
                    candidates=[words.value_words[v] for v in chosen],
                    recipient_answer_index=answer_slot, donor_answer_index=donor_slot,
                    stale_answer_index=stale_slot, target_fact=target, queried_fact=q, keys=keys_out,
                    recipient_values=r_values_out, donor_values=d_values_out, source_id=source.id,
                    split=source.split, origin=source.origin, template=tmpl.name, vocab=words.name,
                    variant=variant, group=i, updated_presentations=ctx.updated_rounds,
                )


# Extra filler tokens drawn after a source's pieces, to lengthen or shorten the last filler piece of a prompt whose
# tokenizer merged tokens across piece borders, so every prompt of a call keeps the planned length.
_SLACK_TOKENS = 16


def _slack(stream) -> list[int]:
    try:
        return stream.take(_SLACK_TOKENS, whole_words=False)
    except ValueError:   # a short corpus window: no slack, prompts may then differ in length
        return []


def _fit_context(tokenizer, seed_text: str, plan: _Layout, words: _Vocabulary, pieces: list[str],
                 slack: list[int], spare: list[str], target: int, r_value: int, d_value: int,
                 n_facts: int, presentations: int, variant: str, n_updated: int, add_bos: bool):
    """The pair's context (and its random generator, advanced past the context's draws), with the last filler piece
    lengthened from `slack` or shortened, a whole word at a time at either end, until the prompt has the planned
    token count (when a few tries reach it; otherwise the closest is kept)."""

    def build(piece: str | None):
        rng = random.Random(seed_text)
        chosen = pieces if piece is None else pieces[:-1] + [piece]
        ctx = _context(rng, plan, words, chosen, spare, target, r_value, d_value, n_facts, presentations, variant,
                       n_updated)
        query = _render(plan.template.query, words.key_words[ctx.fact_keys[target]], None)[0]
        text = ctx.recipient + (" " if ctx.recipient else "") + query
        return rng, ctx, len(_tokenise_prompt(tokenizer, text, add_bos)[0]) - plan.length

    rng, ctx, excess = build(None)
    if excess == 0 or not slack:
        return rng, ctx
    pool = decode_text(tokenizer, slack).split() + pieces[-1].split()
    n_slack, n = len(pool) - len(pieces[-1].split()), len(pool)
    counts = [len(encode_continuation(tokenizer, w)) for w in pool]
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    want = prefix[n] - prefix[n_slack] - excess
    # Word windows [start, stop) whose words, counted one by one, give the wanted count; nearest the original first.
    windows = sorted(((abs(start - n_slack) + (n - stop), start, stop) for start in range(n)
                      for stop in range(max(start + 1, n - 8), n + 1) if prefix[stop] - prefix[start] == want))
    best = (abs(excess), rng, ctx)
    for _, start, stop in windows[:12]:
        rng, ctx, excess = build(" ".join(pool[start:stop]))
        if excess == 0:
            return rng, ctx
        if abs(excess) < best[0]:
            best = (abs(excess), rng, ctx)
    return best[1], best[2]


def _prompt_spans(tokenizer, ctx: _Context, query_text: str, words: _Vocabulary, target: int, variant: str,
                  add_bos: bool, where: str):
    """Tokenise recipient and donor prompts; recover every span from the offsets and check that the two differ
    only where they must (MisalignedPairError, naming the pair and the words, otherwise)."""
    sep = " " if ctx.recipient else ""
    r_text, d_text = ctx.recipient + sep + query_text, ctx.donor + sep + query_text
    r_ids, r_off = _tokenise_prompt(tokenizer, r_text, add_bos)
    d_ids, d_off = _tokenise_prompt(tokenizer, d_text, add_bos)
    query_start, query_end = _token_span(r_text, r_off, (len(ctx.recipient) + len(sep), len(r_text)),
                                         f"{where}: the query")
    if query_end != len(r_ids):
        raise ValueError(f"this tokenizer appends {token_strings(tokenizer, r_ids[query_end:])} after the text, so "
                         "the answer would not be the next token after the query; use a tokenizer configuration "
                         "that adds no end-of-sequence token.")
    fact_spans = [[_token_span(r_text, r_off, c, f"{where}: a fact") for c in f] for f in ctx.fact_chars]
    value_spans = [[_token_span(r_text, r_off, c, f"{where}: a value") for c in f] for f in ctx.value_chars]
    value_ids = set(words.value_ids)
    for spans in value_spans:
        for (a, b) in spans:
            if b - a != 1 or r_ids[a] not in value_ids:
                raise MisalignedPairError(f"{where}: a value tokenises as {token_strings(tokenizer, r_ids[a:b])} "
                                          "in the prompt, not as its single token; drop it with --values.")
    # Where donor and recipient may differ: the target's value tokens (its whole fact for neutral pairs).
    allowed = set()
    for rnd, (a, b) in enumerate(fact_spans[target] if variant == "neutral" else value_spans[target]):
        allowed.update(range(a, b))
        if variant != "neutral" and ctx.donor_value_chars[rnd] is not None:
            donor_span = span_tokens(d_text, d_off, *ctx.donor_value_chars[rnd])
            if donor_span != (a, b):
                allowed = None
                break
    differ = None if len(d_ids) != len(r_ids) else [t for t, (x, y) in enumerate(zip(r_ids, d_ids)) if x != y]
    if allowed is None or differ is None or not set(differ) <= allowed:
        raise MisalignedPairError(
            f"{where}: the donor's tokens differ from the recipient's outside the target "
            f"{'fact' if variant == 'neutral' else 'value'} (recipient {len(r_ids)} tokens, donor {len(d_ids)}): "
            f"a word changes the tokens around it in this tokenizer. Drop the target's value "
            f"{r_text[slice(*ctx.value_chars[target][-1])]!r} with --values, or use another template.")
    return r_ids, d_ids, fact_spans, value_spans, query_start, query_end - 1


def _pad_id(tokenizer) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return 0 if pad is None else int(pad)


def build_pairs(tokenizer, sources: Sequence[Source] | None = None, *, split: str = "dev", n_sources: int = 16,
                **kwargs) -> PairBatch:
    """All pairs of `iter_pairs` collated into a PairBatch (same arguments; see iter_pairs): among them
    layout= (a PairLayout or "paper" / "where_is"), keys= and values= (word lists), vocab=, and
    on_multitoken="filter" (default: words that are not single tokens where the template puts them are dropped and
    listed in batch.report) or "error" (refused by name).

    report (on the batch): dropped keys/values with their tokenisations, the count filtered, and the filler's
    unknown-token count and rate (filler_unknown_rate).
    """
    for name in ("keys", "values"):
        words = kwargs.get(name)
        if words is not None and (isinstance(words, (str, bytes)) or not hasattr(words, "__len__")
                                  or len(words) < 2):
            raise ValueError(f"build_pairs: {name}= must be a list of at least 2 words (a pair needs the recipient's "
                             f"and the donor's), got {words!r}; or leave it out for the default list")
    report: dict = {}
    pairs = list(iter_pairs(tokenizer, split, n_sources, sources=sources, report=report, **kwargs))
    batch = PairBatch.collate(pairs, _pad_id(tokenizer), report=report)
    batch.report.update(filler_unknown_rate(batch, tokenizer))
    batch.report["tokenizer_hash"] = vocabulary_hash(tokenizer)   # checked against the model (check_pairs)
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
