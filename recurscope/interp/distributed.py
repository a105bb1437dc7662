"""Head scans and confirmations across processes, GPUs and nodes on Ray, with the same resumable results as a
local run (docs/distributed.md).

Work units: (source, head block) for a scan, (source, intervention arm) for a confirmation, and for a protocol verb
under --ray (run_units_ray) the units its module lists, e.g. one source of the hybrid cache factorial. Each worker is a Ray
actor that loads the model once (one GPU per actor on GPU nodes) and runs the library's own run_scan / confirm_arm
on the unit's subset of the pairs. Workers only compute: the driver alone writes every row, through the run
directory's append-only row log (interp.results), one atomic batch per unit. So a run has one writer, a unit is on
disk completely or not at all, and a rerun with the same arguments skips every key already written; the units in
flight when a driver or worker dies are simply computed again. A unit whose worker dies goes back in the queue and
runs on another actor (a replacement actor is started in the dead one's place).

Rows do not depend on where or with what they ran: a unit's rows are those of the whole-batch run restricted to its
keys (the random control is seeded by the row's index in the whole batch, not by worker or unit), equal to float
tolerance (batches of different composition sum in a different order).

Ray is optional: ``pip install 'recurscope[distributed]'``.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import pandas as pd
import torch

__all__ = ["DistributedError", "RayRunStats", "ModelSpec", "Unit", "require_ray", "connect",
           "scan_units", "confirm_units", "run_scan_ray", "run_confirm_ray", "run_units_ray", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'recurscope[distributed]' (or pip install 'ray>=2.9')"
#: units queued on each actor at once: one running, one waiting, so an actor never idles on a driver round trip
UNITS_IN_FLIGHT_PER_ACTOR = 2
#: times one unit may take its actor down with it before the run stops (a unit that kills every actor it touches
#: is a bug or a memory limit, not bad luck)
MAX_UNIT_FAILURES = 2


class DistributedError(ValueError):
    """A distributed run cannot go on; the message names the unit and the setting to change. A ValueError, so the
    command line prints it as one line."""


@dataclass
class RayRunStats:
    """What the driver did: units run (this call) and skipped as already written, units retried after their actor
    died, actors started in all; seconds until the first actors had loaded the model (startup_s), from then until
    the last unit's rows were written (work_s), and in all (wall_s, with Ray's own start and the summary)."""

    units: int = 0
    skipped_units: int = 0
    retried_units: int = 0
    actors_started: int = 0
    startup_s: float = 0.0
    work_s: float = 0.0
    wall_s: float = 0.0


# ----------------------------------------------------------------------------------------------------------------
# Ray itself
# ----------------------------------------------------------------------------------------------------------------


def require_ray():
    """The ray module, or a DistributedError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise DistributedError(f"--ray needs Ray, which is not installed; install it with {INSTALL_HINT}") from None
    return ray


DEFAULT_CONNECT_TIMEOUT = 30.0


