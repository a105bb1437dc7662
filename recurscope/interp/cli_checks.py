"""The command line's guards (issue 32), kept apart from cli.py: every option range-checked and every input
directory checked before any work; the run sized up front (tokens, memory, forward passes) and refused when absurd;
one writer per --out directory; Ctrl-C and SIGTERM ending in one line with every committed row kept.

Each check raises UsageError-like ValueErrors whose message is one line: the problem and the fix."""
from __future__ import annotations

import codecs
import math
import os
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

# ---- option ranges ---------------------------------------------------------------------------------------------
# (lowest value, example) per option, checked on whichever command has it. Lists must be non-empty.
AT_LEAST = {
    "batch_size": 1, "n_sources": 1, "pairs_per_source": 1, "n_facts": 1, "presentations": 1, "top_k": 1,
    "n_dev": 1, "n_heldout": 1, "n_fit": 1, "k": 1, "rank": 1, "workers": 1, "head_block": 1, "total_length": 1,
    "filler": 0, "seed": 0, "source": 0, "layer": 0, "gap": 0, "n_nontarget": 0,
    "resamples": 100,   # stats' bootstrap refuses fewer (after the whole computation, before this check)
}
LIST_AT_LEAST = {"loads": 1, "gaps": 0, "fillers": 0}   # --head: cli.validate_args
# (highest value, why) per option: beyond it a value is silently wrapped or clamped downstream
AT_MOST = {"seed": (2 ** 63 - 1, "seeds are 64-bit integers (torch and numpy generators)")}
# Bootstrap resamples beyond this, unless --yes: the paper uses 9999; 1e12 ran out of memory after half a minute.
MAX_RESAMPLES = 10 ** 7
FRACTIONS = ("threshold", "gate", "gate_threshold", "capability_threshold")
WHY = {"resamples": " (bootstrap intervals need at least 100; default 9999)",
       "head": " (heads and layers are numbered from 0)"}


class CheckError(ValueError):
    """Bad command-line input found by these checks: one line naming the problem and the fix."""


def _flag(name: str) -> str:
    if name == "capability_threshold":       # the protocol verbs' --gate-threshold (its dest avoids their --gate)
        return "--gate-threshold"
    return "--" + name.replace("_", "-")


def check_options(args) -> None:
    """Every number and list option in range, --out a non-empty path; raises CheckError before any work."""
    for name, low in AT_LEAST.items():
        value = getattr(args, name, None)
        if isinstance(value, (list, tuple)):   # a verb may take several (overlap --n-facts 4 8 16)
            value = min(value) if value else None
        if value is not None and value < low:
            raise CheckError(f"{_flag(name)} must be at least {low}, got {value}{WHY.get(name, '')}; e.g. "
                             f"{_flag(name)} {max(low, 1) if name != 'seed' else 0}")
    for name, (high, why) in AT_MOST.items():
        value = getattr(args, name, None)
        if value is not None and value > high:
            raise CheckError(f"{_flag(name)} must be at most {high:,} ({why}), got {value:,}; e.g. {_flag(name)} 0")
    nontarget, loads = getattr(args, "n_nontarget", None), getattr(args, "loads", None)
    if nontarget is not None and loads and nontarget > max(loads) - 1 >= 0:
        raise CheckError(f"--n-nontarget {nontarget:,} is more than the K - 1 = {max(loads) - 1} other facts a pair "
                         f"of the largest load (K = {max(loads)}) has; use --n-nontarget {max(loads) - 1} or fewer")
    for name, low in LIST_AT_LEAST.items():
        values = getattr(args, name, None)
        if values is None:
            continue
        if len(values) == 0:
            raise CheckError(f"{_flag(name)} was given no values; give at least one, e.g. {_flag(name)} {max(low, 1)}")
        bad = [v for v in values if v < low]
        if bad:
            raise CheckError(f"{_flag(name)} values must be at least {low}, got {bad[0]}{WHY.get(name, '')}; e.g. "
                             f"{_flag(name)} {max(low, 1)}")
    for name in ("formats", "loads", "gaps", "fillers"):
        values = getattr(args, name, None)
        if isinstance(values, (list, tuple)) and len(set(map(str, values))) < len(values):
            twice = next(v for i, v in enumerate(values) if v in values[:i])
            raise CheckError(f"{_flag(name)} lists {twice} more than once; give each value once, e.g. {_flag(name)} "
                             + " ".join(dict.fromkeys(map(str, values))))
    for name in FRACTIONS:
        value = getattr(args, name, None)
        if value is not None and not 0.0 <= value <= 1.0:
            raise CheckError(f"{_flag(name)} is a recall threshold between 0 and 1, got {value}; e.g. "
                             f"{_flag(name)} 0.5")
    out = getattr(args, "out", None)
    if out is not None and not str(out).strip():
        raise CheckError("--out is empty: it would write into the current directory; give a directory, e.g. "
                         "--out results/run")
    timeout = getattr(args, "ray_timeout", None)
    if timeout is not None and not timeout > 0:
        raise CheckError(f"--ray-timeout must be a positive number of seconds, got {timeout}; e.g. --ray-timeout 30")
    for name in ("max_memory",):
        if getattr(args, name, None) is not None:
            parse_bytes(getattr(args, name))
    if getattr(args, "lengths", "equal") == "natural":
        # ragged rows run packed on the in-process exact scan and the confirmation only
        if getattr(args, "method", "exact") != "exact":
            raise CheckError("--lengths natural runs the exact scan's rows packed; the attribution scan does not pack them: "
                             "use --method exact, or --lengths equal")
        if getattr(args, "ray", None):
            raise CheckError("--lengths natural is not wired through --ray (its workers do not pack ragged rows); drop "
                             "--ray, or use --lengths equal")


