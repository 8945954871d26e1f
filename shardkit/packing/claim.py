"""The claim on a pack destination: at most one pack writes under it at a time.

Shard and fragment names are a function of the plan, so two packs writing under one
destination overwrite each other's objects, and whichever commits would point at shards the
other replaced. A pack therefore holds ``_pack/plan.json`` while it writes: its plan and
settings, a token of its own, where it runs (host, pid) and a heartbeat time that a daemon
thread refreshes every :data:`HEARTBEAT_SECONDS`.

A claim is *live* while its heartbeat is younger than :data:`STALE_SECONDS`, unless it is
known to be over: its pack ended with an error (``ended``), or it runs on this machine and its
process is gone (then no wait is needed after a kill -9). A live claim is never taken, whatever
the settings or ``overwrite``. A claim that is not live may be taken over by a pack of the same
plan (which resumes it) or, with ``overwrite``, by any pack. Taking over is create-only: the
taker first creates ``_pack/takeover-<digest of the claim it read>``, so of two packs taking
over the same claim at once exactly one goes on.

The holder checks that the claim still carries its token before each task and before it
commits, so a pack whose claim was taken over (it stalled past STALE_SECONDS) stops instead
of committing over shards it no longer owns. The checks are a read then a write, not a
compare-and-swap (S3 offers none for this), so they assume clocks agree within STALE_SECONDS
and that a pack does not stall longer than that between a check and its next write.

``shardkit index`` takes the same claim (plan :data:`INDEX_PLAN`), so of two index runs of one
folder, or an index and a pack, exactly one writes there. Creating a claim or a takeover record
is idempotent (:func:`~shardkit.packing.create_once.create_once`): a create whose answer was
lost and that was retried finds its own claim, not another pack's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from shardkit.util.procs import pid_alive
from shardkit.errors import DatasetExistsError, ShardkitError, StorageError
from shardkit.packing.create_once import create_once
from shardkit.storage.store import Store

__all__ = ["CLAIM", "HEARTBEAT_SECONDS", "INDEX_PLAN", "STALE_SECONDS", "TAKEOVER_PREFIX", "Claim"]

log = logging.getLogger(__name__)

CLAIM = "_pack/plan.json"
TAKEOVER_PREFIX = "_pack/takeover-"
#: The plan id of ``shardkit index``'s claim: every index of a folder is the same "plan".
INDEX_PLAN = "index"
HEARTBEAT_SECONDS = 30.0
# Five missed heartbeats: a refresh may sit in storage retries for a while without its pack
# being dead.
STALE_SECONDS = 150.0


def _machine() -> str | None:
    """This kernel boot and pid namespace: claims that carry the same value can check each
    other's pid. None where that cannot be known (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _process_gone(pid: int) -> bool:
    if not pid_alive(pid):
        return True
    try:  # a killed child its parent has not reaped yet still answers kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _differs(then: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """What differs between a claim's settings and ours, for the refusal message."""
    now = json.loads(json.dumps(now, default=str))  # comparable with the JSON read back
    if then is None:
        return "input or settings"
    if then != now:
        return "settings: " + ", ".join(f"{k} {then.get(k)!r} then, {now.get(k)!r} now"
                                        for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k))
    return "input: the source's files changed"


