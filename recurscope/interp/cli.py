"""The `recurscope` command: list models, scan heads on dev sources, confirm them on held-out sources, patch one
pair, or run the whole study (scan, confirmation, report) in one go."""
# The parser is built, and bad arguments are refused, without importing torch, pandas or transformers (seconds
# each): those are imported inside the commands that use them (tests/test_startup.py).
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from recurscope.interp import cli_checks   # the guards; standard library only at import
# Clean recall below GATE_THRESHOLD means the model does not do the task: no head is named and no control is read
# (App. F.2 gates at 80% top-1); the library's one gate owns the number (its module imports torch only to measure).
from recurscope.interp.capability import GATE_THRESHOLD

#: --dtype choices: names of torch dtypes
DTYPES = ("float32", "bfloat16", "float16", "float64")
# Share of --corpus filler tokens that may be the tokenizer's unknown token before a run is refused (fixed before
# any run, not tuned on results): above it the filler is mostly [UNK], not the corpus' text. --allow-unk overrides.
MAX_FILLER_UNKNOWN_RATE = 0.05
# Pairs per source: 4 narrows the state-swap interval on tiny-gla's 32 held-out sources from 3.04 logits (1 pair)
# to 1.15 (measured; README), so source means carry several pairs and the source bootstrap is a cluster bootstrap.
DEFAULT_PAIRS_PER_SOURCE = 4


class UsageError(ValueError):
    """Bad command-line input: the message is one line naming the problem and the fix."""


# ---- shared options ------------------------------------------------------------------------------------------
def _model_args(p):
    p.add_argument("model", nargs="?", default="tiny-gla", help="a bundled name (see `recurscope models`) or a local checkpoint directory")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (checked before the model loads)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="load the tokenizer from DIR (tokenizer.json and tokenizer_config.json) instead of the "
                        "checkpoint's own, e.g. for a checkpoint saved without one")
    p.add_argument("--batch-size", type=int, default=16)
    cli_checks.add_limit_args(p)


# Held-out sources of a confirmation: 128, as in the paper (its Fig. 3a rates are multiples of 1/128). Dev sources of
# a scan: 16.
N_SOURCES = {"dev": 16, "heldout": 128}


def _pair_args(p, split, choose_sources=True):
    if choose_sources:  # `run` picks its own splits (--n-dev, --n-heldout)
        p.add_argument("--sources", default=split, choices=["dev", "heldout"], help="which split of sources (never overlap)")
        p.add_argument("--n-sources", type=int, default=N_SOURCES[split],
                       help=f"how many sources of the split (default {N_SOURCES[split]})")
    p.add_argument("--pairs-per-source", type=int, default=DEFAULT_PAIRS_PER_SOURCE,
                   help="donor/recipient pairs built on each source's filler; intervals resample sources, so more "
                        f"pairs per source give tighter source means (default {DEFAULT_PAIRS_PER_SOURCE}, see README)")
    p.add_argument("--corpus", default=None, help="take filler from a local corpus (a WikiText .raw file, a PG19 or .txt folder)")
    p.add_argument("--allow-unk", action="store_true",
                   help=f"run even if more than {MAX_FILLER_UNKNOWN_RATE:.0%}% of the --corpus filler tokens are "
                        "the tokenizer's unknown token")
    _layout_args(p)
    p.add_argument("--lengths", default="equal", choices=["equal", "natural"],
                   help="equal: every prompt cut or lengthened a word at a time to the planned token count (the "
                        "default); natural: each source keeps its natural token length and rows of different lengths "
                        "run packed (cu_seqlens), with no padding computed (docs/data.md)")
    p.add_argument("--seed", type=int, default=0)


def _layout_args(p):
    """The prompt layout and its words: every verb that builds pairs takes them (docs/data.md)."""
    from recurscope.interp.data.layout import DEFAULT_LAYOUT, LAYOUTS

    p.add_argument("--layout", default=None, choices=sorted(LAYOUTS),
                   help="the prompt layout (default: the one the checkpoint records in pair_layout.json, else "
                        f"{DEFAULT_LAYOUT!r}: 4 bindings x 3 presentations, 512 filler tokens, a single-token query)")
    p.add_argument("--n-facts", type=int, default=None, help="bindings per prompt (default: the layout's)")
    p.add_argument("--presentations", type=int, default=None, help="presentations of each binding (default: the layout's)")
    p.add_argument("--filler", type=int, default=None,
                   help="filler tokens between the last presentation and the query (default: the layout's)")
    p.add_argument("--gap", type=int, default=None, help="filler tokens between presentations (default: the layout's)")
    p.add_argument("--template", default=None, help="fact/query template (default: the layout's)")
    p.add_argument("--vocab", default="cities", help="value vocabulary (see docs/data.md); --values overrides it")
    p.add_argument("--keys", default=None, help="key words: a comma list, or a file with one word a line")
    p.add_argument("--values", default=None, help="value words: a comma list, or a file with one word a line")
    p.add_argument("--on-multitoken", default="filter", choices=["filter", "error"],
                   help="words that are not single tokens for the model's tokenizer: drop them and list them in the "
                        "report (filter, the default) or refuse the run naming them (error)")


