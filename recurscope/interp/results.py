"""Result directories for recurscope runs: a manifest that pins what was run (model, checkpoint hash, arguments,
seeds, sources, package versions), an append-only row log that survives being killed, and table/figure outputs.

Row-log format (``<out>/<name>.jsonl``): UTF-8 text, one JSON object per line, one line per row. Each ``append``
writes its rows in a single write that is flushed and fsynced; the batch's LAST row carries the commit as its first
field, ``"__batch_end__": <number of rows in the batch>``. A reader keeps only rows of committed batches, so a batch
is all-or-nothing: a crash mid-write leaves at most an uncommitted tail (possibly a torn last line), which readers
ignore and the next append truncates before writing. Because the commit rides on a row, ``pd.read_json(path,
lines=True)`` gives exactly the rows (plus a ``__batch_end__`` column, set on each batch's last row: drop it); only a
crash's uncommitted tail, if any, would differ from ``RowLog.read()``. Logs written before this format end each batch
with a separate line ``{"__batch_end__": n}`` and are still read. Floats NaN/inf are written as Python's json writes
them (NaN, Infinity).
"""
from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import io
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import re
import stat
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import pandas as pd

from recurscope.interp.checkpoint_files import LOADED_TEXT_FILES, file_kind

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
COMMIT_KEY = "__batch_end__"
# Bytes that start a commit line (a batch's last row, or an older log's bare commit line). json escapes quotes and
# newlines inside strings and rows may not use the key, so this sequence occurs only where a commit line begins; the
# file's first line is the one commit line without the leading newline.
_COMMIT_PREFIX = b'\n{"' + COMMIT_KEY.encode() + b'": '
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy", ".gguf", ".h5", ".msgpack")
TRACKED_PACKAGES = ("torch", "triton", "transformers", "transformer_lens", "nnsight", "flash-linear-attention",
                    "numpy", "pandas", "scipy", "pyarrow", "matplotlib", "recurscope")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------------------------
# Checkpoint hash and environment
# --------------------------------------------------------------------------------------------------------------


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint_path must be an existing file or directory, got {str(path)!r} (not found)")
    files = sorted((p for p in path.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)),
                   key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise ValueError(f"checkpoint_path {str(path)!r} holds no weight files (expected names ending in "
                         f"{', '.join(WEIGHT_SUFFIXES)}); point it at the checkpoint directory or weight file")
    return files


