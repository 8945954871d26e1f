"""Control directories of killed readers are swept, and nothing else (shardkit.datasets.epoch_control)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from randomds import pack_random
from shardkit.datasets import epoch_control
from shardkit.datasets.epoch_control import ControlDir, sweep_dead_dirs

pytestmark = pytest.mark.timeout(120)

_READER = """
import sys, time
from shardkit import StreamingDataset
sd = StreamingDataset(sys.argv[1], cache_dir=sys.argv[2])
next(iter(sd))
print(sd._control.path, flush=True)
time.sleep(600)
"""


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(10)
    return proc.pid


def read_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    """The child's first line of output, or a failure after ``timeout`` seconds (never a hang)."""
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"no output from the reader in {timeout:.0f} s"
    return box[0].strip()


def test_a_killed_readers_control_directory_is_swept_by_the_next_reader(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a SIGKILLed reader left its /tmp/shardkit-stream-* directory, and nothing swept it.
    url, _ = pack_random(tmp_path, n=20, max_body=2000, classes=2, shard_bytes="20KB", seed=1, prefix="c")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _READER, url, str(tmp_path / "cache")], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        path = read_line(proc)
        assert os.path.isdir(path) and os.path.basename(path).startswith(f"shardkit-stream-{proc.pid}-")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert os.path.isdir(path)  # a killed process removes nothing
    monkeypatch.setattr(epoch_control, "_swept_at", None)
    mine = ControlDir("shardkit-stream-")  # the next reader's first directory sweeps
    assert not os.path.exists(path)
    assert os.path.isdir(mine.path)
    assert mine.path not in sweep_dead_dirs()  # a live owner's stays
    assert os.path.isdir(mine.path)


def test_the_sweep_takes_only_our_directories_of_dead_owners(tmp_path: Path) -> None:
    dead = dead_pid()
    swept = tmp_path / f"shardkit-stream-{dead}-abc12345"
    swept.mkdir()
    (swept / "owner.lock").touch()
    (swept / "control.json").write_text("{}")
    # A dead pid here, but its lock is held: an owner in another pid namespace, alive.
    elsewhere = tmp_path / f"shardkit-wds-{dead}-zzz00000"
    elsewhere.mkdir()
    fd = os.open(elsewhere / "owner.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)
    live = tmp_path / f"shardkit-stream-{os.getppid()}-qqq11111"
    live.mkdir()
    old_style = tmp_path / "shardkit-stream-abcdefgh"  # no owner pid in the name: left alone
    old_style.mkdir()
    other = tmp_path / f"other-{dead}-abc12345"
    other.mkdir()
    link = tmp_path / f"shardkit-stream-{dead}-link0000"
    link.symlink_to(old_style)
    a_file = tmp_path / f"shardkit-stream-{dead}-file0000"
    a_file.write_text("")
    try:
        assert sweep_dead_dirs(str(tmp_path)) == [str(swept)]
    finally:
        os.close(fd)
    assert not swept.exists()
    for kept in (elsewhere, live, old_style, other, link, a_file):
        assert kept.exists()
