"""One driver per run folder: a lock file with its owner and a heartbeat.

Two drivers on the same ``{storage_path}/{name}`` (a job submitted twice) would write
checkpoints into one folder and resume from each other's parts. ``fit`` takes this lock
before Ray is connected and releases it in ``finally``. The lock file
``{run}/.raytrain-mgpu.lock`` names the owner (host, pid, Ray job id) and a heartbeat time
refreshed every ``HEARTBEAT_S``; a lock whose heartbeat is older than ``STALE_S``, or whose
owner process on this host is gone, is stale (its driver was killed) and is taken over
with a warning. On a local or mounted folder the lock is created atomically (O_EXCL);
on a bucket (no atomic create) a second driver is still refused once the first has
written its lock, which leaves a window of one round trip.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import List, Optional

from raytrain_mgpu.config.redact import redact
from raytrain_mgpu.checkpointing.files import filesystem

logger = logging.getLogger(__name__)

__all__ = ["RunLock", "LOCK_FILE", "other_live_owner", "remove_stale_temporaries"]

LOCK_FILE = ".raytrain-mgpu.lock"
HEARTBEAT_S = 30.0
STALE_S = 120.0


class RunLock:
    """``RunLock.acquire(run_path)`` ... ``lock.release()``."""

    def __init__(self, run_path: str):
        self.run_path = run_path
        self.fs, self.folder = filesystem(run_path)
        self.path = f"{self.folder.rstrip('/')}/{LOCK_FILE}"
        self.local = "://" not in run_path
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, run_path: str) -> "RunLock":
        lock = cls(run_path)
        lock._take()
        lock._thread = threading.Thread(target=lock._beat, name="raytrain-mgpu-run-lock", daemon=True)
        lock._thread.start()
        return lock

    def owner(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                "job_id": os.environ.get("RAY_JOB_SUBMISSION_ID") or os.environ.get("RAY_JOB_ID"),
                "heartbeat": time.time()}

    def _take(self) -> None:
        self.fs.create_dir(self.folder, recursive=True)
        if self.local and self._create_exclusive():
            return
        current = self._read()
        if current is not None and _alive(current):
            raise ValueError(
                f"run folder {redact(self.run_path)!r} is in use by another driver (host {current.get('host')}, "
                f"pid {current.get('pid')}, Ray job {current.get('job_id')}, heartbeat "
                f"{time.time() - float(current.get('heartbeat', 0)):.0f} s ago): two drivers would mix their "
                f"checkpoints. Wait for it to finish, stop it, or use another `name`.")
        if current is not None:
            logger.warning("run folder %s: taking over a stale lock of host %s, pid %s (heartbeat %.0f s ago)",
                           redact(self.run_path), current.get("host"), current.get("pid"),
                           time.time() - float(current.get("heartbeat", 0)))
        self._write()
        if (self._read() or {}).get("token") != self.token:  # another driver took it at the same moment
            raise ValueError(f"run folder {redact(self.run_path)!r} was locked by another driver just now. "
                             f"Use another `name`, or run again once it has finished.")

    def _create_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(self.owner(), f)
        return True

    def _read(self) -> Optional[dict]:
        try:
            with self.fs.open_input_stream(self.path) as f:
                value = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def _write(self) -> None:
        tmp = f"{self.path}.tmp-{self.token}"
        with self.fs.open_output_stream(tmp) as f:
            f.write(json.dumps(self.owner()).encode())
        self.fs.move(tmp, self.path)  # a rename: readers never see half a lock

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if (self._read() or {}).get("token") == self.token:
                    self._write()
            except OSError as exc:  # a storage hiccup: the next beat tries again
                logger.debug("run lock heartbeat failed: %s", exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            if (self._read() or {}).get("token") == self.token:
                self.fs.delete_file(self.path)
        except OSError as exc:
            logger.warning("could not remove the run lock %s: %s", redact(self.path), exc)


def other_live_owner(run_path: str) -> Optional[dict]:
    """The owner of ``run_path``'s lock if it is a live driver other than this process, else
    None (no lock, a stale one, or our own: ``fit`` holds it around the whole run)."""
    current = RunLock(run_path)._read()
    if current is None or not _alive(current):
        return None
    if current.get("host") == socket.gethostname() and current.get("pid") == os.getpid():
        return None
    return current


def _alive(owner: dict) -> bool:
    try:
        age = time.time() - float(owner.get("heartbeat", 0))
    except (TypeError, ValueError):
        return False
    if age > STALE_S:
        return False
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        try:
            os.kill(owner["pid"], 0)  # signal 0: does the process exist
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by another user
            return True
    return True


def remove_stale_temporaries(folder) -> List[str]:
    """``folder.remove_temporaries()`` (a ``RunFolder``) unless another live driver holds its lock: under our own
    lock (``fit`` holds it) no other driver writes there, so every temporary folder is stale; under another's, its
    save may be in flight and nothing is removed. The removed folders' names."""
    owner = other_live_owner(folder.uri)
    if owner is not None:
        logger.warning("run folder %s is locked by another live driver (host %s, pid %s): its temporary "
                       "checkpoint folders are left alone", folder.display, owner.get("host"), owner.get("pid"))
        return []
    return folder.remove_temporaries()