# ---- input directories and files -------------------------------------------------------------------------------
def check_inputs(args) -> None:
    """--from-scan is a finished scan (manifest kind, hash, scan_heads.csv columns); --ray HOST:PORT answers;
    --corpus is UTF-8 text."""
    if getattr(args, "from_scan", None) is not None:
        scan = Path(args.from_scan)
        if not (scan / "manifest.json").is_file():   # said without importing pandas (tests/test_startup.py)
            why = "it does not exist" if not scan.is_dir() else "it has no manifest.json"
            raise CheckError(f"--from-scan {scan} is not a finished scan directory ({why}); run `recurscope scan` "
                             "first and pass its --out directory")
        from recurscope.interp.results import check_input_run

        check_input_run(scan, option="--from-scan", kinds=("scan",), tables={"scan_heads": ("layer", "head", "J")})
    address = getattr(args, "ray", None)
    if address not in (None, "local", "auto"):
        from recurscope.interp.distributed import probe_address

        probe_address(address, getattr(args, "ray_timeout", None) or 30.0)   # before any model loads
    corpus = getattr(args, "corpus", None)
    if corpus and Path(corpus).exists():
        path = Path(corpus)
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):    # a FIFO would block the filler reader for ever
            from recurscope.interp.checkpoint_files import file_kind

            raise CheckError(f"--corpus {path} is {file_kind(mode)}, not a text file or folder; pass a WikiText .raw "
                             "file or a folder of .txt files")
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                      and p.suffix in (".txt", ".raw", ""))
        odd = [] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".raw", "")
                                               and not (p.is_file() or p.is_dir()))
        if odd:
            from recurscope.interp.checkpoint_files import file_kind

            raise CheckError(f"--corpus: {odd[0]} is {file_kind(os.lstat(odd[0]).st_mode)}, not a text file; remove "
                             "it from the corpus folder")
        for f in files:
            _check_utf8(f)
    for name in ("keys", "values"):      # a word-list file: UTF-8 text, one word a line
        spec = getattr(args, name, None)
        if isinstance(spec, str) and os.path.lexists(spec):
            from recurscope.interp.checkpoint_files import file_kind

            mode = os.stat(spec).st_mode if os.path.exists(spec) else 0
            if stat.S_ISDIR(mode) or not stat.S_ISREG(mode):
                raise CheckError(f"{_flag(name)} {spec} is {file_kind(mode)}, not a word-list file; pass a text "
                                 f"file with one word a line, or a comma list ({_flag(name)} red,blue,green)")
            _check_utf8(Path(spec), option=_flag(name), fix="save it as UTF-8 text with one word a line")


def _check_utf8(path: Path, chunk: int = 1 << 20, option: str = "--corpus",
                fix: str = "convert it, e.g. `iconv -f latin1 -t utf-8`, or leave it out of the corpus folder") -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise CheckError(f"{option}: {path} is not UTF-8 text (undecodable byte at offset "
                                 f"{offset + err.start}); {fix}") from None
            if not block:
                return
            offset += len(block)


