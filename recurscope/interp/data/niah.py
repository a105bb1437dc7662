"""S-NIAH-style single-needle retrieval (RULER S-NIAH-1 layout) for the QED experiments, sized in tokens.

A haystack of repeated noise sentences holds one needle "the special magic number for KEY is VALUE." at a chosen
depth; the query prompt ends so that the answer (a single-token number) is the next token.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .tokenizer import encode_continuation, single_token_ids
from .words import KEY_NAMES, NEEDLE, NIAH_QUERY, NOISE_SENTENCES, NUMBER_WORDS, niah_words

__all__ = ["NOISE_SENTENCES", "NEEDLE", "NIAH_QUERY", "NiahBatch", "build_niah", "niah_words"]

@dataclass
class NiahBatch:
    """N single-needle examples of one length T. Positions are token indices; spans are half-open."""

    input_ids: torch.Tensor        # (N, T) long
    answer_ids: torch.Tensor       # (N,) token id of the needle's number
    answer_index: torch.Tensor     # (N,) index of the answer in candidate_ids
    candidate_ids: torch.Tensor    # (V,) the number vocabulary's token ids
    needle_span: torch.Tensor      # (N, 2)
    value_pos: torch.Tensor        # (N,) position of the value token inside the needle
    query_start: torch.Tensor      # (N,)
    query_pos: torch.Tensor        # (N,) last prompt token; logits here predict the answer
    depth: torch.Tensor            # (N,) requested depth in [0, 1]
    actual_depth: torch.Tensor     # (N,) needle start / haystack length after snapping to a sentence boundary
    candidates: list[str]
    keys: list[str]
    values: list[str]
    report: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def score(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-example correctness from logits (N, V_full) at query_pos, or (N, T, V_full) for whole sequences.

        candidate_correct: argmax over the number vocabulary is the answer; vocab_correct: argmax over the full
        vocabulary is the answer.
        """
        if logits.dim() == 3:
            logits = logits[torch.arange(logits.shape[0], device=logits.device), self.query_pos.to(logits.device)]
        if logits.dim() != 2 or logits.shape[0] != len(self):
            raise ValueError(f"logits must be (N, V) or (N, T, V) with N={len(self)}; received {tuple(logits.shape)}.")
        cand = logits[:, self.candidate_ids.to(logits.device)]
        return {
            "candidate_correct": (cand.argmax(-1).cpu() == self.answer_index),
            "vocab_correct": (logits.argmax(-1).cpu() == self.answer_ids),
        }

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({
            "key": self.keys, "value": self.values, "answer_id": self.answer_ids.tolist(),
            "answer_index": self.answer_index.tolist(), "depth": self.depth.tolist(),
            "actual_depth": self.actual_depth.tolist(), "needle_start": self.needle_span[:, 0].tolist(),
            "needle_end": self.needle_span[:, 1].tolist(), "value_pos": self.value_pos.tolist(),
            "query_pos": self.query_pos.tolist(), "length": [self.input_ids.shape[1]] * len(self),
        })


def _slot_encode(tokenizer, text: str, key_id: int, value_id: int | None) -> tuple[list[int], int]:
    """Encode a needle/query string; returns (ids, offset of the value token or -1)."""
    out: list[int] = []
    value_offset = -1
    for index, piece in enumerate(re.split(r"(\{key\}|\{value\})", text)):
        if piece == "{key}":
            out.append(key_id)
        elif piece == "{value}":
            value_offset = len(out)
            out.append(value_id)
        elif piece.strip():
            out.extend(encode_continuation(tokenizer, piece.strip(), leading_space=index == 0 or piece[0] == " "))
    return out, value_offset


