"""The protocol verbs' command-line table: every verb's options, declared apart from its implementation.

This module imports only the standard library (and the pair layouts' names, interp.data.layout, itself standard
library only), so that `recurscope <verb> --help` and every argument error are answered without importing torch,
pandas or the models (tests/test_startup.py). A verb's module (protocols/<verb>.py) is imported only when the verb
runs (runner.run_verb).

Each verb is one `Verb`: its name and help line, the name of its run_* function (or of a `_from_args` that maps the
options itself) and of a model check, which shared option groups it takes and with which defaults, and its own
options. The option defaults a module also uses (LOADS, GAPS, GATE_THRESHOLD, CORRECTOR_METHODS, HYBRID_TASKS) live
here, and the modules import them from here, so each is written once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from recurscope.interp.capability import GATE_THRESHOLD

__all__ = ["Verb", "TABLE", "VERB_HELP", "add_verb", "NOT_WORK", "LOADS", "GAPS", "GATE_THRESHOLD",
           "CORRECTOR_METHODS", "HYBRID_TASKS", "TOPK_FORMATS"]

#: Loads K of the capacity and retention curves (§4.2, Fig. 7a-b, Fig. 8).
LOADS = (1, 2, 4, 8, 16, 32, 64)
#: Filler gaps of the capacity gap curve (§4.2, Fig. 7b).
GAPS = (128, 256, 512, 1024)
#: GATE_THRESHOLD, the paper's preset capability gate (recipient and donor clean recall both >= 80%, App. F.2), is
#: owned by the library's one gate, interp.capability (which imports nothing heavy until a gate is measured).
#: The corrector's methods: the paper's (four-way logits with state features) and the residual-direction variant.
CORRECTOR_METHODS = ("logits_and_state", "residual")
#: The hybrid factorial's tasks (hybrid.TASKS holds each one's description and the paper's numbers).
HYBRID_TASKS = ("recall", "update", "niah")
#: The App. E.2 top-k test's input formats (topk.FORMATS holds each one's template).
TOPK_FORMATS = ("compact", "naturalized")

#: Options that say how to compute, not what: left out of the manifest's work arguments.
NOT_WORK = {"resamples", "out", "device", "dtype", "batch_size", "fn", "command", "ray", "workers", "ray_timeout"}


@dataclass(frozen=True)
class Verb:
    """One protocol verb. run: the name of the protocol's run_* function in protocols/<name>.py, called with the
    parsed options as keyword arguments under the names its signature uses (runner.run_kwargs); from_args: the name
    of a function (model, args, run_dir, progress[, executor]) that maps the options itself, where given; check: the
    name of a function check(model) that raises ValueError before the result directory is made.

    The rest says which shared option groups the verb takes: the frozen head (head, ranking), the pair layout
    (layout: --layout with --filler / --presentations / --gap where those flags are set, --template and the word
    options), the fixed total length, Ray (ray: the verb's independent units, from_args/run(..., executor=)); and
    `options(p)` adds its own. `serial` says, for a verb without --ray, why its units are not independent."""

    name: str
    help: str
    run: str
    from_args: Optional[str] = None
    check: Optional[str] = None
    n_sources: int = 32
    head: bool = True                    # --head (else only --from-scan / --n-dev, e.g. a ranking)
    ranking: bool = True                 # --from-scan and --n-dev
    n_dev: int = 16
    from_scan_help: str = "a scan result directory whose top head is the frozen head"
    layout: bool = True                  # --layout
    filler: bool = True
    presentations: bool = True
    gap: bool = True
    template: bool = True                # --template and the word options (--vocab, --keys, --values, ...)
    fixed_length: bool = False           # --total-length (the load curves' fixed sequence length)
    options: Optional[Callable] = None
    defaults: dict = field(default_factory=dict)
    ray: bool = False                    # --ray / --workers: the verb's independent units on Ray
    serial: str = ""                     # without --ray: why its units are not independent (said in --help)
    note: str = ""                       # said in --help after the help line (e.g. why a verb takes no --layout)
    figures: tuple = ()                  # the figures it draws (figures/<name>.png), which runner.run_verb holds it to

    @property
    def module(self) -> str:
        return f"recurscope.interp.protocols.{self.name}"


# ---- the option groups ------------------------------------------------------------------------------------

def _head_options(p, *, head: bool, n_dev: int, from_scan_help: str) -> None:
    if head:
        p.add_argument("--head", type=int, nargs=2, metavar=("LAYER", "HEAD"), default=None,
                       help="the frozen head; default: the top head of --from-scan, else of a fresh scan on --n-dev "
                            "dev sources")
    p.add_argument("--from-scan", default=None, help=from_scan_help)
    p.add_argument("--n-dev", type=int, default=n_dev, help="dev sources for the head scan when no head is given")


def _layout_options(p, verb: Verb) -> None:
    from recurscope.interp.data.layout import DEFAULT_LAYOUT, LAYOUTS

    p.add_argument("--layout", default=None, choices=sorted(LAYOUTS),
                   help="the prompt layout (docs/data.md; default: the one the checkpoint records in "
                        f"pair_layout.json, else {DEFAULT_LAYOUT!r}); the options below override its fields")
    if verb.filler:
        p.add_argument("--filler", type=int, default=None, help="filler tokens between the last presentation and "
                       "the query (default: the layout's)")
    if verb.presentations:
        p.add_argument("--presentations", type=int, default=None, help="presentations of each binding (default: "
                       "the layout's)")
    if verb.gap:
        p.add_argument("--gap", type=int, default=None, help="filler tokens between presentations (default: the "
                       "layout's)")
    if not verb.template:
        return
    p.add_argument("--template", default=None, help="fact/query template (default: the layout's)")
    p.add_argument("--vocab", default="cities")
    p.add_argument("--keys", default=None, help="key words: a comma list, or a file with one word a line")
    p.add_argument("--values", default=None, help="value words: a comma list, or a file with one word a line")
    p.add_argument("--on-multitoken", default="filter", choices=["filter", "error"],
                   help="words that are not single tokens for the tokenizer: drop and list them (filter), or "
                        "refuse them by name (error)")


def add_gate_option(p, default: Optional[float], help: str) -> None:
    p.add_argument("--gate", type=float, default=default, metavar="THRESHOLD", help=help)


def _ray_options(p) -> None:
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the independent work units on Ray: alone, a local Ray instance; 'auto' or HOST:PORT, "
                        "an existing cluster (docs/distributed.md)")
    p.add_argument("--workers", type=int, default=None, help="with --ray: at most this many workers")


def add_verb(sub, verb: Verb, model_args, load, executor: Optional[Callable] = None,
             run_verb: Optional[Callable] = None) -> None:
    """Adds `verb`'s parser to the subparsers `sub`: the shared model options (model_args), the option groups and
    the verb's own options. Running it calls run_verb(verb, work, args, load, executor) (protocols.register_verbs
    passes runner.run_verb, which imports the verb's module; this table imports no runner). executor(args) ->
    executor(pairs, units, compute, on_rows): the CLI's Ray runner, for verbs with ray=True."""
    description = (verb.help + (f". Runs serially: {verb.serial}." if verb.serial else "")
                   + (f". {verb.note}." if verb.note else ""))
    p = sub.add_parser(verb.name, help=verb.help, description=description)
    model_args(p)
    before = {a.dest for a in p._actions}
    if verb.head or verb.ranking:
        _head_options(p, head=verb.head, n_dev=verb.n_dev, from_scan_help=verb.from_scan_help)
    p.add_argument("--n-sources", type=int, default=verb.n_sources, help="held-out sources to evaluate on")
    if verb.layout:
        _layout_options(p, verb)
    if verb.fixed_length:
        p.add_argument("--total-length", type=int, default=None, help="fixed sequence length (default: the K=16 "
                       "layout with 128 filler tokens, as `capacity`)")
    if verb.options:
        verb.options(p)
    if verb.ray:
        _ray_options(p)
    if verb.name != "gate":               # the gate verb is App. F.2's gate itself
        p.add_argument("--gate-threshold", dest="capability_threshold", type=float, default=GATE_THRESHOLD,
                       metavar="THRESHOLD",
                       help="the capability gate every verb passes first (interp.capability): held-out clean recall "
                            "of recipient and donor below this gives no verdict and names no head (default "
                            f"{GATE_THRESHOLD:g}, App. F.2); 0 turns it off for diagnostics, and every verdict then "
                            "reads 'not gated'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=9999, help="bootstrap resamples per interval")
    p.add_argument("--out", required=True, help="result directory (resumed if it holds the same work)")
    work = ["model", *sorted({a.dest for a in p._actions} - before - NOT_WORK - {"help"})]

    def run(args):
        return run_verb(verb, work, args, load, executor)
    p.set_defaults(fn=run, **verb.defaults)


# ---- each verb's own options ------------------------------------------------------------------------------

def _capacity_options(p) -> None:
    p.add_argument("--loads", type=int, nargs="*", default=list(LOADS))
    p.add_argument("--gaps", type=int, nargs="*", default=list(GAPS))
    add_gate_option(p, None, "refuse the state-swap shift of any condition under this clean recall (capability gate)")


def _lens_options(p) -> None:
    p.add_argument("--n-localise", type=int, default=96, help="dev sources the layer is localised on (separate "
                   "from the --n-sources held-out confirmation sources)")


def _gate_options(p) -> None:
    p.add_argument("--gap", type=int, default=24, help="filler tokens between presentations")
    p.add_argument("--fillers", type=int, nargs="+", default=[128, 512])
    p.add_argument("--recall", choices=("vocabulary", "candidates"), default="vocabulary",
                   help="vocabulary: full-vocabulary top-1 (the paper's); candidates: top-1 among four (easier)")
    p.add_argument("--threshold", type=float, default=GATE_THRESHOLD)


def _overlap_options(p) -> None:
    p.add_argument("--n-facts", type=int, nargs="+", default=[4], metavar="K",
                   help="facts K in the context, one run per load (the paper's Fig. 7c: 4), e.g. --n-facts 2 4 8")


def _retention_options(p) -> None:
    p.add_argument("--n-nontarget", type=int, default=7, help="non-target facts queried per pair (at most K - 1)")
    p.add_argument("--loads", type=int, nargs="+", default=list(LOADS))
    add_gate_option(p, None, "report no edit shift or break rate for a K whose clean recall is under this "
                    "(capability gate)")


def _corrector_options(p) -> None:
    p.add_argument("--n-fit", type=int, default=32, help="dev sources the corrector is fitted on")
    p.add_argument("--pairs-per-source", type=int, default=8)
    p.add_argument("--k", type=int, default=64, help="facts in the high-load layout")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--method", choices=CORRECTOR_METHODS, default="logits_and_state",
                   help="logits_and_state: the paper's (four-way logits with state features); residual: a variant")


def _reuse_options(p) -> None:
    p.add_argument("--n-fit", type=int, default=32, help="dev sources the colour basis is fitted on")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--formats", nargs="+", default=None, help="format keys, e.g. template:colon vocab:shapes "
                   "update:is_in (default: all)")
    add_gate_option(p, GATE_THRESHOLD, "capability gate on every format's clean recall (default 0.8)")
    p.add_argument("--no-gate", action="store_true", help="report every format without the capability gate")