def probe_address(address: str, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
    """For a "HOST:PORT" address, one TCP connection to the cluster's head within `timeout` seconds, so that an
    address where nothing listens fails at once with one line (ray.init retries for minutes, printing warnings).
    "auto", "local" and ray:// client addresses are left to Ray."""
    if address in (None, "local", "auto") or "://" in str(address):
        return
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise DistributedError(f"--ray {address!r} is not HOST:PORT (e.g. 127.0.0.1:6379), 'auto' or nothing")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except socket.timeout:
        raise DistributedError(f"no Ray cluster at {address} (connection timed out after {timeout:g} s); check the "
                               "address, or raise --ray-timeout") from None
    except OSError as err:
        raise DistributedError(f"no Ray cluster at {address} ({err.strerror or err}); start one with `ray start "
                               "--head` there, or drop the address to run a local instance") from None


def connect(address: Optional[str] = None, *, num_cpus: Optional[int] = None, num_gpus: Optional[int] = None,
            timeout: float = DEFAULT_CONNECT_TIMEOUT):
    """Start or join Ray and return the ray module. address None or "local": a new local instance sized to the
    machine (or to num_cpus / num_gpus); "auto": the cluster this node belongs to (`ray start` ran here); an
    address "host:port": that cluster, which must answer within `timeout` seconds. Reuses a connection this process
    already has."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    probe_address(address, timeout)
    kwargs = dict(include_dashboard=False, logging_level="WARNING",
                  log_to_driver=True)
    if address in (None, "local"):
        # A local instance serves this machine only, so it listens on the loopback address.
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, _node_ip_address="127.0.0.1", **kwargs)
    else:
        if num_cpus is not None or num_gpus is not None:
            raise DistributedError("num_cpus/num_gpus size a new local Ray instance; an existing cluster has its own")
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as err:
            raise DistributedError(f"cannot join the Ray cluster at {address!r} ({err}); start it with `ray start "
                                   f"--head` (then `ray start --address=HEAD:6379` on the other nodes) or drop the "
                                   f"address to start a local instance") from None
    return ray


# ----------------------------------------------------------------------------------------------------------------
# Work units
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A picklable recipe for the model every worker loads once: load_model(path, device, dtype). On a GPU node
    Ray gives each actor one GPU, visible inside the actor as "cuda". A path that is a local directory here is made
    absolute, since workers run in their own working directory; a bundled name (no such directory) stays a name,
    for each worker to find in its own installation."""

    path: str
    device: str = "cpu"
    dtype: Optional[str] = None          # a torch dtype name: "float32", "bfloat16", ...

    def __post_init__(self):
        # The same precedence as loading.resolve_checkpoint: a local directory wins over a bundled name.
        local = Path(self.path).expanduser()
        if local.is_dir():
            object.__setattr__(self, "path", str(local.resolve()))

    @property
    def uses_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def __call__(self):
        from recurscope.interp.loading import load_model

        dtype = None if self.dtype is None else getattr(torch, self.dtype)
        return load_model(self.path, device="cuda" if self.uses_gpu else self.device, dtype=dtype)


@dataclass(frozen=True)
class Unit:
    """One unit of work: the rows of one source (indices into the whole PairBatch) with a block of heads (scan)
    or one intervention arm (confirmation)."""

    source: int
    rows: tuple
    heads: tuple = ()
    arm: Optional[str] = None

    def label(self) -> str:
        if self.arm is not None:
            return f"source {self.source}, arm {self.arm}"
        first, last = self.heads[0], self.heads[-1]
        return f"source {self.source}, heads L{first[0]}H{first[1]}..L{last[0]}H{last[1]} ({len(self.heads)} heads)"


def _rows_by_source(pairs, rows: Optional[Sequence[int]] = None) -> dict[int, tuple]:
    source = pairs.source_id.cpu().tolist()
    out: dict[int, list] = {}
    for i in (range(len(pairs)) if rows is None else rows):
        out.setdefault(int(source[i]), []).append(int(i))
    return {s: tuple(r) for s, r in sorted(out.items())}


def _blocks(items: Sequence, n_blocks: int) -> list[tuple]:
    """`items` cut into n_blocks contiguous blocks of near-equal size (none empty)."""
    n_blocks = max(1, min(n_blocks, len(items)))
    size, extra = divmod(len(items), n_blocks)
    out, start = [], 0
    for b in range(n_blocks):
        stop = start + size + (1 if b < extra else 0)
        out.append(tuple(items[start:stop]))
        start = stop
    return out


def scan_units(pairs, heads: Sequence, head_block: Optional[int] = None, workers: int = 1,
               done: frozenset = frozenset()) -> list[Unit]:
    """(source, head block) units of a scan over the target rows of `pairs`. head_block None: whole sources
    when there are at least twice as many sources as workers (each unit reruns its source's prefix, so fewer,
    larger units cost least), else each source's heads cut into enough blocks to give every worker two units.
    Units whose keys (source, pair, layer, head) are all in `done` are left out; a partly done unit keeps only
    its heads with work left."""
    heads = [tuple(int(x) for x in h) for h in heads]
    target = _scan_rows(pairs)
    by_source = _rows_by_source(pairs, target)
    if head_block is None:
        n_blocks = max(1, math.ceil(2 * workers / max(len(by_source), 1)))
    else:
        if not isinstance(head_block, int) or head_block < 1:
            raise DistributedError(f"head_block must be a positive number of heads, got {head_block!r}")
        n_blocks = math.ceil(len(heads) / head_block)
    group = pairs.group.cpu().tolist()
    units = []
    for source, rows in by_source.items():
        for block in _blocks(heads, n_blocks):
            left = tuple(h for h in block if any((source, int(group[i]), *h) not in done for i in rows))
            if left:
                units.append(Unit(source, rows, heads=left))
    return units


def confirm_units(pairs, arms: Sequence[str], done: frozenset = frozenset()) -> list[Unit]:
    """(source, arm) units of a confirmation; units whose keys (arm, row) are all in `done` are left out."""
    units = []
    for arm in arms:
        for source, rows in _rows_by_source(pairs).items():
            if any((arm, i) not in done for i in rows):
                units.append(Unit(source, rows, arm=arm))
    return units


# ----------------------------------------------------------------------------------------------------------------
# The worker (a Ray actor; plain class here so that it imports without Ray)
# ----------------------------------------------------------------------------------------------------------------


class UnitOutOfMemory(RuntimeError):
    """Raised inside a worker when a unit runs out of GPU or host memory; the message names unit and setting."""


def _memory_message(unit: Unit, where: str, settings: str, host: Optional[str] = None) -> str:
    on = f" on worker {host}" if host else ""
    return f"work unit ({unit.label()}) ran out of {where} memory{on}; lower {settings}, or give each worker more memory"


class UnitWorker:
    """Loads the model once, holds the whole PairBatch, and computes units with the library's own functions."""

    def __init__(self, model_factory: Callable, pairs, threads: int = 1):
        torch.set_num_threads(max(1, int(threads)))
        self.model = model_factory()
        self.pairs = pairs

    def info(self) -> dict:
        device = next(self.model.parameters()).device
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": str(device)}

    def _guarded(self, unit: Unit, settings: str, fn):
        try:
            return fn()
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise UnitOutOfMemory(_memory_message(unit, "GPU", settings, socket.gethostname())) from None
        except MemoryError:
            raise UnitOutOfMemory(_memory_message(unit, "host", settings, socket.gethostname())) from None

    def scan(self, unit: Unit, batch_size: int, prefix_batch: int) -> list[dict]:
        from recurscope.interp.scan import SCAN_KEY, scan_rows   # not run_scan: its summary needs scipy

        sub = self.pairs.select(unit.rows)
        rows = self._guarded(unit, f"--batch-size (now {batch_size}) or --head-block",
                             lambda: scan_rows(self.model, sub, None, batch_size, heads=list(unit.heads),
                                               prefix_batch=prefix_batch))
        rows = rows.sort_values(list(SCAN_KEY), kind="stable")   # in the order run_scan's result lists them
        rows["row"] = [unit.rows[i] for i in rows["row"]]       # back to indices into the whole batch
        return rows.to_dict("records")

    def compute(self, unit: Unit, fn: Callable) -> list[dict]:
        """A protocol's unit: fn(model, pairs, unit.rows) -> row records; rows index the whole batch, or name the arms
    (conditions, formats) the unit computes."""
        return self._guarded(unit, "--batch-size", lambda: fn(self.model, self.pairs, unit.rows))

    def confirm(self, unit: Unit, heads, scan_heads, seed: int, batch_size: int) -> list[dict]:
        from recurscope.interp.confirm import confirm_arm

        sub = self.pairs.select(unit.rows)
        frame = self._guarded(unit, f"--batch-size (now {batch_size})",
                              lambda: confirm_arm(self.model, sub, heads, unit.arm, scan_heads=scan_heads, seed=seed,
                                                  batch_size=batch_size, row_ids=unit.rows))
        return frame.to_dict("records")


# ----------------------------------------------------------------------------------------------------------------
# The driver
# ----------------------------------------------------------------------------------------------------------------


def _default_workers(ray, uses_gpu: bool) -> int:
    resources = ray.cluster_resources()
    n = int(resources.get("GPU", 0) if uses_gpu else resources.get("CPU", 1))
    if n < 1:
        raise DistributedError("the Ray cluster has no GPU for a --device cuda run; start the nodes with their GPUs "
                               "(`ray start ... --num-gpus N`) or run on --device cpu")
    return n


def fit_workers(ray, workers: Optional[int], uses_gpu: bool) -> int:
    """The workers to start: one per CPU (GPU) of the cluster by default; more than the cluster can place would wait
    for resources forever, so a larger --workers is clamped to the cluster's count with a warning."""
    available = _default_workers(ray, uses_gpu)
    if workers is None:
        return available
    workers = _check_workers(workers)
    if workers > available:
        what = "GPU" if uses_gpu else "CPU"
        print(f"WARNING: --workers {workers}: the Ray cluster has {available} {what}(s), one per worker; running "
              f"{available} workers", file=sys.stderr)
        return available
    return workers


def _execute(ray, units: list[Unit], new_actor: Callable[[int], object], submit: Callable, on_rows: Callable,
             n_workers: int, stats: RayRunStats, progress: Optional[Callable[[int, int], None]] = None) -> None:
    """Runs `units` on up to n_workers actors; on_rows(unit, rows) is called on the driver as each finishes. An
    actor that dies gives its unfinished units back to the queue and is replaced."""
    from ray import exceptions as rex

    queue = deque(units)
    total = len(units)
    actors: dict[int, object] = {}
    in_flight: dict = {}                       # ObjectRef -> (actor id, unit)
    failures: dict[Unit, int] = {}
    next_id = 0

    def start_actor():
        nonlocal next_id
        actors[next_id] = new_actor(next_id)
        stats.actors_started += 1
        next_id += 1

    try:
        _run_units(ray, rex, queue, total, actors, in_flight, failures, start_actor, submit, on_rows, n_workers,
                   stats, progress)
    finally:
        for actor in actors.values():          # frees each actor's model now, not when the driver exits
            ray.kill(actor, no_restart=True)


def _run_units(ray, rex, queue, total, actors, in_flight, failures, start_actor, submit, on_rows, n_workers, stats,
               progress):
    replacements = n_workers                   # a dead actor is replaced at most this many times in all
    t0 = time.perf_counter()
    for _ in range(min(n_workers, total)):
        start_actor()
    try:   # wait for every model to load: a checkpoint that cannot load fails here, once, with its reason
        ray.get([actor.info.remote() for actor in actors.values()])
    except rex.RayError as err:
        raise DistributedError(f"a worker could not load the model: {str(err).splitlines()[-1] if str(err) else err}"
                               ) from err
    stats.startup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    finished = 0
    if progress is not None:
        progress(0, total)
    while queue or in_flight:
        for aid, actor in list(actors.items()):
            busy = sum(1 for a, _ in in_flight.values() if a == aid)
            while queue and busy < UNITS_IN_FLIGHT_PER_ACTOR:
                unit = queue.popleft()
                in_flight[submit(actor, unit)] = (aid, unit)
                busy += 1
        if not in_flight:
            raise DistributedError(f"every worker died and {len(queue)} units are left; see the worker logs above")
        [ref], _ = ray.wait(list(in_flight), num_returns=1)
        aid, unit = in_flight.pop(ref)
        try:
            rows = ray.get(ref)
        except rex.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, UnitOutOfMemory):
                raise DistributedError(str(cause)) from None
            raise DistributedError(f"work unit ({unit.label()}) failed on a worker: {cause or err}") from err
        except (rex.RayActorError, rex.WorkerCrashedError, rex.OutOfMemoryError, rex.ObjectLostError) as err:
            text = str(err)
            if isinstance(err, rex.OutOfMemoryError) or ("memory" in text.lower() and "out of" in text.lower()):
                raise DistributedError(_memory_message(unit, "host", "--batch-size or --workers (fewer actors per "
                                                       "node)") + " (Ray's memory monitor killed it)") from None
            # The actor died: everything it had in flight goes back to the queue, for another actor.
            lost = [unit]
            for r, (a, u) in list(in_flight.items()):
                if a == aid:
                    del in_flight[r]
                    lost.append(u)
            for u in lost:
                failures[u] = failures.get(u, 0) + 1
                if failures[u] > MAX_UNIT_FAILURES:
                    raise DistributedError(f"work unit ({u.label()}) was lost with {failures[u]} workers in turn "
                                           f"(last: {text.splitlines()[0] if text else type(err).__name__}); if "
                                           f"the workers ran out of memory, lower --batch-size or --head-block")
            queue.extendleft(reversed(lost))
            stats.retried_units += len(lost)
            actor = actors.pop(aid, None)
            if actor is not None:
                ray.kill(actor, no_restart=True)
            if replacements > 0:
                replacements -= 1
                start_actor()
            continue
        on_rows(unit, rows)
        stats.units += 1
        finished += 1
        if progress is not None:
            progress(finished, total)
    stats.work_s = time.perf_counter() - t0