def build_niah(tokenizer, n: int, total_tokens: int, *, depths: float | Sequence[float] | None = None,
               seed: int = 0, keys: Sequence[str] | None = None, numbers: Sequence[str] | None = None,
               on_multitoken: str = "error", add_bos: bool = False) -> NiahBatch:
    """`n` S-NIAH examples of exactly `total_tokens` tokens each (BOS included when `add_bos`).

    depths: one depth for all, a list cycled over the examples, or None for n evenly spaced depths in [0, 1]; the
    needle goes to the noise-sentence boundary nearest depth * haystack length. Needle values cycle through
    shuffled copies of `numbers` (default 10..99), keys are drawn from `keys` (default the recall key names).
    Deterministic for a given seed.
    """
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
    num_words, num_ids, dropped_nums = single_token_ids(tokenizer, list(numbers or NUMBER_WORDS), on_multitoken,
                                                        "number")
    if not key_words:
        raise ValueError("no single-token keys are left; pass keys that this tokenizer encodes as one token.")
    if len(num_words) < 2:
        raise ValueError(f"the number vocabulary needs at least 2 single-token numbers; {len(num_words)} left.")
    bos = []
    if add_bos:
        if getattr(tokenizer, "bos_token_id", None) is None:
            raise ValueError("add_bos=True but this tokenizer has no bos_token_id; pass add_bos=False.")
        bos = [tokenizer.bos_token_id]

    sentence_ids = [encode_continuation(tokenizer, s) for s in NOISE_SENTENCES]
    needle_len = len(_slot_encode(tokenizer, NEEDLE, key_ids[0], num_ids[0])[0])
    query_len = len(_slot_encode(tokenizer, NIAH_QUERY, key_ids[0], None)[0])
    haystack_len = total_tokens - len(bos) - needle_len - query_len
    if haystack_len < 0:
        raise ValueError(f"total_tokens={total_tokens} is too short: the needle and query alone take "
                         f"{len(bos) + needle_len + query_len} tokens; ask for at least that many.")
    haystack: list[int] = []
    boundaries = [0]
    while len(haystack) < haystack_len:
        haystack.extend(sentence_ids[(len(boundaries) - 1) % len(sentence_ids)])
        boundaries.append(len(haystack))
    haystack = haystack[:haystack_len]
    boundaries = sorted({b for b in boundaries if b <= haystack_len} | {haystack_len})

    rng = random.Random(f"niah/{seed}/{total_tokens}/{n}")
    value_order: list[int] = []
    while len(value_order) < n:
        block = list(range(len(num_ids)))
        rng.shuffle(block)
        value_order.extend(block)
    rows, answers, spans, value_pos, q_starts, actual, keys_out, values_out = [], [], [], [], [], [], [], []
    for i in range(n):
        k = rng.randrange(len(key_ids))
        v = value_order[i]
        needle, offset = _slot_encode(tokenizer, NEEDLE, key_ids[k], num_ids[v])
        query, _ = _slot_encode(tokenizer, NIAH_QUERY, key_ids[k], None)
        cut = min(boundaries, key=lambda b: (abs(b - depth_list[i] * haystack_len), b))
        ids = bos + haystack[:cut] + needle + haystack[cut:] + query
        assert len(ids) == total_tokens
        start = len(bos) + cut
        rows.append(ids)
        answers.append(num_ids[v])
        spans.append((start, start + len(needle)))
        value_pos.append(start + offset)
        q_starts.append(total_tokens - len(query))
        actual.append(cut / haystack_len if haystack_len else 0.0)
        keys_out.append(key_words[k])
        values_out.append(num_words[v])
    return NiahBatch(
        input_ids=torch.tensor(rows, dtype=torch.long),
        answer_ids=torch.tensor(answers, dtype=torch.long),
        answer_index=torch.tensor([value_order[i] for i in range(n)], dtype=torch.long),
        candidate_ids=torch.tensor(num_ids, dtype=torch.long),
        needle_span=torch.tensor(spans, dtype=torch.long),
        value_pos=torch.tensor(value_pos, dtype=torch.long),
        query_start=torch.tensor(q_starts, dtype=torch.long),
        query_pos=torch.full((n,), total_tokens - 1, dtype=torch.long),
        depth=torch.tensor(depth_list, dtype=torch.float32),
        actual_depth=torch.tensor(actual, dtype=torch.float32),
        candidates=num_words, keys=keys_out, values=values_out,
        report={"dropped_keys": dropped_keys, "dropped_numbers": dropped_nums,
                "n_filtered": len(dropped_keys) + len(dropped_nums)},
    )