def _hybrid_options(p) -> None:
    p.add_argument("--task", choices=list(HYBRID_TASKS), default="recall",
                   help="recall: §3.3 four-fact recall (Sec. 4.1); update: entity update, niah: RULER single-NIAH "
                        "(Table 2)")
    p.add_argument("--n-facts", type=int, default=None, help="facts bound per sequence (K; recall and update; "
                   "default: the layout's, 4)")
    p.add_argument("--total-length", type=int, default=None,
                   help="niah: tokens per sequence (default the smaller of 4096 and the model's positions)")


def _topk_options(p) -> None:
    p.add_argument("--formats", nargs="+", default=list(TOPK_FORMATS), choices=list(TOPK_FORMATS),
                   help="input formats, each on its own cohort (default: both)")
    p.add_argument("--filler", type=int, default=512, help="filler tokens between the last presentation and the "
                   "query (default: App. B's 512)")
    p.add_argument("--presentations", type=int, default=3, help="presentations of each binding (default 3)")
    p.add_argument("--gap", type=int, default=24, help="filler tokens between presentations (default 24)")
    add_gate_option(p, GATE_THRESHOLD, "capability gate on each format's held-out clean recall (default 0.8)")
    p.add_argument("--no-gate", action="store_true", help="report every format without the gate (then nothing is "
                   "compared with the paper)")


