"""Run a derivation's independent traces in forked copies of this process (`tracer.derive`).

A derivation traces one reduced model at many sizes, and the traces of a piece do not depend on each other: each
builds its model afresh under its own FakeTensorMode, and only the fit that follows reads them all. Once the first
trace of a piece has decided which sizes the fit needs, the rest are spread over W processes: this one and W - 1
copies made by fork. A copy inherits the imported torch and transformers and FakeTensor's warm dispatch cache, so it
starts in milliseconds, where a fresh interpreter spends seconds importing them.

Job i goes to process i mod W. Each copy sends every result back as one JSON message on a pipe (raw bytes:
`Connection.send_bytes`; nothing is pickled), the parent traces its own share meanwhile and reports progress per
finished trace. A trace that raises in a copy comes back as its exception, raised where the derivation reaches that
size, so a refusal reads as it does in one process (tests/test_forked.py: a profile derived both ways is the same,
byte for byte).

Forking is done only where it is safe: on a platform with fork, from a process with no other Python thread (an app
server's threads may hold locks a copy would inherit held; there the traces run one after another, as they do with
`WILLITFIT_TRACE_WORKERS=1`). The default W is the CPU cores this process may use, at most 8.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from multiprocessing import get_context
from multiprocessing.connection import wait

ENV_VAR = "WILLITFIT_TRACE_WORKERS"
MAX_DEFAULT_WORKERS = 8
MAX_WORKERS = 256
# exceptions a trace raises on purpose (one-line refusals) come back as their own type; anything else as RuntimeError
_KNOWN = {e.__name__: e for e in (ValueError, RuntimeError, NotImplementedError, TypeError, KeyError, AssertionError,
                                  IndexError, ZeroDivisionError, MemoryError)}


def workers() -> int:
    """How many processes trace at once: WILLITFIT_TRACE_WORKERS, else the usable CPU cores (at most 8)."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        n = int(raw) if raw.isdigit() else 0
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"{ENV_VAR}: the number of processes that trace at once, 1..{MAX_WORKERS}; got {raw!r}")
        return n
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_WORKERS))


def why_sequential(n_jobs: int, n_workers: int) -> str | None:
    """Why these jobs run one after another in this process (None: they are forked)."""
    if n_workers < 2:
        return f"{ENV_VAR} is 1" if os.environ.get(ENV_VAR) else "one CPU core"
    if n_jobs < 2:
        return "one trace"
    if not hasattr(os, "fork"):
        return "this platform has no fork"
    if threading.active_count() > 1:
        return "other threads run in this process"
    return None


def run_all(jobs: Sequence[Hashable], trace: Callable, encode: Callable, decode: Callable,
            on_done: Callable[[Hashable, object], None], on_start: Callable[[Hashable], None] | None = None,
            n_workers: int | None = None) -> None:
    """Trace every job, in W processes where `why_sequential` allows, else here one after another.

    `trace(job)` returns a result; `encode(result)` makes it JSON-able and `decode` turns that back (a copy's
    result is decoded, this process's own is used as it is). `on_done(job, result_or_exception)` is called in this
    process once per job, as each finishes (the parent's progress); an exception a trace raised is passed, not
    raised. `on_start(job)` is called before this process traces a job of its own. An exception from either (a
    cancelled derivation) stops every copy and propagates."""
    n = workers() if n_workers is None else n_workers
    jobs = list(jobs)
    if why_sequential(len(jobs), n) is not None:
        for job in jobs:
            if on_start:
                on_start(job)
            on_done(job, _attempt(trace, job))
        return
    n = min(n, len(jobs))
    shares = [jobs[i::n] for i in range(n)]
    for stream in (sys.stdout, sys.stderr):  # a copy flushes its inherited buffers when it exits: empty them first
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass
    ctx = get_context("fork")
    children = []
    try:
        for share in shares[1:]:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(share, trace, encode, send), daemon=True)
            proc.start()
            send.close()
            children.append((proc, recv, share))
        pending = {recv: list(share) for _, recv, share in children}

        def drain(block: bool) -> None:
            ready = wait(list(pending), timeout=None if block else 0)
            for conn in ready:
                try:
                    msg = json.loads(conn.recv_bytes())
                except EOFError:  # the copy died without a word (killed, out of memory)
                    left = pending.pop(conn)
                    for job in left:
                        on_done(job, RuntimeError("trace: a forked tracer process exited before tracing this size "
                                                  f"({ENV_VAR}=1 traces in one process)"))
                    continue
                job = pending[conn].pop(0)
                on_done(job, _rebuild(msg["error"]) if "error" in msg else decode(msg["result"]))
                if not pending[conn]:
                    del pending[conn]

        for job in shares[0]:
            if on_start:
                on_start(job)
            on_done(job, _attempt(trace, job))
            if pending:
                drain(block=False)
        while pending:
            drain(block=True)
    finally:
        for proc, recv, _ in children:
            if proc.is_alive():
                proc.terminate()
            proc.join()
            recv.close()


def _attempt(trace: Callable, job):
    try:
        return trace(job)
    except Exception as e:  # noqa: BLE001 (handed to on_done, which raises it where the derivation reaches it)
        return e


def _child(share, trace, encode, send) -> None:
    """A forked copy: trace each job of its share, send each result (or the exception it raised) as JSON."""
    try:
        import torch

        torch.set_num_threads(1)  # one core per copy; as torch.utils.data's workers do after fork
    except ImportError:
        pass
    try:
        for job in share:
            out = _attempt(trace, job)
            if isinstance(out, Exception):
                msg = {"error": [type(out).__name__, str(out)]}
            else:
                msg = {"result": encode(out)}
            send.send_bytes(json.dumps(msg, separators=(",", ":")).encode())
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C reaches every copy; the parent says what happened
        pass
    finally:
        send.close()


def _rebuild(error: list) -> Exception:
    name, message = error
    kind = _KNOWN.get(name)
    return kind(message) if kind is not None else RuntimeError(f"{name}: {message}")
