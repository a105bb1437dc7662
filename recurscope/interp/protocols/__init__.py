"""The paper's protocols beyond the scan and confirmation (How Linear Attention Remembers, §2.4, §3.3, §4.2, App. C,
D.1, D.2, E.2, F.1, F.2), one module each. Every protocol has a function returning a ProtocolResult (per-example rows, per-source means,
a source-bootstrap summary, a figure and a markdown report section with a "Reading" paragraph) and a VERB; the runner
(runner.py) owns the options, the result directory, the tables, the figures and the report file, and every Reading's
verdict comes from interp.verdicts.

| verb | module | paper |
|---|---|---|
| selectivity | selectivity.py | §3.3, Fig. 5a-b: four-fact selectivity of a state swap and a donor write |
| coupling | coupling.py | §2.4, Fig. 5c: Frobenius coupling of two facts' state changes |
| neutral | neutral.py | App. D.1, Fig. 12: a neutral donor suppresses the target fact only |
| heads | heads.py | Fig. 3c, App. E.2: non-additivity of write blocks, joint top-k recovery |
| headscan | headscan.py | App. C, Fig. 10: held-out all-head write and read scans |
| lens | lens.py | App. C, Fig. 11: logit lens per layer for retention and update |
| gate | gate.py | App. F.2, Table 3: natural-sentence capability gate (reusable: capability_gate, require_capability) |
| capacity | capacity.py | §4.2, Fig. 7a-b: clean recall and state-swap shift against load K and gap |
| overlap | overlap.py | §4.2, Fig. 7c: interfering write keys aligned with the target's write direction |
| retention | retention.py | §4.2, Fig. 8: clean recall, state-swap edit shift and non-target breakage against K |
| corrector | corrector.py | App. F.1, Fig. 15: a low-rank state-feature corrector fitted on dev, applied held out |
| reuse | reuse.py | App. D.2, Fig. 13: the frozen head's donor write across formats; rank-4 value-subspace transfer |
| hybrid | hybrid.py | Sec. 4.1, Fig. 6: hybrid cache factorial (recurrent caches, attention KV, both) |
| topk | topk.py | App. E.2, Fig. 14: joint top-k recovery in the compact and naturalized formats, gated |
"""
from __future__ import annotations

import argparse
import importlib

__all__ = ["ProtocolResult", "VERBS", "VERB_HELP", "VerbParser", "register_verbs"]

#: One line per verb for `recurscope --help`, which lists the verbs without importing their modules (each imports
#: torch, pandas and the models). A verb's module is imported when the verb is chosen; its own `--help` starts with
#: this line too (tests/test_startup.py checks that the two agree).
VERB_HELP = {
    "selectivity": "four-fact selectivity of the frozen head (§3.3, Fig. 5a-b)",
    "coupling": "Frobenius coupling of two facts' state changes (§2.4, Fig. 5c)",
    "neutral": "neutral suppression of the target fact (App. D.1, Fig. 12)",
    "heads": "write-block non-additivity and joint top-k recovery (Fig. 3c, App. E.2)",
    "headscan": "held-out all-head write and read scans (App. C, Fig. 10)",
    "lens": "logit lens per layer and recurrent sublayer, localised on dev and confirmed held out (App. C, Fig. 11)",
    "gate": "the App. F.2 capability gate: one evidence sentence, two phrasings, full-vocabulary top-1 against a "
            "preset threshold, with an evidence-removed control",
    "capacity": "clean recall and state-swap shift against load K and gap (§4.2, Fig. 7a-b)",
    "overlap": "write-key overlap: interfering writes aligned with the target's write direction (§4.2, Fig. 7c)",
    "retention": "clean recall, state-swap edit shift and non-target break rate against load K, with the "
                 "random-update control (§4.2, Fig. 8)",
    "corrector": "a low-rank state-feature corrector fitted on dev sources, applied on held-out sources at high load "
                 "(App. F.1)",
    "reuse": "the frozen head's donor write across templates, value vocabularies and the update format, and the "
             "rank-4 colour-to-shape subspace transfer (App. D.2)",
    "hybrid": "hybrid cache factorial: recurrent caches, attention KV, both (Sec. 4.1, Fig. 6); --task update or niah: "
              "Table 2",
    "topk": "the App. E.2 top-k test in the compact and naturalized formats, gated by clean recall (App. E.2, Fig. 14)",
}
VERBS = tuple(VERB_HELP)


def __getattr__(name: str):
    if name == "ProtocolResult":   # _common imports pandas and the interventions; not needed to build the parser
        from recurscope.interp.protocols._common import ProtocolResult

        globals()[name] = ProtocolResult
        return ProtocolResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class VerbParser(argparse.ArgumentParser):
    """An ArgumentParser whose options may be added on first use: `fill(parser)`, if given, runs once before the
    parser parses or formats its help. The `recurscope` command gives its subcommands this class, so that a
    protocol verb's module is imported only when that verb is chosen."""

    def __init__(self, *args, fill=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._fill = fill

    def _filled(self) -> None:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)

    def parse_known_args(self, args=None, namespace=None):
        self._filled()
        return super().parse_known_args(args, namespace)

    def format_usage(self):
        self._filled()
        return super().format_usage()

    def format_help(self):
        self._filled()
        return super().format_help()


class _OneVerb:
    """What runner.add_verb sees as the subparsers: its `add_parser(verb, help=...)` returns the verb's existing
    parser, whose description becomes that help."""

    def __init__(self, verb: str, parser: argparse.ArgumentParser):
        self.verb, self.parser = verb, parser

    def add_parser(self, name: str, help: str | None = None, **kwargs):
        if name != self.verb or kwargs:
            raise TypeError(f"protocol verb {self.verb!r}: expected add_parser({self.verb!r}, help=...), got "
                            f"add_parser({name!r}, {sorted(kwargs)})")
        if self.parser.description is None:
            self.parser.description = help
        return self.parser


def register_verbs(subparsers, model_args, load, executor=None) -> None:
    """Adds one subcommand per protocol to the `recurscope` parser (protocols.runner.add_verb with the module's VERB).
    model_args(p) adds the shared model options (model, --device, --dtype, --batch-size) and load(args) loads the
    model, both from interp.cli. When `subparsers` makes VerbParser parsers (add_subparsers(parser_class=VerbParser),
    as the `recurscope` command does), each verb's module is imported and its options added only when the verb is
    chosen; with plain parsers, all at once. executor(args), also from interp.cli, runs a verb's independent units
    on Ray (--ray, for the verbs whose VERB has ray=True)."""
    from_the_start = not issubclass(getattr(subparsers, "_parser_class", object), VerbParser)
    for verb in VERBS:
        def fill(parser, verb=verb):
            from recurscope.interp.protocols.runner import add_verb

            module = importlib.import_module(f"recurscope.interp.protocols.{verb}")
            add_verb(parser if from_the_start else _OneVerb(verb, parser), module.VERB, model_args, load,
                     executor)
        if from_the_start:
            fill(subparsers)
        else:
            subparsers.add_parser(verb, help=VERB_HELP[verb], fill=fill)
