"""The one verdict function every "Reading" uses to compare a measured quantity with the paper.

A Measure is an estimate with its 95% interval and the number of sources it rests on. A Claim is what the paper
says about that quantity: a sign (the effect is positive / negative), a value (the paper's number), a bound (at
least / at most a number) or a range. judge(measure, claim) returns a Verdict whose kind is one of

- AGREES: the paper's number or range overlaps the interval, or the interval excludes the opposite of a sign claim
  (a range claim of an effect, e.g. a 30-40 pp loss, also needs the interval to exclude zero);
- SAME_SIGN: the paper gives a number for a signed effect (not a percentage of a whole, unit "pct"), the interval
  excludes it and excludes zero on the paper's side: "same sign, magnitude differs (ours X [a, b]; paper Y)", never
  "agrees";
- OPPOSITE: the interval excludes zero on the side opposite to the paper's sign;
- NO_EVIDENCE: the interval includes the reference (zero for a sign), so the data decide neither way;
- DIFFERS: the interval excludes the paper's number (or bound, or range) without a sign flip;
- NOT_INFORMATIVE: fewer than MIN_INFORMATIVE_SOURCES sources, or an interval wider than MAX_WIDTH_FRACTION of its
  reference (the paper's value, the estimate itself, or the effect's own scale, e.g. the full swap);
- NEGLIGIBLE: the whole interval lies within NEGLIGIBLE_FRACTION of the effect's own scale, so an effect's sign
  claim is not judged on it (a joint-minus-sum of +0.03 beside a hub effect of -9.18), and a near-zero claim whose
  interval excludes zero by less than that is a size, not agreement (an interval within IDENTITY_TOLERANCE of zero
  is float noise, and agrees with zero);
- UNDEFINED: a ratio whose denominator's interval includes zero;
- TOO_FEW: fewer than MIN_SOURCES sources, or no estimate: no comparison is made;

and whose sentence carries the estimate, its interval and n. Three kinds are never comparisons: NO_PAPER_NUMBER
(no_paper_number: a control or quantity the paper does not report, given with its value, never against an invented
0), IDENTITY (identity_check: an arm equal to clean by construction, excluded from agreement) and NOT_GATED (inside
gate_off(): the capability gate was turned off, --gate-threshold 0, so nothing is compared); REFUSED names what
the capability gate refused (interp.capability), which gets no verdict at all. Controls
(control_verdict) are judged on the paper's metric, the donor-margin shift, against zero; the donor-specific shift
is written beside it as a diagnostic and never changes the verdict.

Where the paper gives separate numbers for its GLA and GDN models, a Reading judges a model against its own family's
number: paper_family(model) names that family, and judge_family(measure, family, {GLA: claim, GDN: claim}, ...)
picks the claim. For a family the paper did not measure (RWKV-7, Mamba-2, ...) it makes no comparison
(NOT_COMPARED) and quotes the paper's GLA and GDN numbers for context. scale_caveat says in words when the paper's
model is more than SCALE_CAVEAT_RATIO times larger than the one measured.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

import pandas as pd

__all__ = ["AGREES", "SAME_SIGN", "OPPOSITE", "NO_EVIDENCE", "DIFFERS", "TOO_FEW", "NOT_COMPARED", "NOT_INFORMATIVE",
           "NEGLIGIBLE", "UNDEFINED", "NO_PAPER_NUMBER", "IDENTITY", "NOT_GATED", "REFUSED", "KINDS", "MIN_SOURCES",
           "MIN_INFORMATIVE_SOURCES", "MAX_WIDTH_FRACTION", "NEGLIGIBLE_FRACTION", "SCALE_CAVEAT_RATIO",
           "IDENTITY_TOLERANCE", "AMBIGUITIES", "Measure", "Claim", "Verdict", "judge", "control_verdict",
           "no_paper_number", "identity_check", "not_informative", "gate_off", "gated", "scale_caveat", "measure_from", "GLA",
           "GDN", "paper_family", "judge_family", "count_kinds"]

AGREES = "agrees with the paper"
SAME_SIGN = "same sign, magnitude differs"
OPPOSITE = "opposite sign to the paper"
NO_EVIDENCE = "no evidence either way"
DIFFERS = "differs from the paper"
TOO_FEW = "too few sources to compare"
NOT_COMPARED = "not compared with the paper"
NOT_INFORMATIVE = "not informative"
NEGLIGIBLE = "negligible"
UNDEFINED = "undefined"
NO_PAPER_NUMBER = "no paper number"
IDENTITY = "identity check"
NOT_GATED = "not gated"
REFUSED = "refused by the capability gate"
#: Every verdict kind, in the order a summary counts them.
KINDS = (AGREES, SAME_SIGN, DIFFERS, OPPOSITE, NO_EVIDENCE, NOT_INFORMATIVE, NEGLIGIBLE, UNDEFINED, TOO_FEW,
         NO_PAPER_NUMBER, IDENTITY, NOT_COMPARED, NOT_GATED, REFUSED)

#: A comparison never rests on fewer sources than this (one source has no spread to tell noise from effect).
MIN_SOURCES = 2
#: Below this many sources a source bootstrap has at most 10 distinct resamples (3 sources): its 95% interval is
#: little more than the range of the source means, so nothing is judged on it.
MIN_INFORMATIVE_SOURCES = 4
#: An interval wider than twice its reference (the paper's value, the estimate, or the effect's own scale) spans more
#: than zero to twice that value: it cannot tell the paper's number from zero or from double it, so not informative.
MAX_WIDTH_FRACTION = 2.0
#: An effect whose whole interval lies within 5% of its own scale (e.g. the hub's effect) is negligible: too small
#: to carry a claim about its sign, whatever its interval says.
NEGLIGIBLE_FRACTION = 0.05
#: A paper model more than 100 times larger than the model measured (two orders of magnitude) is said so in the
#: Reading: effects on a tiny model need not scale to it, either way.
SCALE_CAVEAT_RATIO = 100.0
#: An arm whose largest per-example difference from clean is below this (in logits) equals clean to float precision
#: (float32 sums of a few thousand terms differ by ~1e-6): an identity, not a measurement.
IDENTITY_TOLERANCE = 1e-4
#: The page that states what the paper leaves ambiguous (eq. 6, the hybrid ratio, the GLA 5% wording, Fig. 5 / Fig. 8
#: at K = 4, QED's Table 4 / Table 3); Readings that touch one link to it.
AMBIGUITIES = "docs/paper_ambiguities.md"

_GATE_OFF: ContextVar[bool] = ContextVar("recurscope_gate_off", default=False)


@contextmanager
def gate_off():
    """Inside this block every judged verdict reads NOT_GATED: the capability gate was turned off (--gate-threshold
    0, diagnostics on a model that may not do the task), so nothing is compared with the paper."""
    token = _GATE_OFF.set(True)
    try:
        yield
    finally:
        _GATE_OFF.reset(token)


def gated() -> bool:
    """False inside gate_off()."""
    return not _GATE_OFF.get()

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
    subject: str = ""

    @property
    def agrees(self) -> bool:
        return self.kind == AGREES

    def __str__(self) -> str:
        return self.sentence


def count_kinds(verdicts) -> dict:
    """{kind: how many} over the Verdicts in `verdicts` (other items, e.g. plain sentences, are skipped)."""
    counts = {kind: 0 for kind in KINDS}
    for v in verdicts:
        if isinstance(v, Verdict):
            counts[v.kind] = counts.get(v.kind, 0) + 1
    return counts


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
        if (c.value > 0 and hi < 0) or (c.upper < 0 and lo > 0):
            return OPPOSITE, f"the interval excludes zero on the other side of the paper's {span}"
        if hi < c.value or lo > c.upper:
            return DIFFERS, f"the interval lies {'above' if lo > c.upper else 'below'} the paper's {span}"
        if (c.value > 0 and lo <= 0) or (c.upper < 0 and hi >= 0):
            # the paper's range is an effect; an interval that still holds zero cannot confirm it
            return NO_EVIDENCE, f"the interval reaches the paper's {span} but includes zero"
        return AGREES, (f"the interval overlaps the paper's {span}" if c.upper != c.value else
                        f"the paper's {span} lies inside the interval")
    raise ValueError(f"unknown claim kind {c.kind!r}; use Claim.positive/negative/equals/near_zero/at_least/"
                     "at_most/between")


def _paper_text(m: Measure, c: Claim) -> str:
    if c.kind == "range":
        return m.number(c.value) if c.upper == c.value else f"{m.number(c.value)} to {m.number(c.upper)}"
    return m.number(c.value)


def _reference(m: Measure, c: Claim, scale: Optional[float]) -> Optional[float]:
    """The magnitude an interval's width is compared with: the largest of the paper's number(s), the estimate and
    the effect's own scale. A sign claim without a scale has none: excluding zero is its whole test."""
    sizes = [abs(scale)] if scale is not None and math.isfinite(scale) else []
    if c.kind == "value" and c.value == 0:
        pass                              # near zero: only the effect's own scale can say how wide is too wide
    elif c.kind in ("value", "range", "at_least", "at_most"):
        sizes += [abs(c.value), abs(m.estimate)] + ([abs(c.upper)] if c.kind == "range" else [])
    return max(sizes) if sizes else None


