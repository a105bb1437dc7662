"""The protocol runner: what every protocol verb shares, so that a protocol module holds only its science.

A protocol module supplies its computation (`run_*`, returning a ProtocolResult), its figures (FigureSpec), its
report section (Section: title, intro, tables, reading sentences from interp.verdicts) and one Verb. The runner owns
- the arguments: one set of option groups (frozen head, sources, pair layout, fixed length, gate, seed, resamples,
  result directory), each declared once, and the verb's own options;
- the result directory and its manifest: the work's arguments are every option the verb declares except how it is
  computed (--resamples, --out, --device, --dtype, --batch-size), so a rerun with the same work resumes;
- the per-row, per-source and summary tables (CSV and parquet), the figures (PNG and SVG) and report.md, written
  by finish();
- printing the section and where the results are.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import pandas as pd

from recurscope.interp.protocols._common import ProtocolResult, pair_kwargs

__all__ = ["Verb", "FigureSpec", "Section", "finish", "render", "add_verb", "layout_from_args", "add_gate_option",
           "run_kwargs"]

#: Options that say how to compute, not what: left out of the manifest's work arguments.
_NOT_WORK = {"resamples", "out", "device", "dtype", "batch_size", "fn", "command", "ray", "workers"}
#: Option names whose run_* parameter is named differently (the rest share their names).
_RENAMES = {"resamples": "n_resamples", "model": "model_name", "gate": "gate_threshold"}


# ---- the option groups ------------------------------------------------------------------------------------

def _head_options(p, *, head: bool, n_dev: int, from_scan_help: str) -> None:
    if head:
        p.add_argument("--head", type=int, nargs=2, metavar=("LAYER", "HEAD"), default=None,
                       help="the frozen head; default: the top head of --from-scan, else of a fresh scan on --n-dev "
                            "dev sources")
    p.add_argument("--from-scan", default=None, help=from_scan_help)
    p.add_argument("--n-dev", type=int, default=n_dev, help="dev sources for the head scan when no head is given")


def _layout_options(p, *, filler: bool, presentations: Optional[int], gap: Optional[int], template: str) -> None:
    if filler:
        p.add_argument("--filler", type=int, default=512, help="filler tokens between the last presentation and "
                       "the query")
    if presentations is not None:
        p.add_argument("--presentations", type=int, default=presentations)
    if gap is not None:
        p.add_argument("--gap", type=int, default=gap, help="filler tokens between presentations")
    if template:
        p.add_argument("--template", default=template)
        p.add_argument("--vocab", default="cities")
        p.add_argument("--keys", default=None, help="key words: a comma list, or a file with one word a line")
        p.add_argument("--values", default=None, help="value words: a comma list, or a file with one word a line")
        p.add_argument("--on-multitoken", default="filter", choices=["filter", "error"],
                       help="words that are not single tokens for the tokenizer: drop and list them (filter), or "
                            "refuse them by name (error)")


def add_gate_option(p, default: Optional[float], help: str) -> None:
    p.add_argument("--gate", type=float, default=default, metavar="THRESHOLD", help=help)


def layout_from_args(args) -> dict:
    """The §3.3 layout of the parsed options, as build_pairs keyword arguments."""
    return pair_kwargs(filler=args.filler, presentations=args.presentations, template=args.template,
                       vocab=args.vocab, seed=args.seed, gap_tokens=args.gap,
                       keys=_words(getattr(args, "keys", None)), values=_words(getattr(args, "values", None)),
                       on_multitoken=getattr(args, "on_multitoken", "filter"))


def _words(spec):
    """A --keys/--values value: a file with one word a line, or a comma list."""
    if spec is None:
        return None
    from pathlib import Path

    path = Path(spec)
    words = path.read_text().splitlines() if path.is_file() else spec.split(",")
    words = [w.strip() for w in words if w.strip()]
    if not words:
        raise ValueError(f"{spec!r} holds no words; pass a comma list or a file with one word a line")
    return words


@dataclass(frozen=True)
class Verb:
    """One protocol verb. run: the protocol's run_* function, called with the parsed options as keyword arguments
    under the names its signature uses (run_kwargs); from_args(model, args, run_dir, progress), where given, maps
    the options itself. The rest says which shared option groups the verb takes and with which defaults;
    options(p) adds its own."""

    name: str
    help: str
    run: Callable
    from_args: Optional[Callable] = None
    n_sources: int = 32
    head: bool = True                    # --head (else only --from-scan / --n-dev, e.g. a ranking)
    ranking: bool = True                 # --from-scan and --n-dev
    n_dev: int = 16
    from_scan_help: str = "a scan result directory whose top head is the frozen head"
    filler: bool = True
    presentations: Optional[int] = 3
    gap: Optional[int] = 24
    template: str = "is_in"
    fixed_length: bool = False           # --total-length (the load curves' fixed sequence length)
    options: Optional[Callable] = None
    defaults: dict = field(default_factory=dict)
    check: Optional[Callable] = None     # check(model) raises ValueError before the result directory is made
    ray: bool = False                    # --ray / --workers: from_args(..., executor=) runs independent units on Ray


def add_verb(sub, verb: Verb, model_args, load, executor: Optional[Callable] = None) -> None:
    """executor(args) -> executor(pairs, units, compute, on_rows): the CLI's Ray runner, for verbs with ray=True."""
    p = sub.add_parser(verb.name, help=verb.help)
    model_args(p)
    before = {a.dest for a in p._actions}
    if verb.head or verb.ranking:
        _head_options(p, head=verb.head, n_dev=verb.n_dev, from_scan_help=verb.from_scan_help)
    p.add_argument("--n-sources", type=int, default=verb.n_sources, help="held-out sources to evaluate on")
    _layout_options(p, filler=verb.filler, presentations=verb.presentations, gap=verb.gap, template=verb.template)
    if verb.fixed_length:
        p.add_argument("--total-length", type=int, default=None, help="fixed sequence length (default: the K=16 "
                       "layout with 128 filler tokens, as `capacity`)")
    if verb.options:
        verb.options(p)
    if verb.ray:
        p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run the independent work units on Ray: alone, a local Ray instance; 'auto' or HOST:PORT, "
                            "an existing cluster (docs/distributed.md)")
        p.add_argument("--workers", type=int, default=None, help="with --ray: at most this many workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resamples", type=int, default=9999, help="bootstrap resamples per interval")
    p.add_argument("--out", required=True, help="result directory (resumed if it holds the same work)")
    work = ["model", *sorted({a.dest for a in p._actions} - before - _NOT_WORK - {"help"})]
    p.set_defaults(fn=lambda args: _cli(verb, work, args, load, executor), **verb.defaults)


