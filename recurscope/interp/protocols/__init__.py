"""The paper's protocols beyond the scan and confirmation (How Linear Attention Remembers, §2.4, §3.3, §4.2, App. C,
D.1, D.2, E.2, F.1, F.2), one module each. Every protocol has a function returning a ProtocolResult (per-example rows, per-source means,
a source-bootstrap summary, a figure and a markdown report section with a "Reading" paragraph) and a row in the verbs'
table (verbs.py, which declares every verb's options without importing its module); the runner
(runner.py) runs it and owns the result directory, the tables, the figures and the report file, and every Reading's
verdict comes from interp.verdicts.

| verb | module | paper |
|---|---|---|
| selectivity | selectivity.py | §3.3, Fig. 5a-b: four-fact selectivity of a state swap and a donor write |
| coupling | coupling.py | §2.4, Fig. 5c: Frobenius coupling of two facts' state changes |
| neutral | neutral.py | App. D.1, Fig. 12: a neutral donor suppresses the target fact only |
| heads | heads.py | Fig. 3c, App. E.2: non-additivity of write blocks, joint top-k recovery |
| headscan | headscan.py | App. C, Fig. 10: held-out all-head write and read scans |
| lens | lens.py | App. C, Fig. 11: logit lens per layer for retention and update |
| gate | gate.py | App. F.2, Table 3: natural-sentence capability gate (the reusable gate of every verb: interp.capability) |
| capacity | capacity.py | §4.2, Fig. 7a-b: clean recall and state-swap shift against load K and gap |
| overlap | overlap.py | §4.2, Fig. 7c: interfering write keys aligned with the target's write direction |
| retention | retention.py | §4.2, Fig. 8: clean recall, state-swap edit shift and non-target breakage against K |
| corrector | corrector.py | App. F.1, Fig. 15: a low-rank state-feature corrector fitted on dev, applied held out |
| reuse | reuse.py | App. D.2, Fig. 13: the frozen head's donor write across formats; rank-4 value-subspace transfer |
| hybrid | hybrid.py | Sec. 4.1, Fig. 6: hybrid cache factorial (recurrent caches, attention KV, both) |
| topk | topk.py | App. E.2, Fig. 14: joint top-k recovery in the compact and naturalized formats, gated |
"""
from __future__ import annotations

from recurscope.interp.protocols.verbs import VERB_HELP

__all__ = ["ProtocolResult", "VERBS", "VERB_HELP", "register_verbs"]

VERBS = tuple(VERB_HELP)


def __getattr__(name: str):
    if name == "ProtocolResult":   # _common imports pandas and the interventions; not needed to build the parser
        from recurscope.interp.protocols._common import ProtocolResult

        globals()[name] = ProtocolResult
        return ProtocolResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_verbs(subparsers, model_args, load, executor=None) -> None:
    """Adds one subcommand per protocol to the `recurscope` parser, from the verbs' table (protocols.verbs), which
    imports no protocol module: a verb's module (with torch) is imported only when the verb runs. model_args(p) adds
    the shared model options (model, --device, --dtype, --batch-size) and load(args) loads the model, both from
    interp.cli; executor(args), also from interp.cli, runs a verb's independent units on Ray (--ray)."""
    from recurscope.interp.protocols.verbs import TABLE, add_verb

    def run_verb(*args):   # the runner (pandas, the modules) only when a verb runs
        from recurscope.interp.protocols.runner import run_verb as run

        return run(*args)

    for verb in VERBS:
        add_verb(subparsers, TABLE[verb], model_args, load, executor, run_verb)