def _not_informative(m: Measure, why: str, subject: str, paper: str) -> Verdict:
    return Verdict(NOT_INFORMATIVE, f"{subject} is {m.text()}: {NOT_INFORMATIVE} (interval [{m.number(m.low)}, "
                                    f"{m.number(m.high)}], n = {m.n}: {why}{paper}).", m, subject)


def judge(measure: Optional[Measure], claim: Claim, subject: str, *, scale: Optional[float] = None,
          denominator: Optional[Measure] = None) -> Verdict:
    """One sentence: "{subject} is {estimate [low, high], n = N}: {verdict} ({reason}; paper: {claim.paper})".

    scale: the effect's own scale (e.g. the full swap's shift, the clean margin), against which the interval's
    width is judged (MAX_WIDTH_FRACTION) and an effect is negligible (NEGLIGIBLE_FRACTION). denominator: for a
    ratio, the Measure of its denominator; an interval of it that includes zero makes the ratio UNDEFINED."""
    paper = f"; paper: {claim.paper}" if claim.paper else ""
    if not gated():
        what = f"is {measure.text()}" if measure is not None and measure.defined else "was not evaluated"
        return Verdict(NOT_GATED, f"{subject} {what}: {NOT_GATED} (the capability gate is off, --gate-threshold 0, "
                                  f"so nothing is compared with the paper{paper}).", measure, subject)
    if denominator is not None and (not denominator.defined or denominator.low <= 0 <= denominator.high):
        den = denominator.text() if denominator.defined else "not evaluated"
        return Verdict(UNDEFINED, f"{subject} is {UNDEFINED}: its denominator {den} includes zero, so there is no "
                                  f"ratio to compare{paper}.", measure, subject)
    if measure is None or not measure.defined:
        return Verdict(TOO_FEW, f"{subject} was not evaluated{paper}.", measure, subject)
    if measure.n < MIN_SOURCES:
        return Verdict(TOO_FEW, f"{subject} is {measure.text()}: {TOO_FEW} (at least {MIN_SOURCES} needed{paper}).",
                       measure, subject)
    if measure.n < MIN_INFORMATIVE_SOURCES:
        return _not_informative(measure, f"fewer than {MIN_INFORMATIVE_SOURCES} sources", subject, paper)
    lo, hi = measure.low, measure.high
    if (scale is not None and scale != 0 and claim.kind in ("sign", "nonzero")
            and max(abs(lo), abs(hi)) < NEGLIGIBLE_FRACTION * abs(scale)):
        return Verdict(NEGLIGIBLE, f"{subject} is {measure.text()}: {NEGLIGIBLE} (the whole interval lies within "
                                   f"{100 * NEGLIGIBLE_FRACTION:.0f}% of its scale, {measure.number(scale)}{paper}).",
                       measure, subject)
    reference = _reference(measure, claim, scale)
    if reference is not None and hi - lo > MAX_WIDTH_FRACTION * reference:
        return _not_informative(measure, f"wider than {MAX_WIDTH_FRACTION:g}x its reference "
                                         f"{measure.number(reference)}", subject, paper)
    kind, reason = _kind(measure, claim)
    if claim.kind == "value" and claim.value == 0 and kind in (DIFFERS, OPPOSITE):
        # an interval off zero by float noise is zero; one off zero by less than 5% of its scale is negligible, a
        # size, never agreement
        if max(abs(lo), abs(hi)) < IDENTITY_TOLERANCE:
            return Verdict(AGREES, f"{subject} is {measure.text()}: {AGREES} (the whole interval lies within "
                                   f"{IDENTITY_TOLERANCE:g} of zero, float precision{paper}).", measure, subject)
        if scale and max(abs(lo), abs(hi)) < NEGLIGIBLE_FRACTION * abs(scale):
            return Verdict(NEGLIGIBLE, f"{subject} is {measure.text()}: {NEGLIGIBLE} (not zero, but the whole "
                                       f"interval lies within {100 * NEGLIGIBLE_FRACTION:.0f}% of its scale, "
                                       f"{measure.number(scale)}{paper}).", measure, subject)
    # a percentage of a whole (a rate, a share, a recovery; unit "pct") has no sign to share: outside the paper's
    # number it differs; a signed effect (logits, pp changes, correlations) on the paper's side differs in size only
    if (kind == DIFFERS and measure.unit != "pct" and claim.kind in ("value", "range") and
            ((claim.value > 0 and lo > 0) or (claim.kind == "value" and claim.value < 0 and hi < 0)
             or (claim.kind == "range" and claim.upper < 0 and hi < 0))):
        kind = SAME_SIGN
        reason = f"ours {measure.text().rsplit(', n = ', 1)[0]}; paper {_paper_text(measure, claim)}"
    return Verdict(kind, f"{subject} is {measure.text()}: {kind} ({reason}{paper}).", measure, subject)