def run_kwargs(run: Callable, args) -> dict:
    """The parsed options as keyword arguments of `run` (a run_* function): its own names (_RENAMES), and the §3.3
    layout as `layout` where the verb takes the whole layout."""
    values = {_RENAMES.get(k, k): v for k, v in vars(args).items()}
    if all(hasattr(args, k) for k in ("filler", "presentations", "gap", "template", "vocab")):
        values["layout"] = layout_from_args(args)
    params = inspect.signature(run).parameters
    return {k: v for k, v in values.items() if k in params}


def _cli(verb: Verb, work: Sequence[str], args, load, executor=None) -> int:
    from recurscope.interp.protocols._common import open_run

    model = load(args)
    if verb.check is not None:
        verb.check(model)
    run = open_run(args.out, kind=verb.name, model=model, model_name=args.model,
                   args={k: getattr(args, k) for k in work}, seeds=[args.seed], split="heldout")
    progress = lambda what: print(f"{verb.name}: {what}", flush=True)  # noqa: E731
    if verb.ray and getattr(args, "ray", None):
        if executor is None:
            raise ValueError(f"{verb.name} --ray needs the command line's Ray runner; run it through `recurscope`")
        ex = executor(args)
        result = (verb.from_args(model, args, run, progress, executor=ex) if verb.from_args is not None else
                  verb.run(model, run_dir=run, progress=progress, executor=ex, **run_kwargs(verb.run, args)))
    elif verb.from_args is not None:
        result = verb.from_args(model, args, run, progress)
    else:
        result = verb.run(model, run_dir=run, progress=progress, **run_kwargs(verb.run, args))
    print(result.section)
    print(f"results in {run.path}")
    return 0


# ---- figures and the report section -----------------------------------------------------------------------

@dataclass
class FigureSpec:
    """One figure of a protocol: plot_interval_panels(frame, <run>/figures/<name>, **options), or draw(path) -> png
    path for a figure of its own kind."""

    name: str
    frame: Optional[pd.DataFrame] = None
    options: dict = field(default_factory=dict)
    draw: Optional[Callable] = None


@dataclass
class Section:
    """A protocol's report section: the title (after "## "), the intro paragraph, the table blocks (each a list of
    markdown lines; blocks are separated by a blank line) and the Reading's sentences."""

    title: str
    intro: str
    tables: list = field(default_factory=list)
    reading: list = field(default_factory=list)


def render(section: Section, figures: dict) -> str:
    lines = [f"## {section.title}", "", section.intro]
    for block in section.tables:
        lines += ["", *block]
    for name, png in figures.items():
        lines += ["", f"![{name}](figures/{png.name})"]
    lines += ["", "### Reading", "", " ".join(str(sentence) for sentence in section.reading)]
    return "\n".join(lines)


def finish(result: ProtocolResult, run_dir, section: Callable[[ProtocolResult], Section],
           figures: Sequence[FigureSpec] = ()) -> ProtocolResult:
    """Draws the figures (when there is a result directory), renders the section and writes the per-row and
    per-source tables, the summary and report.md into run_dir."""
    result.run_dir = run_dir
    if run_dir is not None:
        from recurscope.interp.plots import plot_interval_panels

        for spec in figures:
            path = run_dir.figure_path(spec.name)
            result.figures[spec.name] = (spec.draw(path) if spec.draw is not None else
                                         plot_interval_panels(spec.frame, path, **spec.options).png)
    result.section = render(section(result), result.figures)
    if run_dir is None:
        return result
    run_dir.write_table(f"{result.name}_rows", result.rows)      # the row log's finished copy, CSV and parquet
    run_dir.write_table(f"{result.name}_sources", result.sources)
    run_dir.write_table(f"{result.name}_summary", result.summary)
    (run_dir.path / "report.md").write_text(result.section + "\n")
    return result
