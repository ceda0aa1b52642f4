"""Tuning database: the schedule chosen for a kernel on a device, so a second compile skips the search.

One SQLite file, one row per key (kernel structure hash, shapes, dtype, backend, device
fingerprint) holding the chosen schedule (JSON), its measured time and free-form metadata.
A CI job per hardware can tune once and ship the file; `merge` combines files and keeps the
faster entry for each key.

The file is marked as eclat's with SQLite's application_id and carries a schema version in
user_version: a file that is not SQLite, another program's SQLite file, or one written by a
newer eclat is refused with a TuningDBError naming the problem (or, with on_error="warn",
replaced by an in-memory database after a warning, so that compiling still works).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import sqlite3
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EclatError
from .cache import cache_dir

SCHEMA_VERSION = 1
APPLICATION_ID = 0x45434C54  # "ECLT": marks the file as an eclat tuning database
DEFAULT_NAME = "tuning.db"
KEY_COLUMNS = ("kernel", "shapes", "dtype", "backend", "device")
_KEYS = ", ".join(KEY_COLUMNS)
_SCHEMA = """
CREATE TABLE tuning (
    kernel TEXT NOT NULL, shapes TEXT NOT NULL, dtype TEXT NOT NULL, backend TEXT NOT NULL,
    device TEXT NOT NULL,
    schedule TEXT NOT NULL, measured_us REAL NOT NULL, meta TEXT NOT NULL, updated REAL NOT NULL,
    PRIMARY KEY (kernel, shapes, dtype, backend, device)
)"""


class TuningDBError(EclatError):
    """A tuning database file cannot be used; the message names the file and the reason."""


def shapes_text(shapes: Any) -> str:
    """Canonical text of shapes: nested sequences of ints (numpy ints too) and symbolic sizes (by str)."""
    def norm(x: Any) -> Any:
        if isinstance(x, numbers.Integral):
            return int(x)
        if isinstance(x, list | tuple):
            return [norm(v) for v in x]
        return str(x)

    return shapes if isinstance(shapes, str) else json.dumps(norm(shapes), separators=(",", ":"))


def schedule_json(schedule: Any) -> str:
    """Canonical JSON of a schedule: a dict, or a dataclass such as compiler.kernel.Schedule.

    Tuples become lists, so a schedule read back from the database (a dict of lists) has the
    same text as the dataclass it was stored from: compare schedules by this text.
    """
    if dataclasses.is_dataclass(schedule) and not isinstance(schedule, type):
        schedule = dataclasses.asdict(schedule)
    try:
        return json.dumps(schedule, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"a schedule must be JSON-serialisable: {e}") from None


@dataclass(frozen=True)
class TuningKey:
    """What a tuned schedule is valid for. shapes is canonical text (see TuningKey.make)."""

    kernel: str  # hash of the kernel's structure (the compiler defines it)
    shapes: str
    dtype: str
    backend: str  # "cpu", "opencl", "cuda", "metal"
    device: str  # Device.fingerprint

    @classmethod
    def make(cls, kernel: str, shapes: Any, dtype: Any, backend: str, device: str) -> TuningKey:
        """Build a key from shapes as nested tuples and any dtype with a name (DType, numpy, str)."""
        dtype_name = getattr(dtype, "name", str(dtype))
        return cls(str(kernel), shapes_text(shapes), dtype_name, str(backend), str(device))


@dataclass(frozen=True)
class Entry:
    key: TuningKey
    schedule: dict[str, Any]  # as JSON gives it back: a dataclass schedule comes back as a dict of lists
    measured_us: float
    meta: dict[str, Any] = field(default_factory=dict)
    updated: float = 0.0  # unix time of the measurement


class TuningDB:
    """A tuning database file (default <cache_dir>/tuning.db).

    get/put count hits and misses in .hits and .misses. on_error="raise" (default) raises
    TuningDBError for an unusable file; "warn" warns and works in memory instead.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, cache: str | os.PathLike | None = None,
                 on_error: str = "raise", readonly: bool = False):
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        self.path = Path(path) if path is not None else cache_dir(cache) / DEFAULT_NAME
        self.readonly = readonly
        self.hits = self.misses = 0
        try:
            self._conn = self._open()
        except TuningDBError as e:
            if on_error == "raise":
                raise
            warnings.warn(f"{e}; tuning results will not be kept", stacklevel=2)
            self.path, self.readonly = Path(":memory:"), False
            self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        where = str(self.path)
        if where != ":memory:":
            if self.path.is_dir():
                raise TuningDBError(f"tuning database {where} is a directory, not a file")
            if self.readonly and not self.path.exists():
                raise TuningDBError(f"tuning database {where} does not exist")
            if not self.readonly:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise TuningDBError(f"cannot create the folder of tuning database {where}: {e}") from None
        try:
            uri = f"file:{self.path.resolve()}?mode=ro" if self.readonly else where
            conn = sqlite3.connect(uri, uri=self.readonly, timeout=30, isolation_level=None)
        except sqlite3.Error as e:
            raise TuningDBError(f"cannot open tuning database {where}: {e}") from None
        try:
            # a cache, not a ledger: an OS crash may lose or corrupt it (then refused clearly), an
            # application crash cannot; without fsync per put, tuning a model writes in microseconds
            conn.execute("PRAGMA synchronous = OFF")
            self._check_or_create(conn)
        except sqlite3.DatabaseError as e:
            conn.close()
            raise TuningDBError(f"{where} is not a usable tuning database: {e}") from None
        except TuningDBError:
            conn.close()
            raise
        return conn

    def _check_or_create(self, conn: sqlite3.Connection) -> None:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        if app_id == 0 and not tables:  # a new (or empty) file: make it ours
            if self.readonly:
                raise TuningDBError(f"{self.path} is empty, not an eclat tuning database")
            with conn:
                conn.execute("BEGIN")
                conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return
        if app_id != APPLICATION_ID:
            raise TuningDBError(f"{self.path} is an SQLite database of another program (tables: "
                                f"{', '.join(tables) or 'none'}), not an eclat tuning database")
        if version > SCHEMA_VERSION:
            raise TuningDBError(f"{self.path} was written by a newer eclat (schema {version}; this eclat "
                                f"reads schema {SCHEMA_VERSION}): upgrade eclat or use another file")
        if version != SCHEMA_VERSION or "tuning" not in tables:
            raise TuningDBError(f"{self.path} has an unknown eclat schema (version {version})")

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as e:
            raise TuningDBError(f"tuning database {self.path}: {e}") from None

    # -- public API ---------------------------------------------------------------------------

    def get(self, key: TuningKey) -> Entry | None:
        """The entry for key, or None; counts a hit or a miss."""
        rows = self._query("SELECT schedule, measured_us, meta, updated FROM tuning WHERE kernel = ? AND "
                           "shapes = ? AND dtype = ? AND backend = ? AND device = ?", _key_tuple(key))
        entry = _entry(key, rows[0]) if rows else None
        if entry is None:  # none, or a damaged row: tuned again, and overwritten
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def put(self, key: TuningKey, schedule: Any, measured_us: float,
            meta: dict[str, Any] | None = None, *, keep_faster: bool = False) -> None:
        """Record schedule (a dict or dataclass, see schedule_json) for key.

        keep_faster: leave an existing faster entry in place.
        """
        if not measured_us >= 0:  # also refuses NaN
            raise ValueError(f"measured_us must be a time >= 0, got {measured_us}")
        text = schedule_json(schedule)
        try:
            meta_text = json.dumps(meta or {}, sort_keys=True)
        except TypeError as e:
            raise ValueError(f"meta must be JSON-serialisable: {e}") from None
        self._upsert([(*_key_tuple(key), text, float(measured_us), meta_text, time.time())], keep_faster)

    def _upsert(self, rows: list[tuple], keep_faster: bool) -> None:
        cond = "WHERE excluded.measured_us < tuning.measured_us" if keep_faster else ""
        sql = (f"INSERT INTO tuning VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT ({_KEYS}) "
               "DO UPDATE SET schedule = excluded.schedule, measured_us = excluded.measured_us, "
               f"meta = excluded.meta, updated = excluded.updated {cond}")
        try:
            with self._conn:
                self._conn.execute("BEGIN IMMEDIATE")
                self._conn.executemany(sql, rows)
        except sqlite3.Error as e:
            raise TuningDBError(f"cannot write tuning database {self.path}: {e}") from None

    def entries(self) -> Iterator[Entry]:
        """Every well-formed entry, in key order."""
        rows = self._query(f"SELECT {_KEYS}, schedule, measured_us, meta, updated FROM tuning "
                           f"ORDER BY {_KEYS}")
        for r in rows:
            entry = _entry(TuningKey(*r[:5]), r[5:])
            if entry is not None:
                yield entry

    def __len__(self) -> int:
        return self._query("SELECT COUNT(*) FROM tuning")[0][0]

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> TuningDB:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TuningDB({str(self.path)!r}, hits={self.hits}, misses={self.misses})"