# ---- the table --------------------------------------------------------------------------------------------

TABLE: dict[str, Verb] = {v.name: v for v in (
    Verb("selectivity", "four-fact selectivity of the frozen head (§3.3, Fig. 5a-b)", "run_selectivity", ray=True, figures=('selectivity',)),
    Verb("coupling", "Frobenius coupling of two facts' state changes (§2.4, Fig. 5c)", "run_coupling", ray=True, figures=('coupling',)),
    Verb("neutral", "neutral suppression of the target fact (App. D.1, Fig. 12)", "run_neutral", ray=True, figures=('neutral',)),
    Verb("heads", "write-block non-additivity and joint top-k recovery (Fig. 3c, App. E.2)", "run_heads",
         from_args="_from_args", n_sources=64, head=False, n_dev=32,
         from_scan_help="a scan directory whose ranking to freeze (default: a fresh scan on --n-dev dev sources)",
         ray=True, figures=('recovery', 'nonadditivity')),
    Verb("headscan", "held-out all-head write and read scans (App. C, Fig. 10)", "run_headscan",
         defaults={"resamples": 2000}, ray=True, figures=('headscan',)),
    Verb("lens", "logit lens per layer and recurrent sublayer, localised on dev and confirmed held out (App. C, "
         "Fig. 11)", "run_lens", n_sources=128, head=False, ranking=False, options=_lens_options,
         ray=True, figures=('lens',)),
    Verb("gate", "the App. F.2 capability gate: one evidence sentence, two phrasings, full-vocabulary top-1 against a "
         "preset threshold, with an evidence-removed control", "run_gate", from_args="_from_args", head=False,
         ranking=False, layout=False, options=_gate_options, ray=True,
         note="Its layout is App. F.2's own (one evidence sentence, one fact, --fillers, --gap), so it takes no "
              "--layout", figures=('gate',)),
    Verb("capacity", "clean recall and state-swap shift against load K and gap (§4.2, Fig. 7a-b)", "run_capacity",
         filler=False, presentations=False, gap=False, fixed_length=True, options=_capacity_options, ray=True, figures=('load', 'gap')),
    Verb("overlap", "write-key overlap: interfering writes aligned with the target's write direction (§4.2, "
         "Fig. 7c)", "run_overlap", from_args="_from_args", options=_overlap_options, ray=True, figures=('overlap',)),
    Verb("retention", "clean recall, state-swap edit shift and non-target break rate against load K, with the "
         "random-update control (§4.2, Fig. 8)", "run_retention", n_sources=16, filler=False, presentations=False,
         gap=False, fixed_length=True, options=_retention_options, ray=True, figures=('retention',)),
    Verb("corrector", "a low-rank state-feature corrector fitted on dev sources, applied on held-out sources at high "
         "load (App. F.1)", "run_corrector", filler=False, presentations=False, gap=False, fixed_length=True,
         options=_corrector_options, serial="the corrector is fitted once on all --n-fit dev sources, and every arm "
         "(the corrector, its random map, the control head's corrector) applies that fit to every held-out source", figures=('corrector',)),
    Verb("reuse", "the frozen head's donor write across templates, value vocabularies and the update format, and the "
         "rank-4 colour-to-shape subspace transfer (App. D.2)", "run_reuse", from_args="_from_args",
         presentations=False, gap=False, template=False, options=_reuse_options, ray=True, figures=('reuse', 'subspace')),
    Verb("hybrid", "hybrid cache factorial: recurrent caches, attention KV, both (Sec. 4.1, Fig. 6); --task update "
         "or niah: Table 2", "run_hybrid", from_args="_from_args", check="require_hybrid", n_sources=128, head=False,
         ranking=False, options=_hybrid_options, ray=True, figures=('hybrid',)),
    Verb("topk", "the App. E.2 top-k test in the compact and naturalized formats, gated by clean recall (App. E.2, "
         "Fig. 14)", "run_topk", from_args="_from_args", n_sources=64, head=False, n_dev=32, layout=False,
         options=_topk_options, ray=True,
         from_scan_help="a scan directory whose ranking to freeze for every format (default: a fresh scan per "
                        "format on --n-dev dev sources)",
         note="Each format is App. B's layout in that format's wording (--filler, --presentations, --gap), so it "
              "takes no --layout", figures=('topk',)),
)}

#: One line per verb, for `recurscope --help`.
VERB_HELP = {name: verb.help for name, verb in TABLE.items()}