def word_list(spec):
    """A --keys/--values value: a file with one word a line, or a comma-separated list."""
    if spec is None:
        return None
    path = Path(spec)
    words = path.read_text().split("\n") if path.is_file() else spec.split(",")
    words = [w.strip() for w in words if w.strip()]
    if not words:
        raise UsageError(f"{spec!r} holds no words; pass a comma list (--values red,blue,green,gold) or a file with "
                         "one word a line")
    return words


def pair_layout(model, args):
    """The PairLayout of a run: --layout, else the checkpoint's recorded layout, else the paper's; the explicit
    layout options override its fields."""
    from recurscope.interp.data.layout import choose_layout

    return choose_layout(getattr(args, "layout", None), getattr(model, "checkpoint_dir", None),
                         n_facts=args.n_facts, presentations=args.presentations, filler_tokens=args.filler,
                         gap_tokens=getattr(args, "gap", None), template=args.template)


def _load(args):
    import torch

    from recurscope.interp.loading import load_model

    # Under --ray the workers compute on --device; the driver only builds pairs, lists and checks heads, picks
    # controls and hashes the checkpoint, so its copy stays on the CPU rather than taking GPU 0 beside actor 0.
    device = "cpu" if getattr(args, "ray", None) else args.device
    model = load_model(args.model, device=device, dtype=getattr(torch, args.dtype),
                       tokenizer=getattr(args, "tokenizer", None))
    cli_checks.check_loaded(model, args)   # options that need the model: heads in range, lengths that fit
    if getattr(args, "lengths", "equal") == "natural":
        cli_checks.check_packing(model)    # before any pair is built
    return model


def _pairs(model, args):
    from recurscope.interp.data import build_pairs

    layout = pair_layout(model, args)
    args.pair_layout = layout.to_dict()
    kwargs = dict(layout=layout, vocab=args.vocab, keys=word_list(getattr(args, "keys", None)),
                  values=word_list(getattr(args, "values", None)), on_multitoken=args.on_multitoken,
                  seed=args.seed, pairs_per_source=args.pairs_per_source,
                  equal_length=getattr(args, "lengths", "equal") == "equal",
                  max_length=getattr(model.cfg, "max_position_embeddings", None) if model.attention_layers else None)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UsageError(f"{args.model} has no tokenizer, and recall pairs are written as text for the model's own "
                         "tokenizer: pass --tokenizer DIR (a directory holding its tokenizer.json), or save the "
                         "tokenizer's files beside config.json")
    if args.corpus:
        from recurscope.interp.data import corpus_sources, read_text_folder, read_wikitext

        path = Path(args.corpus)
        docs = read_wikitext(path) if path.is_file() else read_text_folder(path)
        srcs = corpus_sources(docs, split=args.sources, n=args.n_sources)
        pairs = build_pairs(tokenizer, srcs, **kwargs)
    else:
        pairs = build_pairs(tokenizer, split=args.sources, n_sources=args.n_sources, **kwargs)
    _check_filler(pairs, args, tokenizer)
    dropped = {**pairs.report.get("dropped_keys", {}), **pairs.report.get("dropped_values", {})}
    if dropped:
        print(f"dropped {len(dropped)} word(s) that are not single tokens for this tokenizer "
              f"(--on-multitoken filter): {', '.join(sorted(dropped))}", file=sys.stderr)
    return pairs


def _check_filler(pairs, args, tokenizer):
    """Refuses --corpus filler that is mostly the tokenizer's unknown token (unless --allow-unk) and says the rate."""
    if not args.corpus:
        return
    rate = pairs.report.get("filler_unknown_rate", 0.0)
    unk = getattr(tokenizer, "unk_token", None) or "the unknown token"
    line = (f"--corpus {args.corpus}: {rate:.1%} of the filler tokens ({pairs.report.get('filler_unknown_tokens')}/"
            f"{pairs.report.get('filler_tokens')}) are {unk}")
    if rate > MAX_FILLER_UNKNOWN_RATE and not args.allow_unk:
        raise UsageError(f"{line}, above the {MAX_FILLER_UNKNOWN_RATE:.0%} limit: the tokenizer does not cover this "
                         "text; use a corpus in the tokenizer's vocabulary or a model with a subword tokenizer, or "
                         "pass --allow-unk to run on it anyway")
    warn = rate > MAX_FILLER_UNKNOWN_RATE
    print(("WARNING: " if warn else "") + line + (" (--allow-unk given)" if warn else ""), file=sys.stderr)


