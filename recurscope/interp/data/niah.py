"""S-NIAH-style single-needle retrieval (RULER S-NIAH-1 layout) for the QED experiments, sized in tokens.

A haystack of repeated noise sentences holds one needle "the special magic number for KEY is VALUE." at a chosen
depth; the query prompt ends so that the answer (the number) follows. Each example is written as text and tokenised
once by the tokenizer (its specials as its config says). A number has two tokenisations: inside the needle
(`value_tokens`, what a donor replaces) and as the answer after the query's last word (`candidate_tokens`, " 42"
after "is": with Qwen's digit-splitting vocabulary a lone space token then each digit). Either may be several tokens:
the answer is then scored by the full conditional log-likelihood of each of a few balanced candidate numbers
(`NiahBatch.candidate_loglik`), as the paper scores its four candidates. Numbers whose answers are not distinct
token sequences, or whose tokens merge with the text around them, are dropped and listed before any prompt is
written (or refused by name with on_multitoken='error').
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .scoring import continuation_batch, forward_at_positions, sequence_loglik
from .tokenizer import require_tokenizer, decode_text, encode_continuation, encode_text, single_token_ids, span_tokens, token_strings
from .words import KEY_NAMES, NEEDLE, NIAH_QUERY, NOISE_SENTENCES, NUMBER_WORDS, niah_words

__all__ = ["NOISE_SENTENCES", "NEEDLE", "NIAH_QUERY", "NiahBatch", "build_niah", "niah_words"]

@dataclass
class NiahBatch:
    """N single-needle examples of one length T. Positions are token indices; spans are half-open."""

    input_ids: torch.Tensor        # (N, T) long
    answer_ids: torch.Tensor       # (N,) first token of the answer after the query (candidate_tokens[answer][0])
    answer_index: torch.Tensor     # (N,) index of the answer in candidates / candidate_tokens
    candidate_ids: torch.Tensor    # (V,) first token of each number's answer after the query
    needle_span: torch.Tensor      # (N, 2)
    value_pos: torch.Tensor        # (N,) position of the value's first token inside the needle
    query_start: torch.Tensor      # (N,)
    query_pos: torch.Tensor        # (N,) last prompt token; logits here predict the answer
    depth: torch.Tensor            # (N,) requested depth in [0, 1]
    actual_depth: torch.Tensor     # (N,) needle start / haystack length after snapping to a sentence boundary
    candidates: list[str]
    keys: list[str]
    values: list[str]
    report: dict = field(default_factory=dict)
    candidate_tokens: list[list[int]] = field(default_factory=list)  # (V,) each number's answer tokens after the query
    value_tokens: list[list[int]] = field(default_factory=list)      # (V,) each number's tokens inside the needle
    choices: torch.Tensor | None = None     # (N, C) number indices scored per example; the answer among them
    choice_answer: torch.Tensor | None = None  # (N,) slot of the answer in choices

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def multi_token(self) -> bool:
        """Whether some number's answer is several tokens (then only candidate_loglik scores it)."""
        return any(len(t) > 1 for t in self.candidate_tokens)

    def score(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example correctness from logits (N, V_full) at query_pos, or (N, T, V_full) for whole sequences.

        candidate_correct: argmax over the number vocabulary is the answer; vocab_correct: argmax over the full
        vocabulary is the answer. Single-token numbers only; see candidate_loglik otherwise.
        """
        if self.multi_token:
            raise ValueError("some numbers are several tokens for this tokenizer, so one position's logits cannot "
                             "score them; use NiahBatch.candidate_loglik(forward) (full conditional likelihood).")
        if logits.dim() == 3:
            logits = logits[torch.arange(logits.shape[0], device=logits.device), self.query_pos.to(logits.device)]
        if logits.dim() != 2 or logits.shape[0] != len(self):
            raise ValueError(f"logits must be (N, V) or (N, T, V) with N={len(self)}; received {tuple(logits.shape)}.")
        cand = logits[:, self.candidate_ids.to(logits.device)]
        return {
            "candidate_correct": (cand.argmax(-1).cpu() == self.answer_index),
            "vocab_correct": (logits.argmax(-1).cpu() == self.answer_ids),
        }

    def candidate_loglik(self, forward, batch_size: int = 8) -> dict[str, torch.Tensor]:
        """Full conditional log-likelihood of each example's `choices`: log p(c_1 .. c_m | prompt), summed over the
        candidate's answer tokens (candidate_tokens), from `forward(ids (B, T)[, logit_positions=(B, P)])` of a
        causal LM. Only the m answer positions are scored (scoring.sequence_loglik: logits in the model's dtype,
        float32 accumulation); a forward that takes `logit_positions` (the project's models) unembeds only those.
        Candidates of different lengths are right-padded, which no scored position sees.

        Returns loglik (N, C), correct (N,) bool (the answer has the highest likelihood) and margin (N,): the
        answer's log-likelihood minus the best other candidate's."""
        if self.choices is None:
            raise ValueError("this batch has no choices; build it with build_niah(..., n_choices=C).")
        n, c = self.choices.shape
        owners = [(i, slot) for i in range(n) for slot in range(c)]
        loglik = torch.zeros(n, c, dtype=torch.float64)
        for lo in range(0, len(owners), batch_size):
            chunk = owners[lo:lo + batch_size]
            prompts = self.input_ids[[i for i, _ in chunk]]
            conts = [self.candidate_tokens[int(self.choices[i, slot])] for i, slot in chunk]
            ids, positions, tokens, mask = continuation_batch(prompts, conts)
            with torch.no_grad():
                logits = forward_at_positions(forward, ids, positions)
                scores = sequence_loglik(logits, tokens, mask).double().cpu()
            for row, (i, slot) in enumerate(chunk):
                loglik[i, slot] = scores[row]
        answer = self.choice_answer
        others = loglik.clone()
        others[torch.arange(n), answer] = float("-inf")
        best_other = others.max(dim=1).values
        own = loglik[torch.arange(n), answer]
        return {"loglik": loglik, "correct": own > best_other, "margin": own - best_other}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({
            "key": self.keys, "value": self.values, "answer_id": self.answer_ids.tolist(),
            "answer_index": self.answer_index.tolist(), "depth": self.depth.tolist(),
            "actual_depth": self.actual_depth.tolist(), "needle_start": self.needle_span[:, 0].tolist(),
            "needle_end": self.needle_span[:, 1].tolist(), "value_pos": self.value_pos.tolist(),
            "query_pos": self.query_pos.tolist(), "length": [self.input_ids.shape[1]] * len(self),
        })


def _render(text: str, key: str, value: str | None) -> tuple[str, tuple[int, int] | None]:
    """`text` with {key} and {value} filled, and the character span of the value (None without one)."""
    out, pos, length, value_span = [], 0, 0, None
    for match in re.finditer(r"\{key\}|\{value\}", text):
        out.append(text[pos:match.start()])
        length += match.start() - pos
        word = key if match.group() == "{key}" else value
        if match.group() == "{value}":
            value_span = (length, length + len(word))
        out.append(word)
        length += len(word)
        pos = match.end()
    out.append(text[pos:])
    return "".join(out), value_span


_AROUND = NOISE_SENTENCES[1]   # a sentence placed around a needle when its numbers are checked


def _number_tokens(tokenizer, numbers: Sequence[str], key: str, on_multitoken: str):
    """Each number's tokens inside the needle (several are fine); numbers whose tokens merge with the needle's
    punctuation or change the tokens around them are dropped (or refused by name with on_multitoken='error')."""
    kept, tokens, dropped, rests = [], [], {}, {}
    for number in numbers:
        needle, (vs, ve) = _render(NEEDLE, key, number)
        text = f"{_AROUND} {needle} {_AROUND}"
        at = len(_AROUND) + 1
        ids, offsets = encode_text(tokenizer, text)
        span = span_tokens(text, offsets, at + vs, at + ve)
        if span is None:
            dropped[number] = token_strings(tokenizer, [t for t, (a, b) in zip(ids, offsets)
                                                        if b > a and a < at + ve and b > at + vs])
            continue
        kept.append(number)
        tokens.append(list(ids[span[0]:span[1]]))
        rests[number] = (tuple(ids[:span[0]]), tuple(ids[span[1]:]))
    if rests:
        common = max(set(rests.values()), key=list(rests.values()).count)
        for number in [w for w in kept if rests[w] != common]:
            i = kept.index(number)
            del kept[i], tokens[i]
            dropped[number] = ["(changes the tokens around it)"]
    if dropped and on_multitoken == "error":
        detail = "; ".join(f"{w!r} -> {t}" for w, t in dropped.items())
        raise ValueError(f"{len(dropped)} number(s) merge with the needle's text in this tokenizer: {detail}; pass "
                         "other numbers or on_multitoken='filter' to drop them.")
    return kept, tokens, dropped


def _answer_tokens(tokenizer, numbers: Sequence[str], key: str, on_multitoken: str):
    """Each number's tokens as the answer after the query ("... is" + " 42"): the tokens of query + answer after
    the query's own, which is what a model predicts at the query's last position. Numbers whose answer merges with
    the query's last token, or whose answer tokens equal an earlier number's (indistinguishable candidates), are
    dropped (or refused by name with on_multitoken='error')."""
    prompt = f"{_AROUND} {_render(NIAH_QUERY, key, None)[0]}"
    base = encode_continuation(tokenizer, prompt)
    kept, tokens, dropped, seen = [], [], {}, {}
    for number in numbers:
        ids = encode_continuation(tokenizer, f"{prompt} {number}")
        if ids[:len(base)] != base or len(ids) == len(base):
            dropped[number] = ["(merges with the query's last word)"]
            continue
        answer = tuple(ids[len(base):])
        if answer in seen:
            dropped[number] = [f"(the same answer tokens as {seen[answer]!r}: {token_strings(tokenizer, answer)})"]
            continue
        seen[answer] = number
        kept.append(number)
        tokens.append(list(answer))
    if dropped and on_multitoken == "error":
        detail = "; ".join(f"{w!r} {t[0]}" for w, t in dropped.items())
        raise ValueError(f"{len(dropped)} number(s) cannot be scored as answers after the query in this tokenizer: "
                         f"{detail}; pass other numbers or on_multitoken='filter' to drop them.")
    return kept, tokens, dropped


def build_niah(tokenizer, n: int, total_tokens: int, *, depths: float | Sequence[float] | None = None,
               seed: int = 0, keys: Sequence[str] | None = None, numbers: Sequence[str] | None = None,
               on_multitoken: str = "filter", add_bos: bool = False, n_choices: int = 4) -> NiahBatch:
    """`n` S-NIAH examples of exactly `total_tokens` tokens each (the tokenizer's specials, and a BOS when
    `add_bos` asks for one it does not add, included).

    depths: one depth for all, a list cycled over the examples, or None for n evenly spaced depths in [0, 1]; the
    needle goes to the noise-sentence boundary nearest depth * haystack length. Needle values cycle through
    shuffled copies of `numbers` (default 10..99), keys are drawn from `keys` (default the recall key names; keys
    that are not single tokens are dropped, or refused with on_multitoken='error'). Numbers may be several tokens;
    each example also gets `n_choices` balanced candidate numbers (its answer among them) for candidate_loglik.
    Deterministic for a given seed.
    """
    require_tokenizer(tokenizer)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1; received {n!r}.")
    if depths is None:
        depth_list = [i / (n - 1) if n > 1 else 0.0 for i in range(n)]
    elif isinstance(depths, (int, float)):
        depth_list = [float(depths)] * n
    else:
        given = [float(d) for d in depths]
        if not given:
            raise ValueError("depths must not be empty; pass None for evenly spaced depths.")
        depth_list = [given[i % len(given)] for i in range(n)]
    bad = [d for d in depth_list if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"depths must lie in [0, 1]; received {bad[:5]}.")
    key_words, key_ids, dropped_keys = single_token_ids(tokenizer, list(keys or KEY_NAMES), on_multitoken, "key")
    if not key_words:
        raise ValueError("no single-token keys are left; pass keys that this tokenizer encodes as one token.")
    num_words, num_tokens, dropped_nums = _number_tokens(tokenizer, list(numbers or NUMBER_WORDS), key_words[0],
                                                         on_multitoken)
    answer_words, answer_tokens, dropped_answers = _answer_tokens(tokenizer, num_words, key_words[0], on_multitoken)
    num_tokens = [t for w, t in zip(num_words, num_tokens) if w in answer_words]
    num_words, dropped_nums = answer_words, {**dropped_nums, **dropped_answers}
    if len(num_words) < 2:
        raise ValueError(f"the number vocabulary needs at least 2 usable numbers; {len(num_words)} left (dropped: "
                         f"{sorted(dropped_nums)}).")
    if not isinstance(n_choices, int) or not 2 <= n_choices <= len(num_words):
        raise ValueError(f"n_choices must be an integer in [2, {len(num_words)}] (the usable numbers); received "
                         f"{n_choices!r}.")
    if add_bos and getattr(tokenizer, "bos_token_id", None) is None:
        raise ValueError("add_bos=True but this tokenizer has no bos_token_id; pass add_bos=False.")
    specials = len(encode_text(tokenizer, "the")[0]) - len(encode_continuation(tokenizer, "the", leading_space=False))
    bos_len = max(specials, int(add_bos))

    def tokenise(text: str):
        ids, offsets = encode_text(tokenizer, text)
        if add_bos and (not ids or ids[0] != tokenizer.bos_token_id):
            ids, offsets = [tokenizer.bos_token_id] + ids, [(0, 0)] + offsets
        return ids, offsets

    sentence_ids = [encode_continuation(tokenizer, s) for s in NOISE_SENTENCES]
    longest = max(len(t) for t in num_tokens)
    needle_len = len(encode_continuation(tokenizer, _render(NEEDLE, key_words[0], "x")[0])) - 1 + longest
    query_len = len(encode_continuation(tokenizer, _render(NIAH_QUERY, key_words[0], None)[0]))
    haystack_len = total_tokens - bos_len - needle_len - query_len
    if haystack_len < 0:
        raise ValueError(f"total_tokens={total_tokens} is too short: the needle and query alone take "
                         f"{bos_len + needle_len + query_len} tokens; ask for at least that many.")
    haystack: list[int] = []
    boundaries = [0]
    while len(haystack) < haystack_len + 32:   # 32 tokens beyond the plan to lengthen a prompt that came out short
        haystack.extend(sentence_ids[(len(boundaries) - 1) % len(sentence_ids)])
        boundaries.append(len(haystack))
    boundaries = sorted({b for b in boundaries if b <= haystack_len} | {haystack_len})

    rng = random.Random(f"niah/{seed}/{total_tokens}/{n}")
    value_order: list[int] = []
    while len(value_order) < n:
        block = list(range(len(num_words)))
        rng.shuffle(block)
        value_order.extend(block)
    rows, answers, spans, value_pos, q_starts, actual, keys_out, values_out = [], [], [], [], [], [], [], []
    for i in range(n):
        k = rng.randrange(len(key_ids))
        v = value_order[i]
        needle, value_chars = _render(NEEDLE, key_words[k], num_words[v])
        query = _render(NIAH_QUERY, key_words[k], None)[0]
        cut = min(boundaries, key=lambda b: (abs(b - depth_list[i] * haystack_len), b))

        def write(start: int, end: int):
            before = decode_text(tokenizer, haystack[start:cut]).strip()
            after = decode_text(tokenizer, haystack[cut:end]).strip()
            text = before + " " if before else ""
            needle_at = len(text)
            text += needle + (" " + after if after else "") + " "
            return text + query, needle_at, len(text)

        # The haystack around the needle is cut from token ids and written back as text; where the tokenizer then
        # merges across a cut, the text after the needle (or, at depth 1, before it) is lengthened or shortened.
        window, tried = (0, haystack_len), {}
        while True:
            text, needle_at, query_at = write(*window)
            ids, offsets = tokenise(text)
            excess = len(ids) - total_tokens
            tried[window] = excess
            if excess == 0:
                break
            start, end = window
            wanted = [(start, end - excess)] if end - excess >= cut else [(min(start + excess, cut), end)]
            wanted += [(start, end + d) for d in range(-8, 9)] + [(start + d, end) for d in range(-8, 9)]
            nxt = next((w for w in wanted if 0 <= w[0] <= cut <= w[1] <= len(haystack) and w not in tried), None)
            if nxt is None or len(tried) >= 24:
                raise ValueError(f"example {i}: cannot write a prompt of exactly total_tokens={total_tokens} "
                                 f"tokens with this tokenizer (closest: {total_tokens + min(tried.values(), key=abs)}"
                                 f"); try a total a few tokens away.")
            window = nxt
        needle_tokens = span_tokens(text, offsets, needle_at, needle_at + len(needle))
        value_tokens = span_tokens(text, offsets, needle_at + value_chars[0], needle_at + value_chars[1])
        query_tokens = span_tokens(text, offsets, query_at, len(text))
        if None in (needle_tokens, value_tokens, query_tokens) or query_tokens[1] != len(ids) \
                or ids[value_tokens[0]:value_tokens[1]] != num_tokens[v]:
            raise ValueError(f"example {i}: the needle or query of key {key_words[k]!r} and number "
                             f"{num_words[v]!r} merges with the haystack in this tokenizer; pass other numbers.")
        rows.append(ids)
        answers.append(answer_tokens[v][0])
        spans.append(needle_tokens)
        value_pos.append(value_tokens[0])
        q_starts.append(query_tokens[0])
        actual.append(cut / haystack_len if haystack_len else 0.0)
        keys_out.append(key_words[k])
        values_out.append(num_words[v])
    # Balanced choices: the answer plus the next n_choices - 1 numbers of a shuffled cycle that skips it.
    cycle = list(range(len(num_words)))
    rng.shuffle(cycle)
    choices, choice_answer = [], []
    for i in range(n):
        v = value_order[i]
        at = cycle.index(v)
        others = [cycle[(at + d) % len(cycle)] for d in range(1, n_choices)]
        slot = rng.randrange(n_choices)
        row = others[:slot] + [v] + others[slot:]
        choices.append(row)
        choice_answer.append(slot)
    return NiahBatch(
        input_ids=torch.tensor(rows, dtype=torch.long),
        answer_ids=torch.tensor(answers, dtype=torch.long),
        answer_index=torch.tensor([value_order[i] for i in range(n)], dtype=torch.long),
        candidate_ids=torch.tensor([t[0] for t in answer_tokens], dtype=torch.long),
        needle_span=torch.tensor(spans, dtype=torch.long),
        value_pos=torch.tensor(value_pos, dtype=torch.long),
        query_start=torch.tensor(q_starts, dtype=torch.long),
        query_pos=torch.full((n,), total_tokens - 1, dtype=torch.long),
        depth=torch.tensor(depth_list, dtype=torch.float32),
        actual_depth=torch.tensor(actual, dtype=torch.float32),
        candidates=num_words, keys=keys_out, values=values_out,
        report={"dropped_keys": dropped_keys, "dropped_numbers": dropped_nums,
                "n_filtered": len(dropped_keys) + len(dropped_nums),
                "multi_token_numbers": sum(len(t) > 1 for t in num_tokens),
                "multi_token_answers": sum(len(t) > 1 for t in answer_tokens)},
        candidate_tokens=answer_tokens, value_tokens=num_tokens,
        choices=torch.tensor(choices, dtype=torch.long), choice_answer=torch.tensor(choice_answer, dtype=torch.long),
    )
