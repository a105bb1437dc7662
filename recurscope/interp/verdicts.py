"""The one verdict function every "Reading" uses to compare a measured quantity with the paper.

A Measure is an estimate with its 95% interval and the number of sources it rests on. A Claim is what the paper
says about that quantity: a sign (the effect is positive / negative), a value (the paper's number), a bound (at
least / at most a number) or a range. judge(measure, claim) returns a Verdict whose kind is one of

- AGREES: the paper's number lies inside the interval, or the interval excludes the opposite of the claim (a range
  claim of an effect, e.g. a 30-40 pp loss, also needs the interval to exclude zero);
- OPPOSITE: the interval excludes zero on the side opposite to the paper's sign;
- NO_EVIDENCE: the interval includes the reference (zero for a sign), so the data decide neither way;
- DIFFERS: the interval excludes the paper's number (or bound, or range) without a sign flip;
- TOO_FEW: fewer than MIN_SOURCES sources, or no estimate: no comparison is made;

and whose sentence carries the estimate, its interval and n. Controls (control_verdict) are judged on the
paper's metric, the donor-margin shift, against zero; the donor-specific shift is written beside it as a diagnostic
and never changes the verdict.

Where the paper gives separate numbers for its GLA and GDN models, a Reading judges a model against its own family's
number: paper_family(model) names that family, and judge_family(measure, family, {GLA: claim, GDN: claim}, ...)
picks the claim. For a family the paper did not measure (RWKV-7, Mamba-2, ...) it makes no comparison
(NOT_COMPARED) and quotes the paper's GLA and GDN numbers for context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pandas as pd

__all__ = ["AGREES", "OPPOSITE", "NO_EVIDENCE", "DIFFERS", "TOO_FEW", "NOT_COMPARED", "MIN_SOURCES", "Measure",
           "Claim", "Verdict", "judge", "control_verdict", "measure_from", "GLA", "GDN",
           "paper_family", "judge_family"]

AGREES = "agrees with the paper"
OPPOSITE = "opposite sign to the paper"
NO_EVIDENCE = "no evidence either way"
DIFFERS = "differs from the paper"
TOO_FEW = "too few sources to compare"
NOT_COMPARED = "not compared with the paper"
#: A comparison never rests on fewer sources than this (one source has no spread to tell noise from effect).
MIN_SOURCES = 2

_FORMATS = {"logit": (1.0, "+.2f", ""), "pct": (100.0, ".1f", "%"), "pp": (100.0, "+.1f", " pp"),
            "ratio": (1.0, "+.3f", ""), "rank": (1.0, ".0f", "")}


@dataclass(frozen=True)
class Measure:
    """An estimate with its 95% interval [low, high] over n sources; unit says how to print it: "logit" (+1.23),
    "pct" (12.3%), "pp" (+12.3 pp), "ratio" (+0.123) or "rank"."""

    estimate: float
    low: float
    high: float
    n: int
    unit: str = "logit"

    def __post_init__(self):
        if self.unit not in _FORMATS:
            raise ValueError(f"unit must be one of {sorted(_FORMATS)}, got {self.unit!r}")

    @property
    def defined(self) -> bool:
        return all(isinstance(v, (int, float)) and math.isfinite(v) for v in (self.estimate, self.low, self.high))

    def number(self, value: float) -> str:
        scale, spec, suffix = _FORMATS[self.unit]
        return f"{format(scale * value, spec)}{suffix}"

    def text(self) -> str:
        """"+1.23 [+0.50, +2.00], n = 16" (the unit's suffix once, after the interval)."""
        if not self.defined:
            return f"– (not evaluated, n = {self.n})"
        scale, spec, suffix = _FORMATS[self.unit]
        return (f"{format(scale * self.estimate, spec)}{suffix} [{format(scale * self.low, spec)}, "
                f"{format(scale * self.high, spec)}], n = {self.n}")


def measure_from(summary: pd.DataFrame, where: dict, metric: str, unit: str = "logit") -> Optional[Measure]:
    """The Measure of one summary row (columns metric, estimate, low, high, n_sources), or None where it is
    missing."""
    if summary is None or summary.empty or "metric" not in summary.columns:
        return None
    sel = summary["metric"] == metric
    for col, value in where.items():
        if col not in summary.columns:
            return None
        sel &= summary[col] == value
    row = summary[sel]
    if row.empty:
        return None
    r = row.iloc[0]
    n = r["n_sources"] if "n_sources" in row.columns and pd.notna(r["n_sources"]) else 0
    return Measure(float(r["estimate"]), float(r["low"]), float(r["high"]), int(n), unit)


@dataclass(frozen=True)
class Claim:
    """What the paper says about a quantity. kind: "sign" (sign = +1 or -1), "value" (value), "at_least" /
    "at_most" (value, the bound), "range" (value, upper), "nonzero" (an effect of either sign). paper: how the paper states it, quoted in the sentence."""

    kind: str
    value: float = 0.0
    upper: float = math.nan
    sign: int = 0
    paper: str = ""

    @classmethod
    def positive(cls, paper: str = "") -> "Claim":
        return cls("sign", sign=+1, paper=paper)

    @classmethod
    def negative(cls, paper: str = "") -> "Claim":
        return cls("sign", sign=-1, paper=paper)

    @classmethod
    def equals(cls, value: float, paper: str = "") -> "Claim":
        return cls("value", value=float(value), paper=paper)

    @classmethod
    def nonzero(cls, paper: str = "") -> "Claim":
        """The paper reports an effect of either sign (e.g. a joint run that differs from the sum of singles)."""
        return cls("nonzero", paper=paper)

    @classmethod
    def effect(cls, value: float, paper: str = "") -> "Claim":
        """The paper's one number for an effect (a range of one number): agrees when the interval holds it and
        excludes zero; an interval that also holds zero is no evidence either way."""
        return cls.between(value, value, paper)

    @classmethod
    def near_zero(cls, paper: str = "near zero") -> "Claim":
        return cls("value", value=0.0, paper=paper)

    @classmethod
    def at_least(cls, value: float, paper: str = "") -> "Claim":
        return cls("at_least", value=float(value), paper=paper)

    @classmethod
    def at_most(cls, value: float, paper: str = "") -> "Claim":
        return cls("at_most", value=float(value), paper=paper)

    @classmethod
    def between(cls, low: float, high: float, paper: str = "") -> "Claim":
        if not low <= high:
            raise ValueError(f"a range claim needs low <= high, got {low} and {high}")
        return cls("range", value=float(low), upper=float(high), paper=paper)


@dataclass(frozen=True)
class Verdict:
    kind: str
    sentence: str
    measure: Optional[Measure] = None

    @property
    def agrees(self) -> bool:
        return self.kind == AGREES

    def __str__(self) -> str:
        return self.sentence


def _kind(m: Measure, c: Claim) -> tuple[str, str]:
    """(kind, the reason in words)."""
    lo, hi = m.low, m.high
    if c.kind == "sign":
        if c.sign not in (1, -1):
            raise ValueError(f"a sign claim needs sign +1 or -1, got {c.sign}")
        if (c.sign > 0 and lo > 0) or (c.sign < 0 and hi < 0):
            return AGREES, "the interval excludes zero on the paper's side"
        if (c.sign > 0 and hi < 0) or (c.sign < 0 and lo > 0):
            return OPPOSITE, "the interval excludes zero on the other side"
        return NO_EVIDENCE, "the interval includes zero"
    if c.kind == "nonzero":
        if lo > 0 or hi < 0:
            return AGREES, "the interval excludes zero"
        return NO_EVIDENCE, "the interval includes zero"
    if c.kind == "value":
        if lo <= c.value <= hi:
            return AGREES, f"the paper's {m.number(c.value)} lies inside the interval"
        if c.value != 0 and (lo > 0 > c.value or hi < 0 < c.value):
            return OPPOSITE, f"the interval excludes zero on the other side of the paper's {m.number(c.value)}"
        side = "above" if lo > c.value else "below"
        return DIFFERS, f"the interval lies {side} the paper's {m.number(c.value)}"
    if c.kind in ("at_least", "at_most"):
        b = m.number(c.value)
        if (c.kind == "at_least" and lo >= c.value) or (c.kind == "at_most" and hi <= c.value):
            return AGREES, f"the interval lies at or {'above' if c.kind == 'at_least' else 'below'} the paper's bound {b}"
        if (c.kind == "at_least" and hi < c.value) or (c.kind == "at_most" and lo > c.value):
            return DIFFERS, f"the interval lies {'below' if c.kind == 'at_least' else 'above'} the paper's bound {b}"
        return NO_EVIDENCE, f"the interval includes the paper's bound {b}"
    if c.kind == "range":
        span = (f"range {m.number(c.value)} to {m.number(c.upper)}" if c.upper != c.value else
                m.number(c.value))
        if hi < c.value or lo > c.upper:
            return DIFFERS, f"the interval lies {'above' if lo > c.upper else 'below'} the paper's {span}"
        if (c.value > 0 and lo <= 0) or (c.upper < 0 and hi >= 0):
            # the paper's range is an effect; an interval that still holds zero cannot confirm it
            return NO_EVIDENCE, f"the interval reaches the paper's {span} but includes zero"
        return AGREES, (f"the interval overlaps the paper's {span}" if c.upper != c.value else
                        f"the paper's {span} lies inside the interval")
    raise ValueError(f"unknown claim kind {c.kind!r}; use Claim.positive/negative/equals/near_zero/at_least/"
                     "at_most/between")


def judge(measure: Optional[Measure], claim: Claim, subject: str) -> Verdict:
    """One sentence: "{subject} is {estimate [low, high], n = N}: {verdict} ({reason}; paper: {claim.paper})"."""
    paper = f"; paper: {claim.paper}" if claim.paper else ""
    if measure is None or not measure.defined:
        return Verdict(TOO_FEW, f"{subject} was not evaluated{paper}.", measure)
    if measure.n < MIN_SOURCES:
        return Verdict(TOO_FEW, f"{subject} is {measure.text()}: {TOO_FEW} (at least {MIN_SOURCES} needed{paper}).",
                       measure)
    kind, reason = _kind(measure, claim)
    return Verdict(kind, f"{subject} is {measure.text()}: {kind} ({reason}{paper}).", measure)


def control_verdict(name: str, margin: Optional[Measure], specific: Optional[Measure] = None,
                    main: Optional[Measure] = None, main_name: str = "the intervention") -> Verdict:
    """A control judged as the paper judges it: its donor-margin shift against zero (a control should not move the
    margin). The donor-specific shift (`specific`) and the share of the main arm's shift are diagnostics written
    after the verdict; neither changes it, so a control that moves the margin a lot is never called near zero."""
    v = judge(margin, Claim.near_zero("a control sits near zero"), f"The donor-margin shift of the {name}")
    if v.kind == AGREES:
        v = Verdict(AGREES, v.sentence.replace(AGREES, "consistent with zero, as a control should be"), margin)
    elif v.kind in (DIFFERS, OPPOSITE):
        v = Verdict(DIFFERS, v.sentence.replace(v.kind, "NOT zero, unlike a null control"), margin)
    extra = []
    if margin is not None and margin.defined and main is not None and main.defined and main.estimate != 0:
        extra.append(f"{100 * margin.estimate / main.estimate:.0f}% of {main_name}'s {main.number(main.estimate)}")
    if specific is not None and specific.defined:
        extra.append(f"donor-specific shift {specific.text()} (a diagnostic beside the verdict)")
    sentence = v.sentence if not extra else v.sentence[:-1] + "; " + "; ".join(extra) + "."
    return Verdict(v.kind, sentence, margin)


# ---- the paper's model families ----------------------------------------------------------------------------

GLA, GDN = "GLA", "GDN"


def paper_family(model) -> str:
    """GLA or GDN: the paper's family whose numbers a Reading compares `model` with (a model or its FamilySpec, whose
    `paper_family` says it: GLA-340M's for gated linear attention, GDN-340M / 1.3B's for every gated delta rule); for
    a family the paper did not measure (RWKV-7, Mamba-2 and its hybrids), that family's own name."""
    spec = getattr(model, "family", model)
    name = getattr(spec, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"cannot tell the model family of {model!r}; pass a model or its FamilySpec")
    return getattr(spec, "paper_family", None) or name


def judge_family(measure: Optional[Measure], family: Optional[str], claims: dict, subject: str,
                 context: str = "") -> Verdict:
    """judge(measure, claims[family], subject) for a model of the paper's family `family` (GLA or GDN, from
    paper_family). For a family without a claim (one the paper did not measure), no verdict: the sentence gives
    the estimate and says the paper reports none for that family, with `context` (the paper's GLA / GDN numbers)."""
    claim = claims.get(family)
    if claim is not None:
        return judge(measure, claim, subject)
    ctx = f"; for context, the paper: {context}" if context else ""
    what = f"is {measure.text()}" if measure is not None and measure.defined else "was not evaluated"
    return Verdict(NOT_COMPARED, f"{subject} {what}: {NOT_COMPARED} (the paper reports no number for "
                                 f"{family or 'this'} models{ctx}).", measure)