def checkpoint_hash(path) -> str:
    """Content hash of every file a loader reads from a checkpoint: the weight files and, beside them, config.json
    and the tokenizer files (`checkpoint_files.LOADED_TEXT_FILES`: they change the model and its tokens). sha256
    over the files in sorted relative-path order, each framed by its relative path and byte length so that
    different splits of the same bytes differ. A single file is hashed the same way under its own name. Shards
    outside the directory are refused by the loaders, so nothing loaded escapes the hash. Returns
    ``"sha256:<hex>"``."""
    root = Path(path)
    files = _weight_files(root)
    if root.is_dir():
        files = sorted(files + [root / n for n in LOADED_TEXT_FILES if (root / n).is_file()],
                       key=lambda p: p.relative_to(root).as_posix())
    digest = hashlib.sha256()
    for f in files:
        rel = f.name if root.is_file() else f.relative_to(root).as_posix()
        digest.update(f"{rel}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as handle:
            for chunk in iter(lambda: handle.read(_CHUNK), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def package_versions(packages: Sequence[str] = TRACKED_PACKAGES) -> dict[str, Optional[str]]:
    """Installed versions via importlib.metadata (no imports); a package that is not installed maps to None."""
    out: dict[str, Optional[str]] = {}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _platform_info() -> dict:
    return {"python": platform.python_version(), "implementation": platform.python_implementation(),
            "system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "platform": platform.platform()}


def _to_jsonable(obj: Any) -> Any:
    """json ``default`` hook: paths, numpy/torch scalars and arrays, sets."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if hasattr(obj, "tolist"):  # numpy scalars/arrays, torch tensors
        return obj.tolist()
    if isinstance(obj, (_dt.datetime, _dt.date)):
        return obj.isoformat()
    raise TypeError(f"value of type {type(obj).__name__} is not JSON serialisable")


def _normalise(name: str, value: Any) -> Any:
    """JSON round trip, so a value compares equal to what a manifest stores (tuples become lists, paths strings)."""
    try:
        return json.loads(json.dumps(value, default=_to_jsonable))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{name} must be JSON serialisable (numbers, strings, lists, dicts, paths), got an "
                         f"unsupported value: {err}") from None


# --------------------------------------------------------------------------------------------------------------
# Writing only what the tool creates: no link is followed, no FIFO or device is opened, every file goes through a
# temporary file and a rename (so a reader never sees half a file, and a link planted where an output goes is
# replaced, never written through).
# --------------------------------------------------------------------------------------------------------------


class OutputRefused(ValueError):
    """Where an output goes there is something recurscope did not create (a link, a FIFO, a device, a directory)."""


def _refuse(path: Path, mode: int) -> OutputRefused:
    what = file_kind(mode)
    if stat.S_ISLNK(mode):
        what += f" (to {os.readlink(path)})"
    return OutputRefused(f"{path} is {what} where recurscope writes its own output; it never writes through links "
                         "or into FIFOs and devices: remove it, or use a fresh --out directory")


def output_dir(path) -> Path:
    """`path` as a directory to write in: created when absent, refused when it is a link or anything but a
    directory."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(parents=True, exist_ok=True)
        info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, info.st_mode)
    return path


def check_output(path) -> Path:
    """`path` may be written: it is absent or a regular file (not a link), in a directory that is not a link."""
    path = Path(path)
    output_dir(path.parent)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return path
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, info.st_mode)
    return path


def write_output(path, data) -> Path:
    """Writes `data` (bytes or text, UTF-8) to `path` through a temporary file beside it and a rename: never
    following a link, never opening a FIFO or device, never leaving half a file."""
    path = check_output(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        os.unlink(tmp)            # a stale temporary of this pid, or anything planted under its name (not followed)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        check_output(path)        # still absent or a regular file; the rename replaces a link, never follows it
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def open_regular(path, flags: int = os.O_RDONLY) -> int:
    """A file descriptor for `path`, which must be a regular file and not a link: opened without following links and
    without blocking (a FIFO would block for ever), judged by fstat. Raises OutputRefused naming it."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:   # O_NOFOLLOW on a link
            raise _refuse(path, os.lstat(path).st_mode) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refuse(path, info.st_mode)
    os.set_blocking(fd, True)
    return fd


def read_regular_bytes(path) -> bytes:
    """The bytes of a file recurscope wrote (a row log, a manifest): refused at once if it is a link, FIFO or device."""
    fd = open_regular(path)
    try:
        chunks = []
        while True:
            block = os.read(fd, _CHUNK)
            if not block:
                return b"".join(chunks)
            chunks.append(block)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    write_output(path, text)


def _check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"{kind} name must be a plain file name (letters, digits, '_', '.', '-'; not starting with "
                         f"'.' or '-'), got {name!r}")
    return name


# --------------------------------------------------------------------------------------------------------------
# Row log
# --------------------------------------------------------------------------------------------------------------


class RowLog:
    """Append-only, crash-safe JSON-lines table. ``key`` (column names) identifies a unit of work."""

    def __init__(self, path, key: Optional[Sequence[str]] = None):
        self.path = Path(path)
        self.key = None if key is None else _key_cols(key)

    # -- reading ------------------------------------------------------------------------------------------------

    def _scan(self) -> tuple[list[dict], int, int]:
        """Committed rows, the byte offset just past the last commit line, and the file size."""
        if not os.path.lexists(self.path):
            return [], 0, 0
        data = read_regular_bytes(self.path)
        rows: list[dict] = []
        pending: list[dict] = []
        committed_end = 0
        pos = 0
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break  # unterminated final line: a torn write, ignored
            line = data[pos:nl]
            pos = nl + 1
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except ValueError:  # JSONDecodeError or UnicodeDecodeError
                if data.find(_COMMIT_PREFIX, pos - 1) < 0:
                    break  # garbage inside the uncommitted tail (a torn write); ignored like the torn last line
                raise ValueError(f"row log {self.path} is corrupt at byte {pos - len(line) - 1}: a committed line "
                                 f"is not JSON; the file was edited or damaged") from None
            if isinstance(obj, dict) and COMMIT_KEY in obj:
                count = obj.pop(COMMIT_KEY)
                if obj:                             # the batch's last row carries the commit
                    pending.append(obj)
                if count != len(pending):
                    raise ValueError(f"row log {self.path} is corrupt: a commit line says {count} rows, "
                                     f"{len(pending)} precede it")
                rows.extend(pending)
                pending = []
                committed_end = pos
            else:
                pending.append(obj)
        return rows, committed_end, len(data)

    def rows(self) -> list[dict]:
        """All committed rows as dicts, in write order (duplicates included)."""
        return self._scan()[0]

    def done_keys(self, key_cols: Optional[Sequence[str]] = None) -> set:
        """Keys already committed, so a resumed run can skip them: a set of tuples for several key columns, of
        plain values for a single column given as a string."""
        cols, single = self._resolve_key(key_cols)
        out = set()
        for i, row in enumerate(self.rows()):
            missing = [c for c in cols if c not in row]
            if missing:
                raise ValueError(f"row {i} of {self.path} lacks key columns {missing}; it has {sorted(row)}")
            out.add(row[cols[0]] if single else tuple(_hashable(row[c]) for c in cols))
        return out

    def read(self, key_cols: Optional[Sequence[str]] = None) -> pd.DataFrame:
        """Committed rows as a DataFrame. With a key (given here or when the table was opened), rows whose key was
        written more than once keep their first occurrence and a warning says how many were dropped."""
        rows = self.rows()
        frame = pd.DataFrame.from_records(rows) if rows else pd.DataFrame(columns=list(self.key or []))
        if key_cols is None and self.key is None:
            return frame
        cols, _ = self._resolve_key(key_cols)
        if len(frame) == 0:
            return frame
        missing = [c for c in cols if c not in frame.columns]
        if missing:
            raise ValueError(f"key columns {missing} are not in {self.path}; columns present: {list(frame.columns)}")
        keys = pd.Series([tuple(_hashable(row.get(c)) for c in cols) for row in rows])
        dup = keys.duplicated(keep="first").to_numpy()
        if dup.any():
            warnings.warn(f"{self.path.name}: {int(dup.sum())} rows repeat a key {cols} already written (e.g. a crash "
                          f"between writing and bookkeeping); keeping the first occurrence", RuntimeWarning,
                          stacklevel=2)
            frame = frame.loc[~dup].reset_index(drop=True)
        return frame

    def __len__(self) -> int:
        return len(self.rows())

    def _resolve_key(self, key_cols) -> tuple[list[str], bool]:
        if key_cols is None:
            if self.key is None:
                raise ValueError(f"no key columns for {self.path.name}: pass key_cols or open the table with "
                                 f"run.table(name, key=[...])")
            return list(self.key), False
        if isinstance(key_cols, str):
            return [key_cols], True
        return _key_cols(key_cols), False

    # -- writing ------------------------------------------------------------------------------------------------

    def append(self, rows: Iterable[Mapping[str, Any]]) -> int:
        """Append a batch of rows atomically (all committed or none) and fsync. Returns the number of rows."""
        rows = list(rows)
        if not rows:
            return 0
        lines = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(f"rows must be dicts (column -> value), got {type(row).__name__} at position {i}")
            if COMMIT_KEY in row:
                raise ValueError(f"column name {COMMIT_KEY!r} is reserved for the row log's commit lines (row {i})")
            if not row:
                raise ValueError(f"row {i} is empty: every row needs at least one column")
            if self.key is not None:
                missing = [c for c in self.key if c not in row]
                if missing:
                    raise ValueError(f"row {i} lacks the table's key columns {missing}; every row needs {self.key}")
            body = dict(row) if i < len(rows) - 1 else {COMMIT_KEY: len(rows), **row}
            try:
                lines.append(json.dumps(body, default=_to_jsonable, ensure_ascii=False))
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {i} is not JSON serialisable: {err}") from None
        payload = ("\n".join(lines) + "\n").encode("utf-8")

        output_dir(self.path.parent)
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # one writer at a time
            size = os.fstat(fd).st_size
            committed_end = _committed_end(fd, size)
            if size != committed_end:
                # Drop the uncommitted tail a crash left behind (torn line and/or rows of an unfinished batch).
                os.ftruncate(fd, committed_end)
            os.lseek(fd, committed_end, os.SEEK_SET)
            view = memoryview(payload)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)  # also releases the lock
        return len(rows)


def _committed_end(fd: int, size: int) -> int:
    """Byte offset just past the last commit line, found by reading backwards (appends stay O(batch), not O(file))."""
    end = size
    while end > 0:
        start = max(0, end - _CHUNK)
        chunk = os.pread(fd, end - start + len(_COMMIT_PREFIX), start)  # overlap so a prefix across chunks is seen
        hit = chunk.rfind(_COMMIT_PREFIX)
        while hit >= 0:
            line_end = chunk.find(b"\n", hit + 1)
            if line_end < 0:
                tail = os.pread(fd, size - (start + hit + 1), start + hit + 1)
                line_end_abs = tail.find(b"\n")
                if line_end_abs >= 0:
                    return start + hit + 1 + line_end_abs + 1
            else:
                return start + line_end + 1
            hit = chunk.rfind(_COMMIT_PREFIX, 0, hit)  # that commit line is torn; look further back
        end = start
    head = os.pread(fd, min(size, _CHUNK), 0)     # the first line commits a one-row first batch
    if head.startswith(_COMMIT_PREFIX[1:]):
        line_end = head.find(b"\n")
        if line_end < 0 and size > len(head):
            line_end = os.pread(fd, size, 0).find(b"\n")
        if line_end >= 0:
            return line_end + 1
    return 0


def _key_cols(key) -> list[str]:
    cols = [key] if isinstance(key, str) else list(key)
    if not cols or not all(isinstance(c, str) and c for c in cols):
        raise ValueError(f"key columns must be a non-empty list of column names, got {key!r}")
    return cols


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


# --------------------------------------------------------------------------------------------------------------
# Run directory
# --------------------------------------------------------------------------------------------------------------


class WorkDiffers(ValueError):
    """RunDir.open refused a resume because the requested work differs from the manifest's (see ``diffs``)."""

    def __init__(self, message: str, diffs: Sequence[str] = ()):
        super().__init__(message)
        self.diffs = list(diffs)


#: args naming an input result directory by path (a `run`'s confirmation names its own scan/): a moved run
#: directory still resumes when the path now given holds the same run (the heads it gave are compared anyway)
MOVABLE_PATH_ARGS = ("from_scan",)


def _manifest_of(path) -> Optional[dict]:
    try:
        raw = json.loads(read_regular_bytes(Path(path) / MANIFEST_NAME).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _same_run(old_path, new_path) -> bool:
    """Whether result directory `new_path` is the run recorded at `old_path` (moved or copied): its manifest has
    the same creation time, kind, checkpoint hash and work; when `old_path` is gone, `new_path` must be a run."""
    if not isinstance(old_path, str) or not isinstance(new_path, str):
        return False
    new = _manifest_of(new_path)
    if new is None:
        return False
    old = _manifest_of(old_path)
    if old is None:
        return not Path(old_path).exists()
    return all(old.get(k) == new.get(k) for k in ("created", "kind", "checkpoint_hash", "args", "seeds", "sources"))


class RunDir:
    """One run's output directory. Create it with ``RunDir.create``, reopen it for a resume with ``RunDir.open``
    (which refuses if the work would differ), or use ``RunDir.create_or_open`` from a CLI."""

    #: manifest fields that define the work and must match on resume
    RESUME_FIELDS = ("kind", "model_name", "checkpoint_hash", "args", "seeds", "sources", "split")

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_NAME

    @staticmethod
    def _work(kind, model_name, checkpoint_path, args, seeds, sources, split) -> dict:
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string naming the protocol (e.g. 'scan'), got {kind!r}")
        if not isinstance(model_name, str) or not model_name:
            raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
        if args is not None and not isinstance(args, Mapping):
            raise ValueError(f"args must be a dict of the arguments that define the work, got {type(args).__name__}")
        return {"kind": kind, "model_name": model_name,
                "checkpoint_path": None if checkpoint_path is None else os.fspath(checkpoint_path),
                "checkpoint_hash": None if checkpoint_path is None else checkpoint_hash(checkpoint_path),
                "args": _normalise("args", dict(args or {})), "seeds": _normalise("seeds", seeds),
                "sources": _normalise("sources", None if sources is None else list(sources)),
                "split": _normalise("split", split)}

    @classmethod
    def create(cls, out_dir, *, kind: str, model_name: str, checkpoint_path=None, args: Optional[Mapping] = None,
               seeds=None, sources: Optional[Sequence] = None, split: Optional[str] = None,
               extra: Optional[Mapping] = None) -> "RunDir":
        """Make ``out_dir`` and write its manifest. ``args`` are the arguments that define the work (compared on
        resume); ``extra`` is recorded but not compared (device, batch size, ...). Refuses an existing run."""
        path = Path(out_dir)
        if os.path.lexists(path / MANIFEST_NAME):
            raise FileExistsError(f"{path} already holds a run ({MANIFEST_NAME} exists); resume it with RunDir.open "
                                  f"or choose a new --out directory")
        if path.is_dir() and cls.holds_rows(path):
            logs = sorted(f.name for f in path.glob("*.jsonl") if len(RowLog(f)))
            raise ValueError(f"{path} holds committed rows ({', '.join(logs)}) but no {MANIFEST_NAME}, so what they "
                             "were computed with (model, seed, layout) cannot be checked and they are not reused; "
                             f"restore its {MANIFEST_NAME}, or use a fresh --out directory")
        return cls._write_new(path, kind=kind, model_name=model_name, checkpoint_path=checkpoint_path, args=args,
                              seeds=seeds, sources=sources, split=split, extra=extra)

    @classmethod
    def _write_new(cls, path: Path, *, kind, model_name, checkpoint_path, args, seeds, sources, split, extra,
                   replaced: Optional[list] = None) -> "RunDir":
        manifest = {"manifest_version": MANIFEST_VERSION,
                    **cls._work(kind, model_name, checkpoint_path, args, seeds, sources, split),
                    "extra": _normalise("extra", dict(extra or {})),
                    "packages": package_versions(), "argv": list(sys.argv), "cwd": os.getcwd(),
                    "platform": _platform_info(),
                    "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "resumed": []}
        if replaced:
            manifest["replaced"] = replaced
        output_dir(path)
        _atomic_write_text(path / MANIFEST_NAME, json.dumps(manifest, indent=2, default=_to_jsonable) + "\n")
        return cls(path, manifest)

    @classmethod
    def open(cls, out_dir, *, kind: Optional[str] = None, model_name: Optional[str] = None, checkpoint_path=None,
             args: Optional[Mapping] = None, seeds=None, sources: Optional[Sequence] = None,
             split: Optional[str] = None) -> "RunDir":
        """Reopen an existing run for a resume. Every resume argument given (not None) is compared with the
        manifest (the checkpoint by content hash); a mismatch raises ValueError naming the fields."""
        path = Path(out_dir)
        manifest_path = path / MANIFEST_NAME
        if not os.path.lexists(manifest_path):
            raise FileNotFoundError(f"{path} has no {MANIFEST_NAME}: it is not a run directory; start a run with "
                                    f"RunDir.create")
        try:
            manifest = json.loads(read_regular_bytes(manifest_path).decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise WorkDiffers(f"{manifest_path} is not valid JSON ({err}); use a new --out directory",
                              ["manifest: not valid JSON"]) from None
        given = {"kind": kind, "model_name": model_name, "args": args, "seeds": seeds, "sources": sources,
                 "split": split}
        now: dict[str, Any] = {}
        for name, value in given.items():
            if value is not None:
                now[name] = _normalise(name, list(value) if name == "sources" else
                                       dict(value) if name == "args" else value)
        if checkpoint_path is not None:
            now["checkpoint_hash"] = checkpoint_hash(checkpoint_path)
        if isinstance(now.get("args"), dict) and isinstance(manifest.get("args"), dict):
            for key in MOVABLE_PATH_ARGS:
                old_path, new_path = manifest["args"].get(key), now["args"].get(key)
                if old_path != new_path and _same_run(old_path, new_path):
                    now["args"][key] = old_path      # the input run moved (with this one): the same work
        diffs = [f"{name}: run has {manifest.get(name)!r}, now {value!r}" for name, value in now.items()
                 if manifest.get(name) != value]
        if diffs:
            raise WorkDiffers(f"cannot resume {path}: the work differs from the recorded run in "
                             f"{', '.join(d.split(':')[0] for d in diffs)} ({'; '.join(diffs)}). Use a new --out "
                             f"directory for different work", diffs)
        manifest.setdefault("resumed", []).append(
            {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "argv": list(sys.argv),
             "packages": package_versions()})
        _atomic_write_text(manifest_path, json.dumps(manifest, indent=2, default=_to_jsonable) + "\n")
        return cls(path, manifest)

    @classmethod
    def create_or_open(cls, out_dir, *, kind: str, model_name: str, checkpoint_path=None,
                       args: Optional[Mapping] = None, seeds=None, sources: Optional[Sequence] = None,
                       split: Optional[str] = None, extra: Optional[Mapping] = None) -> "RunDir":
        """Resume ``out_dir`` if it holds a run (with every check of ``open``), otherwise create it.

        A run directory that holds no committed rows (a run that failed before doing any work) does not block a
        corrected rerun: its differing manifest is replaced, and the new manifest's ``replaced`` list records what
        differed. With rows, different work is refused as in ``open``."""
        path = Path(out_dir)
        if os.path.lexists(path / MANIFEST_NAME):
            try:
                return cls.open(out_dir, kind=kind, model_name=model_name, checkpoint_path=checkpoint_path,
                                args=args, seeds=seeds, sources=sources, split=split)
            except WorkDiffers as err:
                if cls.holds_rows(path):
                    raise
                replaced = [{"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                             "differed": err.diffs}]
                return cls._write_new(path, kind=kind, model_name=model_name, checkpoint_path=checkpoint_path,
                                      args=args, seeds=seeds, sources=sources, split=split, extra=extra,
                                      replaced=replaced)
        return cls.create(out_dir, kind=kind, model_name=model_name, checkpoint_path=checkpoint_path, args=args,
                          seeds=seeds, sources=sources, split=split, extra=extra)

    @staticmethod
    def holds_rows(path) -> bool:
        """Whether any row log (``*.jsonl``) in ``path`` holds a committed row, i.e. some work was done."""
        return any(len(RowLog(f)) > 0 for f in Path(path).glob("*.jsonl"))

    # -- outputs ------------------------------------------------------------------------------------------------

    def table(self, name: str, key: Optional[Sequence[str]] = None) -> RowLog:
        """The append-only row log ``<out>/<name>.jsonl``; ``key`` names the columns that identify a unit of work."""
        return RowLog(self.path / f"{_check_name('table', name)}.jsonl", key=key)

    def write_table(self, name: str, frame: pd.DataFrame) -> dict[str, Path]:
        """Write a finished table as ``<name>.csv`` and ``<name>.parquet`` (pyarrow), each atomically."""
        if not isinstance(frame, pd.DataFrame):
            raise ValueError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
        _check_name("table", name)
        out = {"csv": self.path / f"{name}.csv", "parquet": self.path / f"{name}.parquet"}
        parquet = io.BytesIO()
        frame.to_parquet(parquet, engine="pyarrow", index=False)
        csv = frame.to_csv(index=False)
        for path in out.values():
            check_output(path)        # both refused before either is written
        write_output(out["csv"], csv)
        write_output(out["parquet"], parquet.getvalue())
        return out

    def figure_path(self, name: str) -> Path:
        """``<out>/figures/<name>`` without a suffix; the plotting functions add .png and .svg."""
        stem = _check_name("figure", name)
        if stem.endswith((".png", ".svg")):
            stem = stem[:-4]
        return output_dir(self.path / "figures") / stem

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r}, kind={self.manifest.get('kind')!r})"


def check_run_dir(run_dir, where: str) -> None:
    """run_dir, where a function takes one: None or a RunDir (a path string would be written as if it were one)."""
    if run_dir is not None and not isinstance(run_dir, RunDir):
        raise TypeError(f"{where}: run_dir must be a RunDir or None, got {type(run_dir).__name__} {run_dir!r}; open "
                        "one with RunDir.create_or_open(path, kind=..., model_name=...)")


# --------------------------------------------------------------------------------------------------------------
# Input run directories (--from-scan and the like)
# --------------------------------------------------------------------------------------------------------------


def check_input_run(path, *, option: str, kinds: Sequence[str], tables: Mapping[str, Sequence[str]],
                    checkpoint: Optional[str] = None) -> dict:
    """A finished run directory given as input (e.g. ``--from-scan``): its manifest's kind must be one of `kinds`,
    it must record a checkpoint hash (and equal `checkpoint`, a hash, when given), and each CSV table must exist
    with its required columns. Raises ValueError with one line naming what is missing and the fix; returns the
    manifest."""
    path = Path(path)
    make = kinds[0]
    fix = f"pass the --out directory of a finished `recurscope {make}` run"
    if not path.is_dir():
        raise ValueError(f"{option} {path}: no such directory; {fix}")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ValueError(f"{option} {path} has no {MANIFEST_NAME}: it is not a result directory; {fix}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if not isinstance(manifest, dict):
        raise ValueError(f"{option} {path}: {manifest_path} is not a JSON object (damaged); {fix}")
    if manifest.get("kind") not in kinds:
        raise ValueError(f"{option} {path} holds a {manifest.get('kind')!r} run, not a {' or '.join(kinds)} run; {fix}")
    recorded = manifest.get("checkpoint_hash")
    if not isinstance(recorded, str) or not recorded.startswith("sha256:"):
        raise ValueError(f"{option} {path}: its {MANIFEST_NAME} records no checkpoint_hash, so it cannot be checked "
                         f"against the model; rerun `recurscope {make}` on this checkpoint and pass its --out")
    if checkpoint is not None and recorded != checkpoint:
        raise ValueError(f"{option} {path} was made on another model ({manifest.get('model_name')}, "
                         f"{recorded[:19]}...) than the one loaded ({checkpoint[:19]}...); use the checkpoint it was "
                         f"made on or rerun `recurscope {make}` on this one")
    for name, columns in tables.items():
        table = path / f"{name}.csv"
        if not table.is_file():
            raise ValueError(f"{option} {path} lacks {table.name} (the run did not finish); rerun the same "
                             f"`recurscope {make}` command to finish it")
        try:
            header = list(pd.read_csv(table, nrows=0).columns)
        except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as err:
            raise ValueError(f"{option} {path}: {table.name} is not a readable CSV table ({type(err).__name__}); "
                             f"rerun `recurscope {make}` to rewrite it") from None
        absent = [c for c in columns if c not in header]
        if absent:
            raise ValueError(f"{option} {path}: {table.name} lacks the column(s) {absent}; it is not a {make} "
                             f"table: {fix}")
    return manifest


# --------------------------------------------------------------------------------------------------------------
# One writer per run directory
# --------------------------------------------------------------------------------------------------------------

LOCK_NAME = ".recurscope.lock"


class RunLocked(ValueError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive flock on ``<out>/.recurscope.lock`` for the life of a run, so a second process on the same
    directory is refused at once (naming the holder's pid) instead of writing duplicate rows beside it. The OS
    releases the lock when its process dies, so a lock file left by a killed run never blocks a rerun.

    Result directories nest (a `run` writes its scan in ``<out>/scan`` and its confirmation in ``<out>/confirm``):
    ``nested`` names the subdirectories locked with the directory, and a directory inside one that another process
    holds is refused too, so `scan --out X/scan` beside `run --out X` is refused whichever starts first."""

    def __init__(self, out_dir, nested: Sequence[str] = ()):
        self.path = Path(out_dir) / LOCK_NAME
        self.nested = tuple(nested)
        self.fd: Optional[int] = None
        self.fds: list[int] = []
        self.created: list[Path] = []    # nested directories this lock made (removed again if nothing else lands)

    @staticmethod
    def _holder(fd: int) -> str:
        return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"

    def _lock(self, directory: Path) -> int:
        output_dir(directory)
        fd = open_regular(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise RunLocked(f"{directory} is in use by another recurscope process (pid {holder}); wait for it to "
                            "finish or use another --out directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _check_enclosing(self, directory: Path) -> None:
        """No enclosing directory is a result directory that another process holds."""
        for parent in directory.resolve().parents:
            lock = parent / LOCK_NAME
            if not os.path.lexists(lock):
                continue
            try:
                fd = open_regular(lock)
            except (OSError, ValueError):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._holder(fd)
                raise RunLocked(f"{directory} lies inside {parent}, which another recurscope process (pid {holder}) "
                                "is writing (a run's scan/ and confirm/ are locked with it); wait for it to finish or "
                                "use an --out outside it") from None
            finally:
                os.close(fd)

    def acquire(self) -> "RunLock":
        directory = self.path.parent
        self._check_enclosing(directory)
        try:
            self.fds.append(self._lock(directory))
            for name in self.nested:
                if not os.path.lexists(directory / name):
                    self.created.append(directory / name)
                self.fds.append(self._lock(directory / name))
        except BaseException:
            self.release()
            raise
        self.fd = self.fds[0]
        return self

    def release(self) -> None:
        # A nested directory the lock made and the run never wrote into (a `run` stopped at the gate writes no
        # confirm/) goes again, so the directory holds only what the run wrote; removed while still locked.
        for folder in self.created:
            try:
                if [entry.name for entry in folder.iterdir()] == [LOCK_NAME]:
                    (folder / LOCK_NAME).unlink()
                    folder.rmdir()
            except OSError:
                pass
        self.created = []
        for fd in reversed(self.fds):
            os.close(fd)    # closing releases the flock; the file stays (harmless: the lock is the flock)
        self.fds = []
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------------------
# An --out directory: empty, or a result directory of the kind about to be written
# --------------------------------------------------------------------------------------------------------------

#: what a `run` writes beside its nested result directories (the report and the two figures it copies)
RUN_FILES = ("report.md", "scan_heatmap.png", "effects.png")
#: a `run`'s nested result directories and their kinds
RUN_NESTED = {"scan": "scan", "confirm": "confirm"}
_SCRATCH_RE = re.compile(r"^(\.recurscope\.lock|\..+\.tmp\d+|\.recurscope-write-check-\d+)$")


def _entries(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not _SCRATCH_RE.match(n))


def _refuse_specials(path: Path, recursive: bool) -> None:
    """Links, FIFOs, devices and sockets anywhere in a result directory: refused, since outputs go there."""
    for name in sorted(os.listdir(path)):
        entry = path / name
        mode = os.lstat(entry).st_mode
        if stat.S_ISDIR(mode):
            if recursive:
                _refuse_specials(entry, recursive)
        elif not stat.S_ISREG(mode):
            raise _refuse(entry, mode)


def check_out_dir(out, kind: str) -> None:
    """Refuses an --out that holds anything recurscope did not create: it must be absent, empty, or a result
    directory of the same kind (its manifest.json says `kind`; a `run`'s holds its report and its scan/ and confirm/
    result directories). A link, FIFO or device in it is refused by name; so are row logs without a manifest (what
    they were computed with cannot be checked). Raises OutputRefused with one line naming the first foreign file."""
    out = Path(out)
    try:
        mode = os.lstat(out).st_mode
    except OSError:       # absent, under a file, unreadable: the CLI's writability check words these
        return
    if stat.S_ISLNK(mode):
        raise OutputRefused(f"--out {out} is a symbolic link (to {os.readlink(out)}); recurscope writes only into "
                            f"real directories, never through a link: pass --out {os.path.realpath(out)}")
    if not stat.S_ISDIR(mode):
        raise OutputRefused(f"--out {out} is {file_kind(mode)}, not a directory; use a fresh folder, e.g. "
                            f"--out {out}-{kind}")
    entries = _entries(out)
    fresh = f"use a fresh folder, e.g. --out {out / ('recurscope-' + kind)}"
    if not entries:
        _refuse_specials(out, recursive=False)      # a planted lock-file link, say
        return
    if kind == "run":
        _refuse_specials(out, recursive=False)
        # the report and figures are a run's only beside the scan it ran (scan/manifest.json)
        ran = os.path.isfile(out / "scan" / MANIFEST_NAME) and not os.path.islink(out / "scan")
        for name in entries:
            entry = out / name
            if name in RUN_NESTED and entry.is_dir():
                check_out_dir(entry, RUN_NESTED[name])
            elif name not in RUN_FILES or not ran:
                raise OutputRefused(f"--out {out} holds {entry}, which recurscope did not create: it is not the "
                                    f"result directory of a `recurscope run`, and recurscope never overwrites files "
                                    f"it did not create; {fresh}")
        return
    manifest_path = out / MANIFEST_NAME
    if os.path.lexists(manifest_path):
        manifest_mode = os.lstat(manifest_path).st_mode
        if not stat.S_ISREG(manifest_mode):
            raise _refuse(manifest_path, manifest_mode)
        try:
            manifest = json.loads(read_regular_bytes(manifest_path).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            manifest = None
        recorded = manifest.get("kind") if isinstance(manifest, dict) else None
        if recorded == kind:
            _refuse_specials(out, recursive=True)
            return
        what = (f"holds a {recorded!r} run, not a {kind} run" if isinstance(recorded, str) else
                f"has a {MANIFEST_NAME} that is not a recurscope manifest (recurscope did not write it)")
        raise OutputRefused(f"--out {out} {what}; recurscope never overwrites files it did not create: {fresh}")
    _refuse_specials(out, recursive=False)
    logs = [n for n in entries if n.endswith(".jsonl")]
    if logs:
        raise OutputRefused(f"--out {out} holds the row log {logs[0]} but no {MANIFEST_NAME}, so what its rows were "
                            "computed with (model, seed, layout) cannot be checked and they are not reused; restore "
                            f"its {MANIFEST_NAME}, or {fresh}")
    raise OutputRefused(f"--out {out} holds {out / entries[0]}" + (f" and {len(entries) - 1} more" if len(entries) > 1
                        else "") + f", which recurscope did not create: it is not a {kind} result directory, and "
                        f"recurscope never overwrites files it did not create; {fresh}")