# ---- --out: empty, or a result directory of the same kind -------------------------------------------------------
def check_out_contents(args) -> None:
    """--out holds nothing recurscope did not create (results.check_out_dir): no foreign file is overwritten and no
    link, FIFO or device in it is written through; before any work or any file is written."""
    out = getattr(args, "out", None)
    if out is None:
        return
    from recurscope.interp.results import check_out_dir

    check_out_dir(Path(out).expanduser(), getattr(args, "command", None) or "run")


def nested_dirs(args) -> tuple:
    """The result directories a command writes inside its --out, locked with it: a `run`'s scan/ and confirm/."""
    if getattr(args, "command", None) == "run":
        from recurscope.interp.results import RUN_NESTED

        return tuple(RUN_NESTED)
    return ()


# ---- the run sized up front -----------------------------------------------------------------------------------
# A fact presentation and the query are a few tokens each (measured with the bundled word tokenizer: a 4-fact,
# 3-presentation, 512-filler, 24-gap pair is 867 tokens, the estimate 880); the estimate is an upper bound there.
FACT_TOKENS = 6
QUERY_TOKENS = 8
# Sanity limits a run must stay under unless --yes is given: far beyond the paper's runs (128 sources x 4 pairs x
# ~1k tokens = 1M tokens), so only a mistyped size meets them.
MAX_SEQUENCE_TOKENS = 1 << 20        # tokens in one sequence
MAX_TOTAL_TOKENS = 1 << 30           # tokens over all pairs (donor and recipient)
MAX_SOURCES = 1 << 20
GiB = 1 << 30


@dataclass
class RunSize:
    sources: int
    pairs: int
    sequence_tokens: int
    total_tokens: int
    peak_bytes: int
    forward_passes: int

    def describe(self) -> str:
        return (f"{self.sources:,} sources x {self.pairs // max(self.sources, 1):,} pairs x "
                f"{self.sequence_tokens:,} tokens = {self.total_tokens:,} tokens, about "
                f"{self.peak_bytes / GiB:,.1f} GiB peak memory and {self.forward_passes:,} forward passes")