def no_paper_number(measure: Optional[Measure], subject: str, note: str = "") -> Verdict:
    """A quantity the paper does not report (e.g. a control it never ran): its value and interval, compared with
    nothing (never with an invented 0)."""
    what = f"is {measure.text()}" if measure is not None and measure.defined else "was not evaluated"
    note = f"; {note}" if note else ""
    return Verdict(NO_PAPER_NUMBER, f"{subject} {what}: {NO_PAPER_NUMBER} (the paper reports none{note}).", measure,
                   subject)


def identity_check(measure: Optional[Measure], subject: str, why: str) -> Verdict:
    """An arm that equals clean by construction (a restore at or after the last layer, a head no later layer
    reads): its number checks the plumbing and is excluded from agreement."""
    what = f"is {measure.text()}" if measure is not None and measure.defined else "was not evaluated"
    return Verdict(IDENTITY, f"{subject} {what}: {IDENTITY}, not evidence ({why}).", measure, subject)


def not_informative(measure: Optional[Measure], subject: str, why: str) -> Verdict:
    """No comparison, for a reason outside the interval (e.g. no hub: the ranking it rests on is tied); "not
    gated" inside gate_off()."""
    what = f"is {measure.text()}" if measure is not None and measure.defined else "was not evaluated"
    if not gated():
        return Verdict(NOT_GATED, f"{subject} {what}: {NOT_GATED} (the capability gate is off, --gate-threshold 0, "
                                  "so nothing is compared with the paper).", measure, subject)
    return Verdict(NOT_INFORMATIVE, f"{subject} {what}: {NOT_INFORMATIVE} ({why}).", measure, subject)


