"""docs/results_tiny.md's summary table is judged by the code: every row's verdict is the one
recurscope.interp.verdicts gives for the row's own numbers, so the page cannot claim agreement its intervals do not
support, and the page and the verdict function cannot drift apart."""
import re
from pathlib import Path

import pytest

from recurscope.interp import verdicts as V
from recurscope.interp.verdicts import Claim, Measure, control_verdict, judge

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "results_tiny.md"
START, END = "<!-- summary:start -->", "<!-- summary:end -->"
COLUMNS = ["protocol", "model", "quantity", "measured (95% interval)", "n", "paper", "claim", "verdict", "command"]

# The table's short words for each verdict kind (a control's verdict has its own two words).
WORDS = {V.AGREES: "agrees", V.OPPOSITE: "opposite sign", V.NO_EVIDENCE: "no evidence either way",
         V.DIFFERS: "differs", V.TOO_FEW: "too few sources"}
CONTROL_WORDS = {V.AGREES: "consistent with zero", V.DIFFERS: "NOT zero"}
NOT_JUDGED = "not judged"

_NUMBER = r"[+-]?\d+(?:\.\d+)?"
_MEASURED = re.compile(rf"^({_NUMBER})\s*(%| pp)?\s*\[({_NUMBER}),\s*({_NUMBER})\]")


def summary_rows(text: str) -> list[dict]:
    """The rows of the table between the summary markers, as dicts keyed by COLUMNS."""
    if START not in text or END not in text:
        raise AssertionError(f"docs/results_tiny.md needs its summary table between {START} and {END}")
    block = text.split(START, 1)[1].split(END, 1)[0]
    lines = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == COLUMNS, f"summary columns are {header}, expected {COLUMNS}"
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"a summary row has {len(cells)} cells: {line}"
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def measure_of(row: dict) -> Measure:
    m = _MEASURED.match(row["measured (95% interval)"])
    assert m, f"no 'estimate [low, high]' in {row['measured (95% interval)']!r}"
    estimate, _, low, high = m.groups()
    return Measure(float(estimate), float(low), float(high), int(row["n"]), "ratio")


def claim_of(text: str):
    """The claim column: '> 0', '< 0', '!= 0', '= 0.173', '>= 89.7', '<= 5', 'range 61.3 89.1', 'control', '–'
    (numbers in the measured column's units). Returns a Claim, "control" or None (not judged)."""
    text = text.strip()
    if text in ("–", "-"):
        return None
    if text == "control":
        return "control"
    if text == "> 0":
        return Claim.positive()
    if text == "< 0":
        return Claim.negative()
    if text == "!= 0":
        return Claim.nonzero()
    for prefix, make in ((">=", Claim.at_least), ("<=", Claim.at_most), ("=", Claim.equals)):
        if text.startswith(prefix):
            return make(float(text[len(prefix):]))
    if text.startswith("range "):
        low, high = (float(x) for x in text.split()[1:3])
        return Claim.between(low, high)
    raise AssertionError(f"unknown claim {text!r}; use > 0, < 0, != 0, = x, >= x, <= x, range a b, control or –")


def expected_words(row: dict) -> str:
    claim = claim_of(row["claim"])
    if claim is None:
        return NOT_JUDGED
    measure = measure_of(row)
    if claim == "control":
        return CONTROL_WORDS[control_verdict("control", measure).kind]
    return WORDS[judge(measure, claim, row["quantity"]).kind]


@pytest.fixture(scope="module")
def rows():
    return summary_rows(DOC.read_text())


def test_the_summary_table_covers_every_protocol_verb(rows):
    verbs = {"selectivity", "coupling", "neutral", "heads", "headscan", "lens", "gate", "capacity", "overlap",
             "retention", "corrector", "reuse"}
    assert verbs <= {row["protocol"] for row in rows}


def test_every_row_has_the_verdict_the_verdict_function_gives(rows):
    def matches(row):
        expected = expected_words(row)
        # a row without a claim may say why after the words ("not judged (gate refused)")
        return row["verdict"].startswith(NOT_JUDGED) if expected == NOT_JUDGED else row["verdict"] == expected
    wrong = [(row["protocol"], row["model"], row["quantity"], row["verdict"], expected_words(row))
             for row in rows if not matches(row)]
    assert wrong == []


def test_no_row_claims_agreement_its_interval_does_not_support(rows):
    # The condition stated directly, independent of the word table above: "agrees" needs the paper's
    # number inside the interval, or an interval that excludes zero on the paper's side.
    for row in rows:
        if row["verdict"] != "agrees":
            continue
        m, claim = measure_of(row), claim_of(row["claim"])
        assert isinstance(claim, Claim), row
        if claim.kind == "sign":
            assert (m.low > 0) if claim.sign > 0 else (m.high < 0), row
        elif claim.kind == "value":
            assert m.low <= claim.value <= m.high, row
        elif claim.kind == "range":
            assert m.high >= claim.value and m.low <= claim.upper and (m.low > 0 or m.high < 0), row
        elif claim.kind == "at_least":
            assert m.low >= claim.value, row
        elif claim.kind == "at_most":
            assert m.high <= claim.value, row
        else:
            assert m.low > 0 or m.high < 0, row


def test_the_checker_refuses_an_overclaiming_row():
    # The coupling row of the issue: +0.45 [+0.02, +0.97] against the paper's negative sign is not agreement.
    row = {"quantity": "parallel part", "measured (95% interval)": "+0.45 [+0.02, +0.97]", "n": "16",
           "claim": "< 0", "verdict": "agrees"}
    assert expected_words(row) == "opposite sign"
    control = {"quantity": "random update", "measured (95% interval)": "+0.64 [+0.08, +1.38]", "n": "16",
               "claim": "control", "verdict": "consistent with zero"}
    assert expected_words(control) == "NOT zero"
    one_source = dict(row, n="1", claim="> 0")
    assert expected_words(one_source) == "too few sources"
