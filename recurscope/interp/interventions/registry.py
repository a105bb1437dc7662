"""The registry of named interventions: the one list that confirm, report, plots and the CLI read (nothing else
lists them). Each entry names a spec builder and the fixed options it runs with; the run-time arguments (seed, the
scan table, row ids) go to the builders that take them, so no entry needs an adapter."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from recurscope.interp.interventions.common import InterventionResult
from recurscope.interp.interventions.controls import control_head_spec, random_update_spec, random_write_spec
from recurscope.interp.interventions.driver import run_intervention
from recurscope.interp.interventions.query_time import (
    output_patch, output_patch_spec, output_restore, output_restore_spec, state_swap, state_swap_spec,
)
from recurscope.interp.interventions.writes import (
    conv_tail_write_block_spec, donor_write, donor_write_spec, write_block, write_block_spec,
)

__all__ = ["NamedIntervention", "REGISTRY", "INTERVENTION_NAMES", "INTERVENTIONS", "CONTROL_METRIC",
           "named_intervention", "controls_of"]

#: The run-time arguments an entry passes on to a spec builder whose signature takes them.
RUN_ARGUMENTS = ("seed", "scan", "row_ids")


@dataclass(frozen=True)
class NamedIntervention:
    """One row of the confirmation protocol.

    name: the `intervention` value in result rows; label: how the report names it; build: its spec builder, called
    as build(model, pairs, heads, **options) plus those of seed, scan, row_ids that the builder takes; controls: the
    intervention this one is a control for (None for a main intervention or variant); metric: the effect the report
    reads it by (the controls: the donor-specific shift, which a mere loss of confidence in the recipient's answer
    does not move). row_ids (each row's index in a larger batch that `pairs` was taken from) seeds the random
    controls.
    """

    name: str
    label: str
    build: Callable
    options: Mapping = field(default_factory=dict)
    controls: Optional[str] = None
    metric: str = "donor_margin_shift"

    @property
    def is_control(self) -> bool:
        return self.controls is not None

    def spec(self, model, pairs, heads, *, seed: int = 0, scan=None, row_ids=None):
        """Its spec jointly on `heads` over `pairs`."""
        given = {"seed": seed, "scan": scan, "row_ids": row_ids}
        takes = inspect.signature(self.build).parameters
        return self.build(model, pairs, heads, **self.options, **{k: given[k] for k in RUN_ARGUMENTS if k in takes})

    def run(self, model, pairs, heads, *, batch_size: int = 16, seed: int = 0, scan=None, row_ids=None,
            metric: Optional[Callable] = None) -> InterventionResult:
        """Runs it jointly on `heads` (driver.run_intervention; with `metric`, returns metric(pairs, result))."""
        spec = self.spec(model, pairs, heads, seed=seed, scan=scan, row_ids=row_ids)
        return run_intervention(model, pairs, spec, batch_size=batch_size, metric=metric)


#: What the report reads a control by: the donor-specific shift (metrics.example_metrics). The donor margin also
#: rises whenever the recipient's answer merely loses confidence, towards the non-donor distractors alike, so a
#: control is "near zero" when the donor in particular does not gain.
CONTROL_METRIC = "donor_specific_shift"


def _control(name: str, label: str, build: Callable, controls: str, /, **options) -> NamedIntervention:
    return NamedIntervention(name, label, build, options, controls=controls, metric=CONTROL_METRIC)


#: In protocol order (How Linear Attention Remembers, Figures 3/4): the five interventions, the answer-position
#: restore variant and the write block widened by the short convolution, then each causal arm's controls (an
#: equal-norm random change of what the arm changes, and the same arm on the control head). Restoring only the
#: answer position's readout leaks, with a multi-token query, through the readouts at earlier query tokens, which
#: is what that variant measures (restoring every readout gives the clean run by construction).
REGISTRY: tuple[NamedIntervention, ...] = (
    NamedIntervention("write_block", "write block", write_block_spec),
    NamedIntervention("donor_write", "donor write", donor_write_spec),
    NamedIntervention("state_swap", "state swap", state_swap_spec),
    NamedIntervention("output_patch", "output patch", output_patch_spec),
    NamedIntervention("output_restore", "output restore (after state swap)", output_restore_spec),
    NamedIntervention("output_restore_last", "output restore, answer position only", output_restore_spec,
                      {"positions": "last", "name": "output_restore_last"}),
    NamedIntervention("write_block_conv_tail", "write block, span + conv reach", conv_tail_write_block_spec),
    _control("random_update", "equal-norm random update", random_update_spec, "state_swap", kind="state_swap"),
    _control("control_head", "control head (state swap)", control_head_spec, "state_swap",
             intervention="state_swap"),
    _control("random_write", "equal-norm random write (value)", random_write_spec, "donor_write", variant="value"),
    _control("random_write_rank_one", "equal-norm random write (rank one)", random_write_spec, "donor_write",
             variant="rank_one"),
    _control("control_head_donor_write", "control head (donor write)", control_head_spec, "donor_write",
             intervention="donor_write", name="control_head_donor_write"),
    _control("random_output_patch", "equal-norm random output patch", random_update_spec, "output_patch",
             kind="output_patch"),
    _control("control_head_output_patch", "control head (output patch)", control_head_spec, "output_patch",
             intervention="output_patch", name="control_head_output_patch"),
)
INTERVENTION_NAMES: tuple[str, ...] = tuple(i.name for i in REGISTRY)
#: The five interventions of the paper, as the public functions (control_head repeats one of them).
INTERVENTIONS: dict[str, Callable] = {
    "write_block": write_block, "donor_write": donor_write, "state_swap": state_swap,
    "output_patch": output_patch, "output_restore": output_restore,
}


def named_intervention(name: str) -> NamedIntervention:
    """The registry entry called `name`; a ValueError lists the known names otherwise."""
    for entry in REGISTRY:
        if entry.name == name:
            return entry
    raise ValueError(f"unknown intervention {name!r}; known: {list(INTERVENTION_NAMES)}")


def controls_of(name: str) -> list[NamedIntervention]:
    """The registry's controls for intervention `name` (e.g. state_swap -> random_update, control_head)."""
    named_intervention(name)
    return [entry for entry in REGISTRY if entry.controls == name]