def _filler_record(pairs, args, model) -> dict:
    """What the filler was (and how many query heads read each state of `model`), for the manifest's `extra` and the
    report, which reads these recorded facts and never the checkpoint path a manifest names."""
    origin = (f"local corpus {args.corpus}" if args.corpus else
              f"generated filler (recurscope's grammar, seed {args.seed})")
    report = pairs.report
    return {"filler_source": origin, "pair_layout": getattr(args, "pair_layout", None),
            "dropped_keys": report.get("dropped_keys", {}), "dropped_values": report.get("dropped_values", {}),
            "key_list": report.get("key_list"), "value_list": report.get("value_list"),
            "filler_unknown_rate": pairs.report.get("filler_unknown_rate", 0.0),
            "filler_unknown_tokens": pairs.report.get("filler_unknown_tokens", 0),
            "filler_tokens": pairs.report.get("filler_tokens", 0), "allow_unk": bool(args.allow_unk),
            "filler_unknown_limit": MAX_FILLER_UNKNOWN_RATE,
            "pairs_per_source": args.pairs_per_source, "device": args.device, "batch_size": args.batch_size,
            "query_group": int(getattr(model, "query_group", 1))}


# Intervals over fewer sources than this are flagged in the output and the report.
MIN_INTERVAL_SOURCES = 8


def _gate_args(p):
    p.add_argument("--gate-threshold", type=float, default=GATE_THRESHOLD,
                   help="clean recall (recipient and donor, on the same pairs) below which the model is said not "
                        f"to do the task and nothing is scanned or confirmed (default {100 * GATE_THRESHOLD:.0f}%%, App. F.2;"
                        " 0 turns the gate off, for plumbing checks on random weights)")


def _capability(model, pairs, args, run) -> dict:
    """Clean recall of recipient and donor on `pairs`, against --gate-threshold (the library's one gate,
    interp.capability.check_capability); written to gate.json in `run`. --gate-threshold 0 turns the gate off
    (plumbing checks on random weights); the record and the report say so, and the report's verdicts read
    "not gated"."""
    from recurscope.interp.capability import check_capability, gate_record

    gate = check_capability(model, pairs, args.gate_threshold, condition=f"{args.sources} pairs",
                            batch_size=args.batch_size, seed=args.seed)
    n_sources = None if gate.off else int(pairs.source_id.unique().numel())
    record = gate_record(gate, n_sources, args.sources)
    from recurscope.interp.results import write_output

    write_output(Path(run.path) / "gate.json", json.dumps(record, indent=1) + "\n")
    if gate.off:
        print("WARNING: --gate-threshold 0: the capability gate is off; nothing here shows the model does the task",
              file=sys.stderr)
        return record
    line = (f"clean recall on these {args.sources} pairs: recipient {100 * gate.recipient.estimate:.1f}% "
            f"[{100 * gate.recipient.low:.1f}, {100 * gate.recipient.high:.1f}], donor "
            f"{100 * gate.donor.estimate:.1f}% (n = {n_sources} sources; gate {100 * gate.threshold:.0f}%)")
    if not gate.passed:
        print(f"THE MODEL DOES NOT DO THE TASK: {line}. No head is named and no control is read; see "
              "README 'Your own checkpoint' (layout, filler, words).")
    else:
        print(line)
    if n_sources < MIN_INTERVAL_SOURCES:
        print(f"WARNING: only {n_sources} sources back each interval (fewer than {MIN_INTERVAL_SOURCES}); "
              "intervals over so few sources are unreliable: raise --n-sources", file=sys.stderr)
    return record


