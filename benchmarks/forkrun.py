"""Run benchmark rows each in its own process without paying the imports for every row.

    python -m benchmarks.forkrun MODULE [MODULE ...]

imports the modules once (torch and a loader library take 3-7 s to import on the benchmark
box; a matrix of ~150 rows would spend minutes on it), then reads one JSON job per line on
stdin and runs each in a child forked for it, in its own process group:

    {"id": "...", "call": "benchmarks.matrix_rows:loader_row", "args": {...},
     "env": {...}, "timeout": 300, "log": "/path/row.log"}

and answers one JSON line per job on stdout: ``{"id", "status": "ok", "result": ...}`` or
``{"id", "status": "failed", "reason": "<one line>"}``. A row that raises, crashes (a signal)
or outlives its timeout is that row's failure, never the run's: the child's whole process
group (its DataLoader workers too) is killed by its id. Nothing here starts a thread before a
fork, so the children inherit no lock held by another thread.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

__all__ = ["run_job", "main"]


def _one_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "no output"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _child(job: dict[str, Any], result_path: str) -> None:
    """In the forked child: run the job, write its outcome to ``result_path``, never return."""
    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(job.get("log") or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(job.get("env") or {})
        module, func = job["call"].split(":")
        result = getattr(importlib.import_module(module), func)(job.get("args") or {})
        outcome: dict[str, Any] = {"status": "ok", "result": result}
        code = 0
    except BaseException as exc:  # noqa: BLE001 - the row's failure, said in one line
        traceback.print_exc()
        outcome = {"status": "failed", "reason": _one_line(f"{type(exc).__name__}: {exc}")}
    try:
        with open(result_path, "w") as f:
            json.dump(outcome, f)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)  # no atexit handler of the parent's imports runs twice


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job in a forked child and wait for it (up to its timeout).

    Args:
        job: the job (see the module docstring).

    Returns:
        The reply: the job's id, ``status``, and ``result`` or ``reason``, plus ``seconds``.
    """
    fd, result_path = tempfile.mkstemp(prefix="forkrun-", suffix=".json")
    os.close(fd)
    os.unlink(result_path)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(job, result_path)
    deadline = t0 + float(job.get("timeout") or 600)
    timed_out = False
    status = 0
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            break
        if time.monotonic() > deadline:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):  # what the row left behind (orphaned workers)
        os.killpg(pid, signal.SIGKILL)
    reply: dict[str, Any] = {"id": job.get("id"), "seconds": round(time.monotonic() - t0, 2)}
    try:
        with open(result_path) as f:
            reply.update(json.load(f))
        os.unlink(result_path)
    except (OSError, ValueError):
        if timed_out:
            why = f"timed out after {job.get('timeout')} s"
        elif os.WIFSIGNALED(status):
            why = f"killed by signal {os.WTERMSIG(status)}"
        else:
            why = f"exited {os.WEXITSTATUS(status)} without a result"
        tail = _one_line(_tail(job.get("log") or ""))
        reply.update(status="failed", reason=f"{why}; last log line: {tail}")
    return reply


def main(argv: list[str] | None = None) -> int:
    """Import the modules named in ``argv``, then serve jobs from stdin until it closes."""
    for name in argv if argv is not None else sys.argv[1:]:
        importlib.import_module(name)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print of an import or a row never corrupts the replies
    replies.write(json.dumps({"id": None, "status": "ready", "pid": os.getpid()}) + "\n")
    replies.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        replies.write(json.dumps(run_job(job)) + "\n")
        replies.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