def _actor_factory(ray, model_factory, pairs_ref, uses_gpu: bool, threads: int, name_prefix: Optional[str]):
    options = dict(num_cpus=threads, num_gpus=1 if uses_gpu else 0, max_restarts=0, max_concurrency=1)
    remote = ray.remote(UnitWorker)

    def new_actor(i):
        extra = {} if name_prefix is None else {"name": f"{name_prefix}-{i}"}
        return remote.options(**options, **extra).remote(model_factory, pairs_ref, threads)
    return new_actor


def run_scan_ray(model_factory: Callable, pairs, heads: Sequence, run_dir=None, *, batch_size: int = 96,
                 prefix_batch: int = 4, head_block: Optional[int] = None, workers: Optional[int] = None,
                 address: Optional[str] = None, uses_gpu: Optional[bool] = None, threads_per_worker: int = 1,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 progress: Optional[Callable[[int, int], None]] = None, actor_name_prefix: Optional[str] = None):
    """The head scan of run_scan, its (source, head block) units spread over Ray actors.

    model_factory: a picklable callable that returns the model (a ModelSpec, or a function for a model built in
    code); each actor calls it once. heads: the (layer, head) list to scan (scan.all_heads(model) for all).
    run_dir: an interp.results.RunDir; the driver writes its "scan_rows" table as units finish and "scan_heads" at
    the end, exactly as run_scan does, so a run resumes across kills and either way (with or without Ray).
    workers: actors to start (default: one per CPU, or per GPU when uses_gpu). progress(done, total) counts units.
    Returns (ScanResult, RayRunStats).
    """
    from recurscope.interp.scan import SCAN_KEY, SCAN_TABLE, summarise_scan

    t0 = time.perf_counter()
    uses_gpu = getattr(model_factory, "uses_gpu", False) if uses_gpu is None else uses_gpu
    heads = [tuple(int(x) for x in h) for h in heads]
    log = None if run_dir is None else run_dir.table(SCAN_TABLE, key=list(SCAN_KEY))
    done = set() if log is None else log.done_keys()
    ray = connect(address, timeout=connect_timeout)
    n_workers = fit_workers(ray, workers, uses_gpu)
    units = scan_units(pairs, heads, head_block, n_workers, frozenset(done))
    stats = RayRunStats(skipped_units=len(scan_units(pairs, heads, head_block, n_workers)) - len(units))
    collected: list[dict] = []

    def on_rows(unit, rows):
        new = [r for r in rows if (r["source"], r["pair"], r["layer"], r["head"]) not in done]
        if log is not None:
            log.append(new)                    # one atomic batch per unit: all of it on disk or none
        done.update((r["source"], r["pair"], r["layer"], r["head"]) for r in new)
        collected.extend(new)

    if units:
        new_actor = _actor_factory(ray, model_factory, ray.put(pairs), uses_gpu, threads_per_worker,
                                   actor_name_prefix)
        _execute(ray, units, new_actor, lambda a, u: a.scan.remote(u, batch_size, prefix_batch), on_rows,
                 n_workers, stats, progress)
    frame = log.read() if log is not None else pd.DataFrame(collected)
    target = _target_keys(pairs, heads)
    keys = list(zip(frame["source"], frame["pair"], frame["layer"], frame["head"]))
    frame = frame[[k in target for k in keys]].reset_index(drop=True)
    missing = len(target) - len(frame)
    if missing:
        raise DistributedError(f"the scan finished with {missing} of {len(target)} rows missing; rerun the same "
                               f"command to compute them")
    result = summarise_scan(frame)
    if run_dir is not None:
        run_dir.write_table("scan_heads", result.heads)
        run_dir.write_table(SCAN_TABLE, frame)           # the row log's finished copy, CSV and parquet
    stats.wall_s = time.perf_counter() - t0
    return result, stats