def _key_tuple(key: TuningKey) -> tuple[str, ...]:
    return tuple(getattr(key, c) for c in KEY_COLUMNS)


def merge(paths: Sequence[str | os.PathLike], out: str | os.PathLike) -> dict[str, int]:
    """Merge tuning databases into out (created, or added to), keeping the faster entry per key.

    Every input is checked before anything is written, so a bad input leaves out untouched.
    Returns {"inputs", "read", "entries"}: files merged, entries read, entries now in out.
    """
    inputs = [TuningDB(p, readonly=True) for p in paths]
    try:
        with TuningDB(out) as target:
            read = 0
            for db in inputs:
                rows = [(*_key_tuple(e.key), json.dumps(e.schedule, sort_keys=True), e.measured_us,
                         json.dumps(e.meta, sort_keys=True), e.updated) for e in db.entries()]
                target._upsert(rows, keep_faster=True)
                read += len(rows)
            return {"inputs": len(inputs), "read": read, "entries": len(target)}
    finally:
        for db in inputs:
            db.close()


def _entry(key: TuningKey, row: tuple) -> Entry | None:
    """A row as an Entry; None when it is not what put writes (a schedule and meta that are JSON
    objects, a time)."""
    schedule, measured_us, meta, updated = row
    try:
        schedule, meta = json.loads(schedule), json.loads(meta)
    except (TypeError, ValueError, RecursionError):  # RecursionError: JSON nested too deep
        return None
    if not (isinstance(schedule, dict) and isinstance(meta, dict) and isinstance(measured_us, (int, float))):
        return None
    return Entry(key, schedule, measured_us, meta, updated)