def read_gate(run_dir):
    path = Path(run_dir) / "gate.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _ray_args(p, scan=True):
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the work units on Ray: alone, a local Ray instance sized to the machine; 'auto' or "
                        "HOST:PORT, an existing cluster (docs/distributed.md; pip install 'recurscope[distributed]')")
    p.add_argument("--workers", type=int, default=None,
                   help="with --ray: at most this many workers, each a process holding the model (default: one per "
                        "CPU, or per GPU with --device cuda)")
    if scan:
        p.add_argument("--head-block", type=int, default=None,
                       help="with --ray: heads per scan work unit (default: whole sources when there are at least "
                            "twice as many sources as workers)")
    p.add_argument("--ray-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="with --ray HOST:PORT: give up connecting after this many seconds (default 30)")


def _ray_spec(args):
    from recurscope.interp.distributed import ModelSpec, require_ray

    require_ray()   # before any model loads: say how to install Ray at once
    return ModelSpec(str(args.model), device=args.device, dtype=args.dtype)


def _ray_executor(args):
    """A protocol verb's --ray: its units on Ray workers that each load the model (run_units_ray)."""
    from recurscope.interp.distributed import run_units_ray

    spec = _ray_spec(args)
    return lambda pairs, units, compute, on_rows: run_units_ray(spec, pairs, units, compute, on_rows,
                                                                workers=args.workers, address=args.ray)


def _unit_bar(desc):
    from tqdm.auto import tqdm

    bar = tqdm(desc=desc, unit="unit")

    def progress(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()
    return bar, progress


def _work_args(args, keys):
    out = {k: getattr(args, k) for k in keys}
    if keys is PAIR_KEYS and getattr(args, "lengths", "equal") != "equal":
        # named only when not the default, so directories written before --lengths existed still resume
        out["lengths"] = args.lengths
    if keys is PAIR_KEYS and getattr(args, "tokenizer", None):
        # the prompts are that tokenizer's ids; named only when given, as --lengths
        out["tokenizer"] = str(args.tokenizer)
    return out


PAIR_KEYS = ("sources", "n_sources", "pairs_per_source", "corpus", "layout", "n_facts", "presentations", "filler",
             "gap", "template", "vocab", "keys", "values", "on_multitoken", "seed")


@contextlib.contextmanager
def _progress_bar(**kwargs):
    """A tqdm bar that is closed (its line ended) however the block exits, so an error starts on its own line."""
    from tqdm.auto import tqdm

    bar = tqdm(**kwargs)
    try:
        yield bar
    finally:
        bar.close()


# ---- argument validation: once, for every command, before any model loads or any file is written ------------
_AT_LEAST_ONE = ("batch_size", "n_sources", "pairs_per_source", "n_facts", "presentations", "top_k", "n_dev",
                 "n_heldout")
_AT_LEAST_ZERO = ("filler", "seed", "source", "layer")


def validate_args(args) -> None:
    """Raises UsageError (one line: the problem and the fix) for any option no command can run with."""
    cli_checks.check_options(args)
    cli_checks.check_inputs(args)
    for name in _AT_LEAST_ONE + _AT_LEAST_ZERO:
        low = 1 if name in _AT_LEAST_ONE else 0
        given = getattr(args, name, None)
        for value in given if isinstance(given, list) else [given]:   # a list: several loads (overlap --n-facts)
            if value is not None and value < low:
                raise UsageError(f"--{name.replace('_', '-')} must be at least {low}, got {value}; e.g. "
                                 f"--{name.replace('_', '-')} {max(low, 1) if name != 'seed' else 0}")
    _check_scan_method(args)
    for h in getattr(args, "head", None) or []:
        if h < 0:
            raise UsageError(f"--head must be at least 0, got {h}; heads are numbered from 0")
    threshold = getattr(args, "gate_threshold", None)
    if threshold is not None and not 0 <= threshold <= 1:
        raise UsageError(f"--gate-threshold must be a fraction in [0, 1], got {threshold}; e.g. --gate-threshold 0.8 "
                         "(0 turns the gate off)")
    if getattr(args, "device", None) is not None:
        _check_device(args.device)
    if getattr(args, "corpus", None) and not Path(args.corpus).exists():
        raise UsageError(f"--corpus {args.corpus}: no such file or folder; pass a WikiText .raw file or a folder "
                         "of .txt files")
    if getattr(args, "from_scan", None) is not None:
        scan = Path(args.from_scan)
        if not (scan / "manifest.json").is_file() or not (scan / "scan_heads.csv").is_file():
            raise UsageError(f"--from-scan {scan} is not a finished scan directory (it needs manifest.json and "
                             "scan_heads.csv); run `recurscope scan` first and pass its --out directory")
    if getattr(args, "ray", None):
        from recurscope.interp.distributed import require_ray

        require_ray()   # before --out is created: say how to install Ray at once
    cli_checks.check_size(args)           # before --out is created: an absurd run leaves nothing behind
    if getattr(args, "out", None) is not None:
        cli_checks.check_out_contents(args)   # nothing foreign, no link or FIFO, before anything is written
        _check_out(args.out)


def _check_scan_method(args) -> None:
    method, top = getattr(args, "method", None), getattr(args, "confirm_top", None)
    if top is not None and method != "attribution":
        raise UsageError("--confirm-top picks heads by their attribution estimate; add --method attribution")
    if top is not None and top < 1:
        raise UsageError(f"--confirm-top must be at least 1, got {top}; e.g. --confirm-top 5")
    if method == "attribution" and getattr(args, "ray", None):
        raise UsageError("--method attribution runs in one process (one backward pass per batch of pairs); drop --ray")


def _check_device(spec: str) -> None:
    if spec == "cpu":   # always valid; and an argument error after this check needs no torch
        return
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {spec!r} is not a device name; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise UsageError(f"--device {spec}: {why} (torch.cuda.is_available() is False); use --device cpu, or "
                             "run on a machine with a GPU and a CUDA build of torch")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible; use "
                             f"--device cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {spec}: MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {spec}: recurscope runs on cpu, cuda or mps; use one of those")


def _check_out(out) -> None:
    """--out must be a directory we can create and write in; checked (and created) before any work."""
    path = Path(out).expanduser()
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise UsageError(f"--out {out}: {parent} is a file, not a directory; choose an --out path that is not "
                         "inside a file")
    probe = path / f".recurscope-write-check-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as err:
        raise UsageError(f"--out {out}: cannot write there ({err.strerror or err}); choose a directory you can "
                         "write to, e.g. --out results/run") from None


# ---- commands --------------------------------------------------------------------------------------------------
def cmd_models(args):
    from recurscope.interp.loading import CHECKPOINT_DIR, bundled_names, load_model

    names = bundled_names()
    if not names:
        print("no bundled checkpoints")
        return 0
    print(f"{'name':<18}{'family':<22}{'layers':>7}{'heads':>7}{'state K x V':>13}{'params':>10}  clean recall")
    for name in names:
        m = load_model(name)
        K, V = m.cfg.state_shape()
        params = sum(p.numel() for p in m.parameters())
        summary = CHECKPOINT_DIR / name / "eval_summary.json"
        recall = "–"
        if summary.is_file():
            overall = json.loads(summary.read_text()).get("eval", {}).get("overall", {})
            if "accuracy" in overall:  # written by experiments/train_tiny.py
                recall = (f"{100 * overall['accuracy']:.1f}% [{100 * overall['ci_low']:.1f}, "
                          f"{100 * overall['ci_high']:.1f}] (n={overall['n_sources']} held-out sources)")
        family = m.family.describe(m.cfg) + ("+attn" if m.attention_layers else "")
        print(f"{name:<18}{family:<22}{m.cfg.num_hidden_layers:>7}{m.n_state_heads:>7}{f'{K} x {V}':>13}"
              f"{params / 1e6:>9.2f}M  {recall}")
    return 0


def cmd_scan(args):
    from recurscope.interp.results import RunDir
    from recurscope.interp.scan import run_scan

    spec = _ray_spec(args) if getattr(args, "ray", None) else None
    model = _load(args)
    pairs = _pairs(model, args)
    method = getattr(args, "method", "exact")   # `run` calls this with its own arguments, which have no --method
    # An exact scan's manifest is as before (its directories resume); an attribution scan's names its method.
    how = {} if method == "exact" else {"method": method, "confirm_top": args.confirm_top}
    run = RunDir.create_or_open(args.out, kind="scan", model_name=args.model, checkpoint_path=model.checkpoint_dir,
                                args={**_work_args(args, PAIR_KEYS), **how}, seeds=[args.seed],
                                sources=sorted(set(pairs.source_id.tolist())), split=args.sources,
                                extra=_filler_record(pairs, args, model))
    if not _capability(model, pairs, args, run)["passed"]:
        return 0
    if spec is not None:
        from recurscope.interp.distributed import run_scan_ray
        from recurscope.interp.scan import all_heads

        bar, progress = _unit_bar("scan: (source, head block) units")
        try:
            result, _ = run_scan_ray(spec, pairs, all_heads(model), run_dir=run, batch_size=args.batch_size,
                                     head_block=args.head_block, workers=args.workers, address=args.ray,
                                     progress=progress)
        finally:
            bar.close()
    elif method == "attribution":
        from recurscope.interp.scan_attribution import run_attribution_scan

        with _progress_bar(desc="scan by attribution: pairs", unit="pair") as bar:
            def progress(done, total):
                bar.total = total
                bar.n = done
                bar.refresh()
            result = run_attribution_scan(model, pairs, run_dir=run, batch_size=args.batch_size,
                                          confirm_top=args.confirm_top, progress=progress)
    else:
        with _progress_bar(desc="scan: (pair, head) rows", unit="row") as bar:
            def progress(done, total):
                bar.total = total
                bar.n = done
                bar.refresh()
            result = run_scan(model, pairs, run_dir=run, batch_size=args.batch_size, progress=progress)
    from recurscope.interp.plots import plot_head_scan

    exact_top = method == "attribution" and args.confirm_top is not None
    plot_head_scan(result.scores, run.figure_path("scan_heatmap"), selected=result.winner,
                   title=f"{args.model}: state-swap donor-margin shift per head"
                   + (" (first-order estimate)" if method == "attribution" and args.confirm_top is None else "")
                   + (f" (the top {args.confirm_top} by first-order estimate, scanned exactly; hatched: not scanned)"
                      if exact_top else ""),
                   masked_layers={layer: "attention" for layer in model.attention_layers}, partial=exact_top)
    best = result.heads.iloc[0]
    verdict = winner_verdict(result, run.path)
    name = (f"winner L{result.winner[0]}H{result.winner[1]}" if verdict["winner"] else
            f"NO HEAD: the top head L{result.winner[0]}H{result.winner[1]}'s J interval "
            f"[{verdict['low']:+.3f}, {verdict['high']:+.3f}] includes zero")
    print(f"scan of {len(result.heads)} heads on {pairs.source_id.unique().numel()} {args.sources} sources: "
          f"{name} (J = {best['J']:+.3f}, won {int(best['wins'])}/"
          f"{int(best['n_sources'])} sources" + (f", leave-one-source-out {'stable' if result.loso.stable else 'unstable'}"
                                                 if result.loso is not None else "") + f"); results in {run.path}")
    return 0


def winner_verdict(result, run_path=None) -> dict:
    """The top head's J with its source-bootstrap interval; a winner only when the interval excludes zero (it is
    "no head" otherwise). Written to winner.json in `run_path`."""
    from recurscope.interp import stats

    layer, head = result.winner
    scores = result.scores[(result.scores["layer"] == layer) & (result.scores["head"] == head)]
    ci = stats.source_bootstrap_ci(scores["score"].to_numpy(), scores["source"].to_numpy())
    J = result.heads["J"].to_numpy()
    tied = len(J) > 1 and J[0] == J[1]            # a tie at the top names no head (stats.top_is_tied)
    verdict = {"layer": layer, "head": head, "J": ci.estimate, "low": ci.low, "high": ci.high,
               "n_sources": int(scores["source"].nunique()), "winner": bool(ci.low > 0) and not tied}
    if run_path is not None:
        from recurscope.interp.results import write_output

        write_output(Path(run_path) / "winner.json", json.dumps(verdict, indent=1) + "\n")
    return verdict


def cmd_confirm(args):
    import pandas as pd

    from recurscope.interp.confirm import ARMS, heads_from_scan, run_confirm
    from recurscope.interp.plots import plot_intervention_effects
    from recurscope.interp.results import RunDir

    spec = _ray_spec(args) if getattr(args, "ray", None) else None
    on_selection = args.sources == "dev"
    if on_selection:
        print(SELECTION_WARNING, file=sys.stderr)
    model = _load(args)
    heads = heads_from_scan(args.from_scan, model, top_k=args.top_k)
    scan_heads = pd.read_csv(Path(args.from_scan) / "scan_heads.csv")
    pairs = _pairs(model, args)
    extra = {**_filler_record(pairs, args, model), "confirmation_on_selection_sources": on_selection}
    run = RunDir.create_or_open(args.out, kind="confirm", model_name=args.model, checkpoint_path=model.checkpoint_dir,
                                args={**_work_args(args, PAIR_KEYS), "heads": heads, "from_scan": str(args.from_scan)},
                                seeds=[args.seed], sources=sorted(set(pairs.source_id.tolist())), split=args.sources,
                                extra=extra)
    if not _capability(model, pairs, args, run)["passed"]:
        return None
    if spec is not None:
        from recurscope.interp.distributed import run_confirm_ray
        from recurscope.interp.interventions import choose_control_heads, normalise_heads

        heads = normalise_heads(model, heads)
        bar, progress = _unit_bar("confirm: (source, arm) units")
        try:
            result, _ = run_confirm_ray(spec, pairs, heads, choose_control_heads(model, heads, scan=scan_heads),
                                        run_dir=run, scan_heads=scan_heads, seed=args.seed,
                                        batch_size=args.batch_size, workers=args.workers, address=args.ray,
                                        progress=progress)
        finally:
            bar.close()
    else:
        with _progress_bar(total=len(ARMS), desc="confirm: interventions", unit="arm") as bar:
            result = run_confirm(model, pairs, heads, run_dir=run, scan_heads=scan_heads, seed=args.seed,
                                 batch_size=args.batch_size,
                                 progress=lambda arm: (bar.set_postfix_str(arm), bar.update(1)))
    summary = result.summary.assign(model=args.model)
    plot_intervention_effects(summary, run.figure_path("effects"),
                              title=f"{args.model}: {', '.join(f'L{l}H{h}' for l, h in heads)} on held-out sources")
    _print_summary(result.summary)
    print(f"results in {run.path}")
    if on_selection:
        print(SELECTION_WARNING, file=sys.stderr)  # again, below the table, where it is read
    return result


SELECTION_WARNING = ("WARNING: confirm --sources dev runs on the dev sources the scan chose its heads on: this is "
                     "NOT a confirmation (selection and test on the same data); use --sources heldout (the default). "
                     "The manifest records it (extra.confirmation_on_selection_sources).")


def _print_summary(summary):
    from recurscope.interp.report import LABELS

    print(f"{'intervention':<36}{'donor-margin shift':>28}{'donor answer':>16}")
    for arm, label in LABELS.items():
        sub = summary[summary["intervention"] == arm].set_index("metric")
        if sub.empty:
            continue
        m, d = sub.loc["donor_margin_shift"], sub.loc["donor_answer"]
        print(f"{label:<36}{m['estimate']:>+10.2f} [{m['low']:+.2f}, {m['high']:+.2f}]{100 * d['estimate']:>14.1f}%")


def cmd_patch(args):
    from recurscope.interp import interventions as iv
    from recurscope.interp.metrics import example_metrics

    model = _load(args)
    args.n_sources = args.source + 1
    pairs = _pairs(model, args)
    row = [i for i in range(len(pairs)) if int(pairs.source_id[i]) == args.source][:1]
    pairs = pairs.select(row).trimmed()   # one row at its own length (--lengths natural: no padding read)
    heads = [(args.layer, h) for h in args.head]
    print(f"pair from {args.sources} source {args.source}: recipient answer "
          f"{pairs.candidates[0][int(pairs.recipient_answer_index[0])]!r}, donor answer "
          f"{pairs.candidates[0][int(pairs.donor_answer_index[0])]!r}; heads {heads}")
    print(f"{'intervention':<18}{'margin':>9}{'shift':>9}  candidate logits {pairs.candidates[0]}")
    rows = []
    for entry in iv.REGISTRY:
        if entry.name not in iv.INTERVENTIONS:   # the five interventions; no controls or variants here
            continue
        arm = entry.name
        res = entry.run(model, pairs, heads, batch_size=1)
        m = example_metrics(pairs, res, intervention=arm).iloc[0]
        rows.append({**m.to_dict(), "intervention": arm, "layer": args.layer, "heads": " ".join(map(str, args.head)),
                     **{f"logit_{c}": float(v) for c, v in zip(pairs.candidates[0], res.logits[0].tolist())}})
        print(f"{arm:<18}{m['margin']:>+9.2f}{m['donor_margin_shift']:>+9.2f}  {[round(v, 2) for v in res.logits[0].tolist()]}")
    if args.out is not None:
        import pandas as pd

        from recurscope.interp.results import RunDir

        run = RunDir.create_or_open(args.out, kind="patch", model_name=args.model,
                                    checkpoint_path=model.checkpoint_dir,
                                    args={**_work_args(args, PAIR_KEYS), "layer": args.layer, "heads": args.head,
                                          "source": args.source}, seeds=[args.seed],
                                    sources=[args.source], split=args.sources, extra=_filler_record(pairs, args, model))
        written = run.write_table("patch_rows", pd.DataFrame(rows))
        print(f"table: {written['csv']}")
    return 0


def cmd_run(args):
    """The main job: scan on dev sources, confirm on held-out sources, write report.md with figures."""
    from recurscope.interp.confirm import heads_from_scan
    from recurscope.interp.report import write_report
    from recurscope.interp.scan import summarise_scan

    out = Path(args.out)
    scan_dir, confirm_dir = out / "scan", out / "confirm"
    scan_args = argparse.Namespace(**{**vars(args), "sources": "dev", "n_sources": args.n_dev, "out": scan_dir})
    cmd_scan(scan_args)
    scan_gate = read_gate(scan_dir)
    if not scan_gate["passed"]:
        path = write_report(out, model_name=args.model, scan_dir=scan_dir, confirm_dir=None, heads=[],
                            control_heads=[], scan_heads=None, loso=None, summary=None, figures={}, gate=scan_gate)
        print(f"report: {path}")
        return 0
    from recurscope.interp.results import RunDir

    scan = summarise_scan(RunDir.open(scan_dir).table("scan_rows").read())
    verdict = winner_verdict(scan)
    conf_args = argparse.Namespace(**{**vars(args), "sources": "heldout", "n_sources": args.n_heldout,
                                      "out": confirm_dir, "from_scan": scan_dir, "top_k": 1})
    result = cmd_confirm(conf_args)
    from recurscope.interp.results import write_output

    figures = {"scan_heatmap": scan_dir / "figures" / "scan_heatmap.png", "effects": confirm_dir / "figures" / "effects.png"}
    for key, src in list(figures.items()):
        if src.is_file():
            dst = write_output(out / src.name, src.read_bytes())
            figures[key] = dst
    path = write_report(out, model_name=args.model, scan_dir=scan_dir, confirm_dir=confirm_dir,
                        heads=[] if result is None else result.heads,
                        control_heads=[] if result is None else result.control_heads, scan_heads=scan.heads,
                        loso=scan.loso, summary=None if result is None else result.summary, figures=figures,
                        gate=read_gate(confirm_dir), winner=verdict)
    print(f"report: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every command and its options."""
    parser = argparse.ArgumentParser(prog="recurscope", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    parser.add_argument("--verbose", action="store_true", help="after an error's line, list its details (e.g. "
                        "every weight that does not match config.json)")
    # --debug and --verbose are accepted after the command too; SUPPRESS keeps the subparser from overwriting the
    # top-level value
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    common.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="after an error's line, list its details (e.g. every mismatched weight)")
    from recurscope.interp.protocols import register_verbs

    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", parents=[common], help="list the bundled checkpoints")
    p.set_defaults(fn=cmd_models)
    p = sub.add_parser("scan", parents=[common], help="head-selection scan (state swap per head) on dev sources")
    _model_args(p)
    _pair_args(p, "dev")
    _ray_args(p, scan=True)
    p.add_argument("--method", default="exact", choices=["exact", "attribution"],
                   help="exact: every head's state swap run (default); attribution: every head's effect estimated "
                        "to first order from one backward pass per batch of pairs (docs/gradients.md)")
    p.add_argument("--confirm-top", type=int, default=None, metavar="K",
                   help="with --method attribution: scan the K heads with the largest estimates exactly")
    _gate_args(p)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_scan)
    p = sub.add_parser("confirm", parents=[common], help="confirmatory patching of the scan's head on held-out sources")
    _model_args(p)
    _pair_args(p, "heldout")
    p.add_argument("--from-scan", required=True, help="a scan result directory")
    p.add_argument("--top-k", type=int, default=1, help="confirm the top-k heads jointly")
    _ray_args(p, scan=False)
    _gate_args(p)
    p.add_argument("--out", required=True)
    p.set_defaults(fn=cmd_confirm)
    p = sub.add_parser("patch", parents=[common], help="run the five interventions on one pair and print the table")
    _model_args(p)
    _pair_args(p, "heldout")
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--head", type=int, nargs="+", required=True)
    p.add_argument("--source", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the table to this result directory (manifest, "
                                               "patch_rows.csv and .parquet); without it the table is only printed")
    p.set_defaults(fn=cmd_patch)
    p = sub.add_parser("run", parents=[common], help="the main job: scan on dev, confirm on held-out, write a report")
    _model_args(p)
    _pair_args(p, "dev", choose_sources=False)
    p.add_argument("--n-dev", type=int, default=N_SOURCES["dev"], help="dev sources for the scan")
    p.add_argument("--n-heldout", type=int, default=N_SOURCES["heldout"], help="held-out sources for the confirmation")
    _ray_args(p, scan=True)
    _gate_args(p)
    p.add_argument("--out", default=None, help="result directory (default results/<model name>)")
    p.set_defaults(fn=cmd_run)
    register_verbs(sub, _model_args, _load, _ray_executor)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run" and args.out is None:
        args.out = str(Path("results") / (Path(str(args.model)).name or "model"))
    return _run_command(args)


# Errors that are the user's input or environment (bad option, file, checkpoint, directory): one line, no traceback.
# Anything else is a bug in recurscope and keeps its traceback.
USER_ERRORS = (ValueError, OSError)


def _run_command(args) -> int:
    try:
        validate_args(args)
        # under the --out directory's lock; Ctrl-C / SIGTERM end in one line (130 / 143), rows kept
        result = cli_checks.run_guarded(args, args.fn)
    except USER_ERRORS as err:
        if args.debug:
            raise
        lines = (str(err) or type(err).__name__).splitlines()
        print(f"error: {lines[0]}", file=sys.stderr)
        for line in lines[1:]:
            print(line, file=sys.stderr)
        if getattr(args, "verbose", False):   # details kept off the error line (e.g. every mismatched weight)
            for line in getattr(err, "details", ()):
                print(line, file=sys.stderr)
        return 2
    return 0 if not isinstance(result, int) else result


if __name__ == "__main__":
    sys.exit(main())
