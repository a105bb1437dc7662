"""The capability gate: before any verdict is given or any head named, the model must do the task.

One gate for every entry point: `recurscope run` / `scan` / `confirm`, every protocol verb (protocols.runner) and the
Python path of notebook 02. check_capability(model, pairs, threshold) measures clean recall of recipient and donor on
`pairs`' target rows (top-1 among each pair's candidates, the project's clean_run) with source-bootstrap intervals
and returns a GateResult:

- passed: both point estimates at or above the threshold (the paper's rule, App. F.2: 80%);
- below it, nothing downstream gives a verdict or names a head (the callers refuse, and say why in one line);
- threshold 0 turns the gate off for diagnostics (plumbing checks on random weights): GateResult.off, nothing is
  measured, and every verdict then reads "not gated" (verdicts.gate_off, entered by the callers).

This module imports torch, the interventions and the statistics only when a gate is measured, so the command line's
option tables can read GATE_THRESHOLD without them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["GATE_THRESHOLD", "CapabilityGateError", "GateResult", "check_capability", "capability_gate",
           "require_capability", "gate_record"]

#: The paper's preset gate (App. F.2): recipient and donor clean recall both >= 80% before any intervention is read.
GATE_THRESHOLD = 0.8


class CapabilityGateError(RuntimeError):
    """A condition's clean recall is under the preset threshold: its intervention results must not be reported."""


@dataclass(frozen=True)
class GateResult:
    condition: str
    threshold: float
    recipient: Optional[object] = None        # stats.BootstrapCI; None when the gate is off
    donor: Optional[object] = None
    off: bool = False

    @property
    def passed(self) -> bool:
        """Both point estimates at or above the threshold (the paper's rule); True when the gate is off."""
        return self.off or (self.recipient.estimate >= self.threshold and self.donor.estimate >= self.threshold)

    def describe(self) -> str:
        if self.off:
            return (f"{self.condition}: the capability gate is off (--gate-threshold 0): nothing shows the model "
                    "does the task, so every verdict reads 'not gated'")
        return (f"{self.condition}: clean recall recipient {100 * self.recipient.estimate:.1f}% "
                f"[{100 * self.recipient.low:.1f}, {100 * self.recipient.high:.1f}], donor "
                f"{100 * self.donor.estimate:.1f}% [{100 * self.donor.low:.1f}, {100 * self.donor.high:.1f}] against a "
                f"preset threshold of {100 * self.threshold:.0f}%: " + ("passes" if self.passed else "refused"))


def _check_threshold(threshold, allow_off: bool) -> float:
    low_ok = (lambda t: 0 <= t) if allow_off else (lambda t: 0 < t)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (low_ok(threshold)
                                                                                       and threshold <= 1):
        raise ValueError(f"threshold must be a fraction in ({'[' if allow_off else '('}0, 1], fixed before the run "
                         f"(the paper uses 0.8{'; 0 turns the gate off' if allow_off else ''}); got {threshold!r}")
    return float(threshold)


def capability_gate(model, pairs, *, threshold: float = GATE_THRESHOLD, condition: str = "condition",
                    batch_size: int = 16, n_resamples: int = 9999, seed: int = 0, clean=None) -> GateResult:
    """Clean recall of recipient and donor over `pairs`' target rows with source-bootstrap intervals, against a
    threshold in (0, 1]. `clean`: the clean_run output when the caller has it already (it is computed otherwise)."""
    from recurscope.interp import interventions as iv
    from recurscope.interp import stats

    threshold = _check_threshold(threshold, allow_off=False)
    clean = iv.clean_run(model, pairs, batch_size=batch_size) if clean is None else clean
    target = pairs.is_target.bool()
    src = pairs.source_id[target].numpy()
    rec = (clean["recipient"].argmax(1) == pairs.recipient_answer_index)[target].float().numpy()
    don_idx = pairs.donor_answer_index[target]
    if bool((don_idx < 0).any()):
        raise ValueError("the gate reads the donor's recall, so the pairs need a donor answer (swap or update "
                         "pairs, not neutral ones)")
    don = (clean["donor"][target].argmax(1) == don_idx).float().numpy()
    ci = dict(n_resamples=n_resamples, seed=seed)
    return GateResult(condition, threshold, stats.source_bootstrap_ci(rec, src, **ci),
                      stats.source_bootstrap_ci(don, src, **ci))


def check_capability(model, pairs, threshold: float = GATE_THRESHOLD, *, condition: str = "condition",
                     batch_size: int = 16, n_resamples: int = 9999, seed: int = 0, clean=None) -> GateResult:
    """The one gate every entry point calls: capability_gate for a threshold in (0, 1]; threshold 0 turns it off
    (GateResult.off; nothing is measured, and the caller gives every verdict as "not gated")."""
    if _check_threshold(threshold, allow_off=True) == 0:
        return GateResult(condition, 0.0, off=True)
    return capability_gate(model, pairs, threshold=threshold, condition=condition, batch_size=batch_size,
                           n_resamples=n_resamples, seed=seed, clean=clean)


def require_capability(result: GateResult) -> GateResult:
    """Returns `result` if it passed; raises CapabilityGateError (a one-line reason) otherwise."""
    if not result.passed:
        raise CapabilityGateError(result.describe() + "; no intervention is reported on this condition (lower the "
                                  "filler, change the format or model, or set a different threshold before the run)")
    return result


def gate_record(result: GateResult, n_sources: Optional[int] = None, split: Optional[str] = None) -> dict:
    """The gate as gate.json records it (the report reads it back)."""
    if result.off:
        return {"threshold": 0.0, "passed": True, "off": True, "split": split}
    return {"threshold": result.threshold, "passed": result.passed, "n_sources": n_sources,
            "recipient": [result.recipient.estimate, result.recipient.low, result.recipient.high],
            "donor": [result.donor.estimate, result.donor.low, result.donor.high], "split": split}