class Claim:
    """This pack's hold on ``store``: :meth:`take` it, :meth:`check` it, :meth:`release` it.

    Args:
        store: the destination.
        plan_id: the pack's plan fingerprint (a pack of the same plan may resume this one).
        settings: the pack's settings, recorded to say what differs when another pack is refused.
        kind: what holds the claim, for messages: ``"pack"`` or ``"index"``.
    """

    def __init__(self, store: Store, plan_id: str, settings: dict[str, Any], kind: str = "pack") -> None:
        self.store = store
        self.kind = kind
        self.plan_id = plan_id
        self.settings = settings
        self.token = uuid.uuid4().hex
        self.started = time.time()
        self.resumed = False  # took over an unfinished pack of the same plan: its finished tasks are kept
        # Created the claim rather than taking one over: no earlier shardkit pack left a plan
        # here, so nothing under shards/ or manifest/ can be an unfinished pack's to sweep.
        self.fresh = False
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, ended: float | None = None) -> bytes:
        return json.dumps({"plan_id": self.plan_id, "token": self.token, "started": self.started,
                           "heartbeat": time.time(), "ended": ended, "host": socket.gethostname(),
                           "pid": os.getpid(), "machine": _machine(), "settings": self.settings},
                          sort_keys=True, default=str).encode()

    def _read(self) -> tuple[bytes, dict[str, Any]] | None:
        """The claim as stored (raw and parsed), None if there is none."""
        for _ in range(5):
            try:
                raw = self.store.read_bytes(CLAIM)
            except StorageError:
                self.store.fs.invalidate_cache(self.store.path("_pack"))
                if not self.store.exists(CLAIM):
                    return None
                raise
            try:
                claim = json.loads(raw)
                if isinstance(claim, dict):
                    return raw, claim
            except ValueError:
                pass
            time.sleep(0.05)  # a local file caught halfway through a rewrite
        raise DatasetExistsError(f"{self.store.url_of(CLAIM)} is not a pack claim shardkit can read; "
                                 "remove it if no pack is writing there")

    # ---------------------------------------------------------------- taking

    def take(self, overwrite: bool) -> None:
        """Claim the destination, and start refreshing the claim's heartbeat.

        Sets :attr:`resumed` when the claim taken over was of the same plan (its finished tasks
        are worth keeping); after any other takeover the caller removes what that pack wrote.
        Sets :attr:`fresh` when there was no claim to take over (no unfinished pack here).

        Args:
            overwrite: a claim of another plan that is no longer live may be taken over.

        Raises:
            DatasetExistsError: saying who holds the destination and what to do: a live claim,
                a claim of another plan (without ``overwrite``), or a race with other packs.
        """
        for _ in range(5):
            try:
                create_once(self.store, CLAIM, self._body())
                self.fresh = True
                break
            except DatasetExistsError:
                pass
            found = self._read()
            if found is None:
                continue  # released (committed) between the two calls: try again
            if self._take_over(*found, overwrite):
                break
        else:
            raise DatasetExistsError(f"{self.store.url}: could not claim {CLAIM}, other packs keep taking and "
                                     "releasing it; run one pack at a time")
        self._thread = threading.Thread(target=self._beat, name=f"shardkit-claim-{self.token[:8]}", daemon=True)
        self._thread.start()

    def _take_over(self, raw: bytes, claim: dict[str, Any], overwrite: bool) -> bool:
        url = self.store.url
        same = claim.get("plan_id") == self.plan_id
        live, activity = self._liveness(claim)
        if claim.get("plan_id") == INDEX_PLAN and not same:
            # An index's tars are the user's own: no pack deletes or mixes with them, --overwrite neither.
            hint = "wait for it to finish" if live else "rerun `shardkit index` there to finish it"
            raise DatasetExistsError(f"{url} is being indexed by `shardkit index` ({activity}); a pack there would "
                                     f"delete or mix with those tars (--overwrite too): pack to another prefix, or {hint}")
        if self.kind == "index" and not same:
            hint = "wait for it to finish" if live else "rerun that pack to finish it, or remove it"
            raise DatasetExistsError(f"{url} holds an unfinished pack ({self.store.url_of(CLAIM)}: plan "
                                     f"{claim.get('plan_id')}, {activity}); {hint} before indexing there")
        if not same and not overwrite:
            what = _differs(claim.get("settings"), self.settings)
            started = _when(claim.get("started") or 0)
            hint = ("wait for it to finish" if live else
                    "rerun with --overwrite to discard it, or rerun it as it was to finish it")
            raise DatasetExistsError(f"{url} holds an unfinished pack (plan {claim.get('plan_id')}, started {started}, "
                                     f"{activity}) with other {what}; {hint}")
        if live:
            age = time.time() - self._heartbeat(claim)
            doing = "indexed by another `shardkit index`" if same and self.kind == "index" else "packed by another pack"
            raise DatasetExistsError(
                f"{url} is being {doing}{' of the same input' if same and self.kind == 'pack' else ''} ({activity}); "
                f"wait for it to finish, or if it is dead, rerun in {max(1, int(STALE_SECONDS - age + 1))}s, when "
                f"its claim goes stale (or remove {self.store.url_of(CLAIM)} if you are sure no pack is writing there)")
        marker = TAKEOVER_PREFIX + hashlib.sha256(raw).hexdigest()[:16]
        try:
            create_once(self.store, marker, self._body())
        except DatasetExistsError:
            raise DatasetExistsError(
                f"{url}: another pack is taking over the unfinished pack there at this moment ({activity}); "
                f"run one pack at a time (if none is running, remove {self.store.url_of('_pack')} and rerun)") from None
        self.store.put_bytes(CLAIM, self._body())
        log.info("%s: took over the claim of plan %s (%s)", url, claim.get("plan_id"), activity)
        self.resumed = same
        return True

    @staticmethod
    def _heartbeat(claim: dict[str, Any]) -> float:
        # Claims written before heartbeats existed carry only their start time.
        return float(claim.get("heartbeat") or claim.get("started") or 0)

    def _liveness(self, claim: dict[str, Any]) -> tuple[bool, str]:
        """(whether the claim's pack may still be writing, a phrase saying what we know)."""
        where = f"on {claim.get('host', '?')}, pid {claim.get('pid', '?')}"
        if claim.get("ended"):
            return False, f"it stopped at {_when(float(claim['ended']))} {where}"
        pid = claim.get("pid")
        machine = _machine()
        if (machine is not None and claim.get("machine") == machine and isinstance(pid, int)
                and pid != os.getpid() and _process_gone(pid)):
            return False, f"its process is gone: was {where}"
        age = time.time() - self._heartbeat(claim)
        return age < STALE_SECONDS, f"last active {max(0, int(age))}s ago {where}"

    # ---------------------------------------------------------------- holding

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                found = self._read()
                if found is None or found[1].get("token") != self.token:
                    self._lost = self._taken_by(found)
                    return
                self.store.put_bytes(CLAIM, self._body())
            except ShardkitError as exc:  # the next beat tries again; the pack's own writes will fail loudly
                log.warning("%s: could not refresh the claim %s: %s", self.store.url, CLAIM, exc)

    def _taken_by(self, found: tuple[bytes, dict[str, Any]] | None) -> str:
        if found is None:
            return "its claim is gone (another pack took over and committed or released it)"
        other = found[1]
        return f"its claim now belongs to plan {other.get('plan_id')} on {other.get('host', '?')}, pid {other.get('pid', '?')}"

    def check(self) -> None:
        """Check the claim still carries this pack's token.

        Raises:
            DatasetExistsError: another pack took the destination over.
        """
        if self._lost is None:
            found = self._read()
            if found is None or found[1].get("token") != self.token:
                self._lost = self._taken_by(found)
        if self._lost is not None:
            raise DatasetExistsError(f"{self.store.url}: another pack took over this destination while this "
                                     f"{self.kind} ran ({self._lost}); this {self.kind} stopped without committing")

    def drop(self) -> None:
        """Stop the heartbeat and remove the claim (if still ours): this pack writes nothing."""
        self._stop_beat()
        if self._lost is None:
            found = self._read()
            if found is not None and found[1].get("token") == self.token:
                self.store.remove(CLAIM)
        self._lost = "dropped"

    def _stop_beat(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def release(self, ended: bool) -> None:
        """Stop the heartbeat.

        Args:
            ended: the pack failed: mark the claim as over, if it is still ours, so a rerun need
                not wait for it to go stale; the claim is kept, so the rerun resumes the plan or
                is told what differs.
        """
        self._stop_beat()
        if not ended or self._lost is not None:
            return
        try:
            found = self._read()
            if found is not None and found[1].get("token") == self.token:
                self.store.put_bytes(CLAIM, self._body(ended=time.time()))
        except ShardkitError as exc:  # the claim then goes stale by itself
            log.warning("%s: could not mark the claim %s as ended: %s", self.store.url, CLAIM, exc)
