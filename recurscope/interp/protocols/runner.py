"""The protocol runner: what every protocol verb shares, so that a protocol module holds only its science.

A protocol module supplies its computation (`run_*`, returning a ProtocolResult), its figures (FigureSpec), its
report section (Section: title, intro, tables, reading sentences from interp.verdicts); its options are its row of
the verbs' table (verbs.py). The runner owns
- running a verb whose options the verbs' table (verbs.py) declared: its module imported, the model loaded, the pair
  layout resolved (PairSpec: --layout, else the checkpoint's recorded layout, else the paper's), its run_* called,
  on Ray where the verb's units are independent and --ray is given;
- the result directory and its manifest: the work's arguments are every option the verb declares except how it is
  computed (--resamples, --out, --device, --dtype, --batch-size, --ray, --workers), and the resolved layout, so a
  rerun with the same work resumes;
- the per-row, per-source and summary tables (CSV and parquet), the figures (PNG and SVG) and report.md, written
  by finish();
- printing the section and where the results are.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import pandas as pd

from recurscope.interp.protocols._common import PairSpec, ProtocolResult
from recurscope.interp.protocols.verbs import Verb
from recurscope.interp.verdicts import gate_off

__all__ = ["FigureSpec", "Section", "finish", "render", "run_verb", "pair_spec_from_args", "run_kwargs"]

#: Option names whose run_* parameter is named differently (the rest share their names).
_RENAMES = {"resamples": "n_resamples", "model": "model_name", "gate": "gate_threshold"}


# ---- from the options to the run --------------------------------------------------------------------------

def pair_spec_from_args(args, model) -> PairSpec:
    """The pairs the options ask for: --layout (default: the layout the checkpoint records in pair_layout.json,
    else the paper's), its fields overridden by --filler / --presentations / --gap / --template where given, and
    the words (--vocab, --keys, --values, --on-multitoken) and --seed."""
    from recurscope.interp.data.layout import choose_layout

    layout = choose_layout(getattr(args, "layout", None), getattr(model, "checkpoint_dir", None),
                           filler_tokens=getattr(args, "filler", None),
                           presentations=getattr(args, "presentations", None), gap_tokens=getattr(args, "gap", None),
                           template=getattr(args, "template", None))
    return PairSpec(layout, vocab=getattr(args, "vocab", "cities"), keys=_words(getattr(args, "keys", None)),
                    values=_words(getattr(args, "values", None)),
                    on_multitoken=getattr(args, "on_multitoken", "filter"), seed=args.seed)


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
    return tuple(words)


def run_kwargs(run: Callable, args) -> dict:
    """The parsed options as keyword arguments of `run` (a run_* function): its own names (_RENAMES), and the pairs
    (pair_spec_from_args, resolved once the model is loaded) as `layout`."""
    values = {_RENAMES.get(k, k): v for k, v in vars(args).items()}
    values["layout"] = getattr(args, "pair_spec", None)
    params = inspect.signature(run).parameters
    return {k: v for k, v in values.items() if k in params}


def run_verb(verb: Verb, work: Sequence[str], args, load, executor=None) -> int:
    """Runs a parsed verb: imports its module, loads the model, opens the result directory (its manifest's work:
    the options in `work` and the resolved pair layout) and calls the verb's run_* (or from_args)."""
    from recurscope.interp.protocols._common import open_run

    module = importlib.import_module(verb.module)
    model = load(args)
    if verb.check is not None:
        getattr(module, verb.check)(model)
    work_args = {k: getattr(args, k) for k in work}
    if getattr(args, "tokenizer", None):   # the prompts are that tokenizer's ids; named only when given
        work_args["tokenizer"] = str(args.tokenizer)
    if verb.layout:
        args.pair_spec = pair_spec_from_args(args, model)
        work_args["pair_layout"] = args.pair_spec.layout.to_dict()
    run = open_run(args.out, kind=verb.name, model=model, model_name=args.model, args=work_args, seeds=[args.seed],
                   split="heldout")
    gate = verb_gate(model, args, run)
    if gate is not None and not gate.passed:
        text = refusal_section(verb.name, args.model, gate)
        (run.path / "report.md").write_text(text + "\n")
        print(text)
        print(f"results in {run.path}")
        return 0
    progress = lambda what: print(f"{verb.name}: {what}", flush=True)  # noqa: E731
    extra = {}
    if verb.ray and getattr(args, "ray", None):
        if executor is None:
            raise ValueError(f"{verb.name} --ray needs the command line's Ray runner; run it through `recurscope`")
        extra["executor"] = executor(args)
    with (gate_off() if gate is not None and gate.off else contextlib.nullcontext()):
        if verb.from_args is not None:
            result = getattr(module, verb.from_args)(model, args, run, progress, **extra)
        else:
            fn = getattr(module, verb.run)
            result = fn(model, run_dir=run, progress=progress, **extra, **run_kwargs(fn, args))
    undeclared = sorted(set(getattr(result, "figures", {})) - set(verb.figures))
    if undeclared:   # the table is what tests and docs read; a figure it does not name is a slip in the table
        raise RuntimeError(f"{verb.name} drew figures {undeclared} that its entry in protocols/verbs.py does not declare "
                           f"(figures={verb.figures!r}); add them there")
    print(result.section)
    print(f"results in {run.path}")
    return 0


#: The smallest model whose numbers the paper reports (GLA-340M, GDN-340M): the default of the scale caveat.
PAPER_PARAMS, PAPER_MODEL = 340e6, "340M models (GLA-340M, GDN-340M)"


def paper_scale_caveat(info: dict) -> Optional[str]:
    """The Reading's scale sentence (verdicts.scale_caveat) for a run whose info records n_params
    (_common.model_record), against info's paper_params / paper_model where a protocol compares with another paper
    model (e.g. topk's RWKV7-13.3B), else the paper's 340M models."""
    from recurscope.interp.verdicts import scale_caveat

    return scale_caveat(info.get("n_params"), info.get("paper_params", PAPER_PARAMS),
                        info.get("paper_model", PAPER_MODEL))


def verb_gate(model, args, run_dir=None):
    """The capability gate a verb passes before anything is run (interp.capability.check_capability): clean recall
    of recipient and donor on the verb's held-out swap pairs (its layout and words, --n-sources sources) against
    --gate-threshold, written to gate.json; None for a verb without the option (the gate verb, App. F.2 itself)."""
    import json

    from recurscope.interp.capability import check_capability, gate_record

    threshold = getattr(args, "capability_threshold", None)
    if threshold is None:
        return None
    pairs, n_sources = None, None
    if threshold != 0:
        from recurscope.interp.data import build_pairs
        from recurscope.interp.protocols._common import max_length

        spec = getattr(args, "pair_spec", None) or pair_spec_from_args(args, model)
        pairs = build_pairs(model.tokenizer, split="heldout", n_sources=args.n_sources, max_length=max_length(model),
                            **spec.kwargs())
        n_sources = int(pairs.source_id.unique().numel())
    gate = check_capability(model, pairs, threshold, condition=f"{args.n_sources} held-out sources",
                            batch_size=getattr(args, "batch_size", 16), seed=args.seed,
                            n_resamples=min(getattr(args, "resamples", 9999), 9999))
    if run_dir is not None:
        (run_dir.path / "gate.json").write_text(json.dumps(gate_record(gate, n_sources, "heldout"), indent=1) + "\n")
    if gate.off:
        import sys

        print("WARNING: --gate-threshold 0: the capability gate is off; nothing here shows the model does the task, "
              "and every verdict reads 'not gated'", file=sys.stderr)
    return gate


def refusal_section(verb: str, model_name: str, gate) -> str:
    """The report of a verb the capability gate refused: why, and no verdict, no head."""
    from recurscope.interp.verdicts import REFUSED

    return "\n".join([f"## {verb}: {model_name} {REFUSED}", "",
                      f"THE MODEL DOES NOT DO THE TASK: {gate.describe()}.", "", "### Reading", "",
                      "No verdict is given and no head is named: patching a model that does not recall the bindings "
                      "measures nothing (App. F.2 gates at 80%). Check the layout (--layout), the filler and the "
                      "words against what the model was trained on; --gate-threshold 0 runs the protocol anyway for "
                      "diagnostics, with every verdict reading 'not gated'."])


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
    sec = section(result)
    caveat = paper_scale_caveat(result.info)
    if caveat:
        sec.reading.append(caveat)
    result.section = render(sec, result.figures)
    if run_dir is None:
        return result
    run_dir.write_table(f"{result.name}_rows", result.rows)      # the row log's finished copy, CSV and parquet
    run_dir.write_table(f"{result.name}_sources", result.sources)
    run_dir.write_table(f"{result.name}_summary", result.summary)
    from recurscope.interp.results import write_output

    write_output(run_dir.path / "report.md", result.section + "\n")
    return result