def parse_bytes(text) -> int:
    """'64G', '512M', '1.5T' or a plain number of bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = s[-1] if s and s[-1] in units else ""
    try:
        value = float(s[:-1] if unit else s)
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise CheckError(f"--max-memory must be a size such as 64G or 512M, got {text!r}")
    return int(value * units[unit])


def machine_memory(device: str = "cpu") -> int:
    """Bytes the run may use: the GPU's memory for a CUDA device, else the host's physical memory."""
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _checkpoint_dir(model) -> Path:
    directory = Path(str(model)).expanduser()
    if not directory.is_dir():                     # a bundled name (as loading.resolve_checkpoint, without torch)
        directory = Path(__file__).parent / "checkpoints" / str(model)
    return directory


def _checkpoint_shape(model) -> dict:
    """hidden size, layers, heads and weight bytes read from config.json and file sizes (no model is built)."""
    import json

    directory = _checkpoint_dir(model)
    from recurscope.interp.checkpoint_files import CheckpointError, read_regular

    try:   # a FIFO or device config.json is refused at once, not read (it would block, or fill the memory)
        raw = json.loads(read_regular(directory / "config.json", "the checkpoint's model configuration"))
    except CheckpointError:
        raise
    except (ValueError, OSError):
        return {}          # the loader reports an unusable checkpoint with its own message
    if not isinstance(raw, dict):
        return {}
    raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw

    def num(key, default):
        v = raw.get(key, default)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default
    weights = sum(p.stat().st_size for p in directory.iterdir() if p.suffix in (".safetensors", ".bin"))
    return {"hidden": num("hidden_size", 1024), "layers": num("num_hidden_layers", 24),
            "heads": num("num_heads", num("linear_num_value_heads", 16)), "vocab": num("vocab_size", 50000),
            "weights": weights}


def size_run(args) -> Optional[RunSize]:
    """What the command will build, from its options and the checkpoint's config.json: sources, pairs, tokens,
    peak memory and forward passes (an estimate, before anything is built); None for commands that build no pairs."""
    if not hasattr(args, "model") or getattr(args, "fn", None) is None:
        return None
    sources = sum(getattr(args, n, None) or 0 for n in ("n_sources", "n_dev", "n_heldout", "n_fit"))
    if getattr(args, "source", None) is not None:          # patch builds every source up to --source
        sources = max(sources, args.source + 1)
    if sources == 0:
        return None
    pairs = sources * (getattr(args, "pairs_per_source", None) or 1)
    layout = None
    if hasattr(args, "layout"):   # the named layout, else the checkpoint's pair_layout.json (through this check too)
        from recurscope.interp.data.layout import choose_layout

        layout = choose_layout(args.layout, _checkpoint_dir(args.model))
    n_facts = getattr(args, "n_facts", None) or (layout.n_facts if layout else 4)
    n_facts = list(n_facts) if isinstance(n_facts, (list, tuple)) else [n_facts]   # overlap takes several loads
    facts = max([*n_facts, getattr(args, "k", None) or 0, *(getattr(args, "loads", None) or [])])
    presentations = getattr(args, "presentations", None) or (layout.presentations if layout else 3)
    gap = getattr(args, "gap", None) or (layout.gap_tokens if layout else 24)
    filler = getattr(args, "filler", None)
    if filler is None and layout is not None:
        filler = layout.filler_tokens
    filler = max([filler or 0, getattr(args, "total_length", None) or 0,
                  *(getattr(args, "gaps", None) or []), *(getattr(args, "fillers", None) or [])])
    length = facts * presentations * (FACT_TOKENS + gap) + filler + QUERY_TOKENS
    total = 2 * pairs * length
    shape = _checkpoint_shape(args.model)
    hidden, layers, heads = shape.get("hidden", 1024), shape.get("layers", 24), shape.get("heads", 16)
    batch = min(getattr(args, "batch_size", None) or 16, pairs)
    # token ids and masks of every pair (int64, a few tensors per sequence), the weights, one layer's activations
    # for a batch (float32, ~16 hidden-sized tensors per token; no autograd), the batch's recurrent states in every
    # layer (H x K x V ~ hidden^2 / heads each) and its logits at the query positions.
    peak = (total * 8 * 4 + shape.get("weights", 0) + batch * length * hidden * 4 * 16
            + batch * layers * hidden * hidden * 4 // max(heads, 1) + batch * shape.get("vocab", 50000) * 4 * 8)
    forward = pairs * max(1, layers * heads if getattr(args, "command", "") == "scan" else 16)
    return RunSize(sources, pairs, length, total, int(peak), int(forward))


def check_size(args) -> Optional[RunSize]:
    """Refuses a run beyond the machine's memory (--max-memory sets the bound) or, unless --yes, one beyond the
    sanity limits; with the numbers and what to lower."""
    size = size_run(args)
    if size is None:
        return None
    lower = "lower --n-sources, --pairs-per-source, --filler or --presentations"
    if not getattr(args, "yes", False):
        for what, value, limit in (("sources", size.sources, MAX_SOURCES),
                                   ("tokens per sequence", size.sequence_tokens, MAX_SEQUENCE_TOKENS),
                                   ("tokens in all", size.total_tokens, MAX_TOTAL_TOKENS)):
            if value > limit:
                raise CheckError(f"this run would build {size.describe()}: {value:,} {what} exceeds the sanity "
                                 f"limit of {limit:,}; {lower}, or pass --yes if you mean it")
    resamples = getattr(args, "resamples", None)
    if resamples is not None and resamples > MAX_RESAMPLES and not getattr(args, "yes", False):
        draws = resamples * max(size.sources, 1)
        raise CheckError(f"--resamples {resamples:,} would draw {draws:,} source indices per interval (about "
                         f"{draws * 8 / GiB:,.1f} GiB each), beyond the sanity limit of {MAX_RESAMPLES:,} resamples; "
                         "the paper uses 9999 (the default): lower --resamples, or pass --yes if you mean it")
    bound = parse_bytes(args.max_memory) if getattr(args, "max_memory", None) else machine_memory(
        getattr(args, "device", "cpu") or "cpu")
    if size.peak_bytes > bound:
        raise CheckError(f"this run would build {size.describe()}, more than the {bound / GiB:,.1f} GiB "
                         f"{'set by --max-memory' if getattr(args, 'max_memory', None) else 'this machine has'}; "
                         f"{lower}, or raise --max-memory")
    return size


def add_limit_args(p) -> None:
    """--max-memory and --yes, on every command that builds pairs."""
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="refuse a run whose estimated peak memory exceeds SIZE (e.g. 64G; default: the machine's "
                        "memory, or the GPU's with --device cuda)")
    p.add_argument("--yes", action="store_true",
                   help="run even when a size exceeds the sanity limits (docs/reliability.md)")


# ---- after the model loads, before any work -------------------------------------------------------------------
def check_loaded(model, args) -> None:
    """Options that need the model or its tokenizer: heads in range, a fixed length the facts fit in."""
    layer = getattr(args, "layer", None)
    if layer is not None:
        for h in getattr(args, "head", None) or []:
            model.check_head(layer, h)
    elif isinstance(getattr(args, "head", None), list) and len(args.head) == 2:
        model.check_head(*args.head)
    heads = len(model.heads())
    top = getattr(args, "confirm_top", None)
    if top is not None and top > heads:
        raise CheckError(f"--confirm-top {top:,} is more than this model's {heads} heads; use --confirm-top {heads} or "
                         "fewer (all of them is the exact scan: --method exact)")
    rank = getattr(args, "rank", None)
    if rank is not None:
        d_model = int(model.cfg.d_model)
        if rank > d_model:
            raise CheckError(f"--rank {rank:,} is more than d_model = {d_model}, the largest rank a map into the "
                             f"residual stream can have (a rank-{rank:,} random control would hold about "
                             f"{rank * d_model * 8 / GiB:,.1f} GiB); use --rank {min(4, d_model)} (the paper's) up to "
                             f"{d_model}")
    total = getattr(args, "total_length", None)
    if total is not None and getattr(args, "loads", None) and model.tokenizer is not None:
        from recurscope.interp.protocols.capacity import _bare_length, load_layout
        from recurscope.interp.protocols.runner import pair_spec_from_args

        k = min(args.loads)
        need = _bare_length(model.tokenizer, load_layout(k, pair_spec_from_args(args, model)))
        if total < need:
            raise CheckError(f"--total-length {total} is shorter than the smallest load's facts alone (K={k} "
                             f"needs {need} tokens), so no point could be evaluated; use --total-length {need} or more")


def check_packing(model) -> None:
    """--lengths natural runs rows of different lengths packed (cu_seqlens): a two-token packed prefix asks the model's
    own forward, which refuses families whose packing would mix sequences (RWKV-7's decay-plus-low-rank kernel, a
    token shift, a sliding-window attention layer). Raised as one line, before any pair is built."""
    import torch

    from recurscope.interp.models.protocol import pack_rows

    device = next(model.parameters()).device
    tokens, cu = pack_rows([torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)])
    try:
        with torch.no_grad():
            model.run_prefix(tokens.to(device), cu_seqlens=cu)
    except ValueError as err:
        reason = str(err).splitlines()[0].split("; ")[0]
        raise CheckError(f"--lengths natural: this model cannot run rows packed ({reason}); use --lengths equal") \
            from err


# ---- one writer per run directory; clean interrupts ----------------------------------------------------------
class Interrupted(BaseException):
    """SIGTERM, raised in the main thread like KeyboardInterrupt so that every finally block runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _committed_rows(out) -> int:
    from recurscope.interp.results import RowLog

    if out is None or not Path(out).is_dir():
        return 0
    total = 0
    for f in Path(out).rglob("*.jsonl"):
        try:
            total += len(RowLog(f))
        except ValueError:
            pass
    return total