def _scan_rows(pairs) -> list[int]:
    """The rows a scan scores: target rows with a donor answer (as run_scan selects them)."""
    rows = torch.nonzero(pairs.is_target.cpu() & (pairs.donor_answer_index.cpu() >= 0))[:, 0].tolist()
    if not rows:
        raise DistributedError("pairs has no target rows with a donor answer: the scan needs swap (or update) pairs")
    return rows


def _target_keys(pairs, heads) -> set:
    return {(int(pairs.source_id[i]), int(pairs.group[i]), l, h) for i in _scan_rows(pairs) for l, h in heads}


def _check_workers(workers) -> int:
    if not isinstance(workers, int) or workers < 1:
        raise DistributedError(f"--workers must be a positive integer, got {workers!r}")
    return workers


def run_confirm_ray(model_factory: Callable, pairs, heads: Sequence, controls: Sequence, run_dir=None, *,
                    scan_heads: Optional[pd.DataFrame] = None, seed: int = 0, batch_size: int = 16,
                    arms: Optional[Sequence[str]] = None, workers: Optional[int] = None,
                    address: Optional[str] = None, uses_gpu: Optional[bool] = None, threads_per_worker: int = 1,
                    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                    progress: Optional[Callable[[int, int], None]] = None, n_resamples: int = 9999,
                    actor_name_prefix: Optional[str] = None):
    """The confirmation of run_confirm, its (source, arm) units spread over Ray actors; `heads` as normalised by
    the caller and `controls` = interventions.choose_control_heads(model, heads, scan_heads). Rows go to the
    "confirm_rows" table keyed by (intervention, row), the summary to "confirm_summary", as run_confirm writes them.
    Returns (ConfirmResult, RayRunStats)."""
    from recurscope.interp.confirm import ARMS, CONFIRM_KEY, CONFIRM_TABLE, ConfirmResult, summarise_confirm

    t0 = time.perf_counter()
    uses_gpu = getattr(model_factory, "uses_gpu", False) if uses_gpu is None else uses_gpu
    arms = list(ARMS if arms is None else arms)
    heads = [tuple(int(x) for x in h) for h in heads]
    log = None if run_dir is None else run_dir.table(CONFIRM_TABLE, key=list(CONFIRM_KEY))
    done = set() if log is None else log.done_keys()
    ray = connect(address, timeout=connect_timeout)
    n_workers = fit_workers(ray, workers, uses_gpu)
    units = confirm_units(pairs, arms, frozenset(done))
    stats = RayRunStats(skipped_units=len(confirm_units(pairs, arms)) - len(units))
    collected: list[dict] = []

    def on_rows(unit, rows):
        new = [r for r in rows if (r["intervention"], r["row"]) not in done]
        if log is not None:
            log.append(new)
        done.update((r["intervention"], r["row"]) for r in new)
        collected.extend(new)

    if units:
        new_actor = _actor_factory(ray, model_factory, ray.put(pairs), uses_gpu, threads_per_worker,
                                   actor_name_prefix)
        _execute(ray, units, new_actor, lambda a, u: a.confirm.remote(u, heads, scan_heads, seed, batch_size),
                 on_rows, n_workers, stats, progress)
    rows = log.read() if log is not None else pd.DataFrame(collected)
    rows = rows[rows["intervention"].isin(arms)].sort_values(["intervention", "row"], kind="stable")
    rows = rows.reset_index(drop=True)
    if len(rows) != len(arms) * len(pairs):
        raise DistributedError(f"the confirmation finished with {len(arms) * len(pairs) - len(rows)} rows missing; "
                               f"rerun the same command to compute them")
    summary = summarise_confirm(rows, n_resamples=n_resamples, seed=seed)
    if run_dir is not None:
        run_dir.write_table("confirm_summary", summary)
        run_dir.write_table(CONFIRM_TABLE, rows)         # the row log's finished copy, CSV and parquet
    stats.wall_s = time.perf_counter() - t0
    return ConfirmResult(rows, summary, heads, list(controls)), stats