def scale_caveat(n_params: Optional[float], paper_params: float, paper_model: str) -> Optional[str]:
    """A sentence for the Reading when the paper's model (paper_params, named paper_model) is more than
    SCALE_CAVEAT_RATIO times larger than the model measured (n_params); None otherwise or when unknown."""
    if not n_params or not paper_params or paper_params < SCALE_CAVEAT_RATIO * n_params:
        return None
    return (f"Scale: this model has {_size(n_params)} parameters, about 1/{paper_params / n_params:,.0f} of the "
            f"paper's {paper_model}; an agreement or a difference here need not hold at that scale.")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def control_verdict(name: str, margin: Optional[Measure], specific: Optional[Measure] = None,
                    main: Optional[Measure] = None, main_name: str = "the intervention") -> Verdict:
    """A control judged as the paper judges it: its donor-margin shift against zero (a control should not move the
    margin), its interval's width judged against the main arm's shift where given. The donor-specific shift
    (`specific`) and the share of the main arm's shift are diagnostics written after the verdict; neither changes
    it, so a control that moves the margin a lot is never called near zero."""
    scale = main.estimate if main is not None and main.defined and main.estimate != 0 else None
    v = judge(margin, Claim.near_zero("a control sits near zero"), f"The donor-margin shift of the {name}",
              scale=scale)
    if v.kind == AGREES:
        v = Verdict(AGREES, v.sentence.replace(AGREES, "consistent with zero, as a control should be"), margin,
                    v.subject)
    elif v.kind in (DIFFERS, OPPOSITE, SAME_SIGN):
        v = Verdict(DIFFERS, v.sentence.replace(v.kind, "NOT zero, unlike a null control", 1), margin, v.subject)
    extra = []
    if margin is not None and margin.defined and main is not None and main.defined and main.estimate != 0:
        extra.append(f"{100 * margin.estimate / main.estimate:.0f}% of {main_name}'s {main.number(main.estimate)}")
    if specific is not None and specific.defined:
        extra.append(f"donor-specific shift {specific.text()} (a diagnostic beside the verdict)")
    sentence = v.sentence if not extra else v.sentence[:-1] + "; " + "; ".join(extra) + "."
    return Verdict(v.kind, sentence, margin, v.subject)


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
                 context: str = "", **judge_options) -> Verdict:
    """judge(measure, claims[family], subject) for a model of the paper's family `family` (GLA or GDN, from
    paper_family). For a family without a claim (one the paper did not measure), no verdict: the sentence gives
    the estimate and says the paper reports none for that family, with `context` (the paper's GLA / GDN numbers)."""
    claim = claims.get(family)
    if claim is not None or not gated():
        return judge(measure, claim or Claim.nonzero(), subject, **judge_options)
    ctx = f"; for context, the paper: {context}" if context else ""
    what = f"is {measure.text()}" if measure is not None and measure.defined else "was not evaluated"
    return Verdict(NOT_COMPARED, f"{subject} {what}: {NOT_COMPARED} (the paper reports no number for "
                                 f"{family or 'this'} models{ctx}).", measure, subject)
