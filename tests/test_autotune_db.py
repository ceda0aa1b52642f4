"""Tuning database: round trip, keep-faster and merge, and clear refusals of files that are not ours."""

import sqlite3

import numpy as np
import pytest

from eclat.autotune.cache import cache_dir
from eclat.autotune.db import APPLICATION_ID, TuningDB, TuningDBError, TuningKey, merge
from eclat.ir.dtypes import DType

KEY = TuningKey.make("k1", ((2, 3), (3, 4)), "float32", "cpu", "fp")
OTHER = TuningKey.make("k2", ((8,),), "float32", "cpu", "fp")


def test_round_trip_and_counters(tmp_path):
    path = tmp_path / "sub" / "t.db"  # the folder is created
    with TuningDB(path) as db:
        assert db.get(KEY) is None
        db.put(KEY, {"tile": [8, 4], "vec": 8}, 12.5, {"mode": "full"})
        e = db.get(KEY)
        assert (e.schedule, e.measured_us, e.meta) == ({"tile": [8, 4], "vec": 8}, 12.5, {"mode": "full"})
        assert (db.hits, db.misses) == (1, 1)
    with TuningDB(path) as db:  # persisted
        assert db.get(KEY).schedule == {"tile": [8, 4], "vec": 8}
        assert db.get(OTHER) is None and len(db) == 1


def test_key_normalisation():
    assert TuningKey.make("k1", [[np.int64(2), 3], (3, 4)], DType.float32, "cpu", "fp") == KEY
    assert TuningKey.make("k", [("n", 4)], "float32", "cpu", "fp").shapes == '[["n",4]]'


def test_put_overwrites_unless_keep_faster(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        db.put(KEY, {"v": 1}, 10.0)
        db.put(KEY, {"v": 2}, 20.0)
        assert db.get(KEY).schedule == {"v": 2}
        db.put(KEY, {"v": 3}, 30.0, keep_faster=True)
        assert db.get(KEY).schedule == {"v": 2}
        db.put(KEY, {"v": 4}, 5.0, keep_faster=True)
        assert db.get(KEY).measured_us == 5.0


def test_put_rejects_bad_values(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        with pytest.raises(ValueError, match="measured_us"):
            db.put(KEY, {}, float("nan"))
        with pytest.raises(ValueError, match="JSON"):
            db.put(KEY, {"f": object()}, 1.0)


def test_merge_keeps_the_faster_entry(tmp_path):
    a, b, out = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "c.db"
    with TuningDB(a) as db:
        db.put(KEY, {"from": "a"}, 10.0)
        db.put(OTHER, {"from": "a"}, 1.0)
    with TuningDB(b) as db:
        db.put(KEY, {"from": "b"}, 4.0)
        db.put(OTHER, {"from": "b"}, 3.0)
    assert merge([a, b], out) == {"inputs": 2, "read": 4, "entries": 2}
    with TuningDB(out) as db:
        assert (db.get(KEY).schedule, db.get(KEY).measured_us) == ({"from": "b"}, 4.0)
        assert db.get(OTHER).schedule == {"from": "a"}
    assert merge([a], out)["entries"] == 2  # merging into an existing file keeps what is faster there
    with TuningDB(out) as db:
        assert db.get(KEY).schedule == {"from": "b"}


def _junk(path):
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return path


def _foreign(path):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    return path


def _newer(path):
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute("PRAGMA user_version = 99")
    conn.execute("CREATE TABLE tuning (x)")
    conn.commit()
    conn.close()
    return path


@pytest.mark.parametrize("make, match", [
    (_junk, "not a usable tuning database: file is not a database"),
    (_foreign, "another program \\(tables: users\\)"),
    (_newer, "newer eclat \\(schema 99"),
    (lambda p: (p.mkdir(), p)[1], "is a directory"),
])
def test_unusable_files_are_refused(tmp_path, make, match):
    path = make(tmp_path / "bad.db")
    with pytest.raises(TuningDBError, match=match):
        TuningDB(path)
    with pytest.warns(UserWarning, match=match):
        db = TuningDB(path, on_error="warn")
    db.put(KEY, {"v": 1}, 1.0)  # still works, in memory
    assert db.get(KEY).schedule == {"v": 1}


def test_foreign_file_is_left_untouched(tmp_path):
    path = _foreign(tmp_path / "users.db")
    before = path.read_bytes()
    with pytest.raises(TuningDBError):
        TuningDB(path)
    assert path.read_bytes() == before


def test_truncated_database_gives_clear_error(tmp_path):
    path = tmp_path / "t.db"
    with TuningDB(path) as db:
        for i in range(300):
            db.put(TuningKey.make(f"k{i}", [[i]], "float32", "cpu", "fp"), {"pad": "x" * 200}, float(i))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(TuningDBError, match="t.db"):
        with TuningDB(path) as db:
            list(db.entries())


def test_merge_refuses_a_bad_input_before_writing(tmp_path):
    good = tmp_path / "good.db"
    TuningDB(good).close()
    out = tmp_path / "out.db"
    with pytest.raises(TuningDBError, match="junk.db"):
        merge([good, _junk(tmp_path / "junk.db")], out)
    with pytest.raises(TuningDBError, match="does not exist"):
        merge([tmp_path / "missing.db"], out)
    assert not out.exists()


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir(tmp_path / "given") == tmp_path / "given"
    assert cache_dir() == tmp_path / "env"
    monkeypatch.delenv("ECLAT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "eclat"
    with TuningDB(cache=tmp_path / "c") as db:
        assert db.path == tmp_path / "c" / "tuning.db" and db.path.exists()