def run_units_ray(model_factory: Callable, pairs, units: Sequence[Sequence], compute: Callable,
                  on_rows: Callable, *, workers: Optional[int] = None, address: Optional[str] = None,
                  uses_gpu: Optional[bool] = None, threads_per_worker: int = 1,
                  progress: Optional[Callable[[int, int], None]] = None,
                  actor_name_prefix: Optional[str] = None) -> RayRunStats:
    """A protocol's independent units on Ray actors: each unit is a tuple of row indices into `pairs`, or a tuple of
    names (strings: e.g. the arms or conditions it computes; `pairs` may then be None); a worker returns
    compute(model, pairs, unit) (a picklable top-level function giving row records) and the driver, the only
    writer, calls on_rows(unit, records) as each unit finishes (the protocol appends them to its row log there)."""
    t0 = time.perf_counter()
    uses_gpu = getattr(model_factory, "uses_gpu", False) if uses_gpu is None else uses_gpu
    named = any(isinstance(x, str) for unit in units for x in unit)
    units = [tuple(unit) if named else tuple(int(i) for i in unit) for unit in units]
    stats = RayRunStats()
    if not units:
        return stats
    ray = connect(address)
    n_workers = _default_workers(ray, uses_gpu) if workers is None else _check_workers(workers)
    if named:
        work = [Unit(-1, unit, arm=", ".join(unit)) for unit in units]
    else:
        source = pairs.source_id.cpu().tolist()
        work = [Unit(int(source[rows[0]]), rows, arm=f"rows {rows[0]}-{rows[-1]}") for rows in units]
    new_actor = _actor_factory(ray, model_factory, ray.put(pairs), uses_gpu, threads_per_worker, actor_name_prefix)
    _execute(ray, work, new_actor, lambda a, u: a.compute.remote(u, compute), lambda u, rows: on_rows(u.rows, rows),
             n_workers, stats, progress)
    stats.wall_s = time.perf_counter() - t0
    return stats
