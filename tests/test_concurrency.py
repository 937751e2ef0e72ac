"""Several processes on one database file: writers wait for each other, readers never see a lock error.

No timed assertions: the processes run for a few seconds of wall time, and what is checked is what
they saw and what ends up stored.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bench.store import db
from bench.__main__ import main
from rowfactory import make_row

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

N_BATCHES = 4  # the writer's batches of 50 rows; the reader acknowledges each one it has seen
HANDSHAKE_S = 300  # only a guard against a hang (a dead partner), never a measure of anything

WRITER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from bench.store.ingest import ingest_rows
    from rowfactory import make_row
    db_path, sync, n_batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    written = 0
    for k in range(n_batches):
        rows = [make_row(batch=1 + k * 50 + i, seq=64) for i in range(50)]
        report = ingest_rows(rows, db_path)
        assert report.inserted == 50, report
        written += report.inserted
        open(os.path.join(sync, f"committed_{{k}}"), "w").close()
        # the next batch waits until the reader has queried after this commit: they interleave by construction
        deadline = time.monotonic() + {handshake}
        while k < n_batches - 1 and not os.path.exists(os.path.join(sync, f"seen_{{k}}")):
            if time.monotonic() > deadline:
                sys.exit(f"the reader never acknowledged batch {{k}}")
            time.sleep(0.01)
    print(json.dumps({{"written": written, "batches": n_batches}}))
""")

READER = textwrap.dedent("""
    import json, os, sys
    from bench.store.db import query_df, fetch_runs
    db_path, sync, stop_file = sys.argv[1], sys.argv[2], sys.argv[3]
    queries, errors, counts, acked, k = 0, [], [], [], 0
    while True:
        stopping = os.path.exists(stop_file)  # one more query after the writer finished
        committed = os.path.exists(os.path.join(sync, f"committed_{{k}}"))  # checked before the query starts
        try:
            counts.append(int(query_df("summary", db_path=db_path)["n_runs"].sum()))
            fetch_runs({{"mode": "train", "seq": 64}}, db_path, limit=10)
            queries += 1
        except Exception as e:
            errors.append(f"{{type(e).__name__}}: {{e}}")
            counts.append(None)
        if committed and counts[-1] is not None:  # a read that began after commit k and before batch k + 1
            acked.append(counts[-1])
            open(os.path.join(sync, f"seen_{{k}}"), "w").close()
            k += 1
        if stopping:
            break
    counts = [c for c in counts if c is not None]
    print(json.dumps({{"queries": queries, "errors": errors[:5], "n_errors": len(errors), "acked": acked,
                       "monotonic": counts == sorted(counts), "last": counts[-1] if counts else None}}))
""")


def _python(code: str, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_writer_and_reader_processes_at_once(tmp_path):
    """The writer commits N_BATCHES batches and waits, after each, for the reader to acknowledge a query that
    began after that commit; so, however busy the machine, the reader reads between every two batches (the
    property is proved by this handshake, not by how long either runs) and sees each batch whole."""
    path, stop, sync = tmp_path / "busy.duckdb", tmp_path / "stop", tmp_path / "sync"
    sync.mkdir()
    with db.connect(path):  # create it first so the reader's first open is a plain read
        pass
    reader = _python(READER.format(), path, sync, stop)
    writer = _python(WRITER.format(tests=str(TESTS), handshake=HANDSHAKE_S), path, sync, N_BATCHES)
    w_out, w_err = writer.communicate(timeout=2 * HANDSHAKE_S)
    stop.touch()
    r_out, r_err = reader.communicate(timeout=2 * HANDSHAKE_S)
    assert writer.returncode == 0, w_err
    assert reader.returncode == 0, r_err
    wrote, read = json.loads(w_out), json.loads(r_out)
    assert wrote["batches"] == N_BATCHES and wrote["written"] == 50 * N_BATCHES
    # one read after each commit and before the next batch: it saw exactly the committed batches, no partial one
    assert read["acked"][:N_BATCHES - 1] == [50 * (k + 1) for k in range(N_BATCHES - 1)]
    assert read["n_errors"] == 0, read["errors"]   # never locked out while the writer wrote
    assert read["monotonic"]
    assert read["last"] == wrote["written"]
    assert db.count_runs(path) == wrote["written"]  # no lost row


HOLDER = textwrap.dedent("""
    import sys, duckdb
    con = duckdb.connect(sys.argv[1])  # holds the write lock until stdin closes
    print("locked", flush=True)
    sys.stdin.read()
    con.close()
""")


@pytest.fixture
def lock_holder(tmp_path):
    """A separate process holding the database's write lock until `release()`."""
    path = tmp_path / "locked.duckdb"
    with db.connect(path):
        pass
    proc = _python(HOLDER, path, stdin=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "locked"

    def release():
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=60)

    yield path, release
    release()


def test_writer_gives_up_with_database_busy(lock_holder):
    path, _ = lock_holder
    with pytest.raises(db.DatabaseBusy, match=rf"database {path} is busy: another process holds its lock"):
        with db.connect(path, wait_s=0.3):
            pass
    with pytest.raises(db.DatabaseBusy):
        db.query_df("summary", db_path=path, wait_s=0.3)


def test_cli_busy_database_is_one_line_and_exit_2(lock_holder, tmp_path, capsys):
    path, _ = lock_holder
    runs = tmp_path / "runs.jsonl"
    runs.write_text(json.dumps(make_row()) + "\n")
    assert main(["ingest", str(runs), "--db", str(path), "--wait", "0.3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: database {path} is busy")


def test_reader_waits_through_a_brief_writer(lock_holder):
    path, release = lock_holder
    result = {}
    reader = threading.Thread(target=lambda: result.update(df=db.query_df("summary", db_path=path, wait_s=60)))
    reader.start()
    time.sleep(0.3)  # let the reader hit the lock and retry at least once
    assert reader.is_alive()
    release()
    reader.join(timeout=60)
    assert "df" in result and result["df"].empty