def run_guarded(args, fn: Callable) -> int:
    """Runs fn(args) holding the --out directory's lock, with SIGTERM turned into an exception; an interrupt prints
    one line and returns 130 (Ctrl-C) or 143 (SIGTERM); --debug re-raises it with its traceback."""
    from recurscope.interp.results import RunLock

    out = getattr(args, "out", None)
    lock = RunLock(out, nested=nested_dirs(args)).acquire() if out is not None else None
    previous = None

    def on_term(signum, frame):
        raise Interrupted(signum)
    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:       # not the main thread (an embedding program): leave SIGTERM alone
        previous = None
    ray_before = _ray_running()
    try:
        result = fn(args)
        return 0 if not isinstance(result, int) else result
    except (KeyboardInterrupt, Interrupted) as err:
        if getattr(args, "debug", False):
            raise
        code = 128 + (err.signum if isinstance(err, Interrupted) else signal.SIGINT)
        rows = _committed_rows(out)
        where = f" (kept in {out})" if out is not None else ""
        print(f"interrupted after {rows} rows{where}; rerun the same command to resume", file=sys.stderr)
        return code
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if not ray_before:   # a Ray connection the caller already had is the caller's to close
            _shutdown_ray()
        if lock is not None:
            lock.release()


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def _shutdown_ray() -> None:
    """The driver stops the Ray instance this command started (its actors and agents), however the command ends."""
    if _ray_running():
        sys.modules["ray"].shutdown()
