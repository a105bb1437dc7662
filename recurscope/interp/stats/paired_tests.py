"""Exact McNemar tests of two arms on the same items."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

# --------------------------------------------------------------------------------------------------------------
# Paired and binomial tests
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test of two arms on the same items. b01: items A got wrong and B got right; b10: A right, B
    wrong. accuracy_difference = accuracy_a - accuracy_b = (b10 - b01) / n."""

    n: int
    b01: int
    b10: int
    both_correct: int
    both_wrong: int
    p_value: float
    accuracy_a: float
    accuracy_b: float
    accuracy_difference: float

    def as_dict(self) -> dict:
        return asdict(self)


def _as_correct(name: str, values) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one entry per item), got shape {arr.shape}")
    if arr.dtype != bool:
        if not np.issubdtype(arr.dtype, np.number) or not np.all(np.isin(arr, (0, 1))):
            raise ValueError(f"{name} must hold booleans or 0/1 (item answered correctly), got values such as "
                             f"{np.unique(arr)[:5].tolist()}")
        arr = arr.astype(bool)
    return arr


def mcnemar_exact(correct_a, correct_b) -> McNemarResult:
    """Exact two-sided McNemar test: a binomial test (p = 1/2) on the discordant pairs via scipy.stats.binomtest.
    With no discordant pairs the p-value is 1."""
    a = _as_correct("correct_a", correct_a)
    b = _as_correct("correct_b", correct_b)
    if len(a) != len(b):
        raise ValueError(f"correct_a and correct_b must be paired item by item, got {len(a)} and {len(b)} items")
    if len(a) == 0:
        raise ValueError("correct_a is empty: need at least one paired item")
    b01 = int(np.sum(~a & b))
    b10 = int(np.sum(a & ~b))
    discordant = b01 + b10
    p_value = 1.0 if discordant == 0 else float(sps.binomtest(b01, discordant, 0.5).pvalue)
    n = len(a)
    acc_a, acc_b = float(a.mean()), float(b.mean())
    return McNemarResult(n, b01, b10, int(np.sum(a & b)), int(np.sum(~a & ~b)), p_value, acc_a, acc_b,
                         (b10 - b01) / n)


def mcnemar_table(frame: pd.DataFrame, *, arm_col: str, correct_col: str, item_col: str, reference,
                  by: Sequence[str] = ()) -> pd.DataFrame:
    """McNemar tests of every arm against ``reference`` within each group of ``by``, pairing rows on ``item_col``
    (e.g. the QED strength test: every strength s against s = 1 at each length, on the same 500 samples).

    Columns: *by, arm, reference, n, accuracy, accuracy_reference, difference_pp (arm minus reference, percentage
    points), b01 (items the arm got wrong and the reference right), b10 (arm right, reference wrong), p_value.
    """
    by = [by] if isinstance(by, str) else list(by)
    missing = [c for c in [arm_col, correct_col, item_col, *by] if c not in frame.columns]
    if missing:
        raise ValueError(f"frame is missing columns {missing}; it has {list(frame.columns)}")
    if reference not in set(frame[arm_col]):
        raise ValueError(f"reference arm {reference!r} does not occur in column {arm_col!r}; arms present: "
                         f"{sorted(map(str, set(frame[arm_col])))}")
    dup = frame.duplicated([*by, arm_col, item_col])
    if dup.any():
        raise ValueError(f"each (group, arm, item) must occur once for a paired test, got {int(dup.sum())} "
                         f"duplicates of {[*by, arm_col, item_col]}; deduplicate first")
    records = []
    groups = frame.groupby(by, sort=True) if by else [((), frame)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        ref = group[group[arm_col] == reference].set_index(item_col)[correct_col]
        if len(ref) == 0:
            raise ValueError(f"group {dict(zip(by, key))} has no rows for the reference arm {reference!r}")
        for arm in pd.unique(group[arm_col]):
            if arm == reference:
                continue
            this = group[group[arm_col] == arm].set_index(item_col)[correct_col]
            if set(this.index) != set(ref.index):
                raise ValueError(f"arm {arm!r} in group {dict(zip(by, key))} was scored on different items than the "
                                 f"reference ({len(set(this.index) ^ set(ref.index))} items differ); a paired test "
                                 f"needs the same items")
            res = mcnemar_exact(this.to_numpy(), ref.reindex(this.index).to_numpy())
            records.append({**dict(zip(by, key)), "arm": arm, "reference": reference, "n": res.n,
                            "accuracy": res.accuracy_a, "accuracy_reference": res.accuracy_b,
                            "difference_pp": 100.0 * res.accuracy_difference, "b01": res.b01, "b10": res.b10,
                            "p_value": res.p_value})
    return pd.DataFrame.from_records(records, columns=[*by, "arm", "reference", "n", "accuracy", "accuracy_reference",
                                                       "difference_pp", "b01", "b10", "p_value"])
