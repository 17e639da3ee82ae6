"""A directory's lock, so that two runs never write into one directory: `<checkpoint.dir>/zoo.lock`
(zoo.train.checkpoint) and `<hydra.run.dir>/zoo.run.lock` (zoo.tools.cli), each created exclusively and naming
its owner (host, process id, the kernel's start time of that process, the command). A second run started into a
held directory stops in one line naming the first; a lock whose process is gone (same host) is stale and taken
over with a note. And the probe that a directory can be written, made before anything compiles.
"""

import json
import os
import pathlib
import socket
import sys
import time
from typing import Callable, Optional

from zoo.errors import ConfigError

LOCK_FILE = "zoo.lock"


def probe_writable(d: pathlib.Path, key: str) -> None:
    """Write and delete a small file in `d`: a directory that cannot be written is found before
    training, not when the first save fails after the run's work."""
    probe = d / f".zoo-write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"zoo")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{key}: cannot write in {d} ({e.strerror}); choose a writable directory or fix its permissions"
        ) from None


def _process_start(pid: int) -> Optional[str]:
    """The kernel's start time of `pid` (Linux), which tells a live owner from a reused process id."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


def _alive(owner: dict) -> bool:
    """Whether the lock's owner still runs (only decidable on its own host: elsewhere, assume so)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return True
    pid = owner["pid"]
    if pid == os.getpid():
        return False  # left by an earlier job of this same process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    start = owner.get("pid_start")
    return start is None or _process_start(pid) in (None, start)


class DirLock:
    """`<checkpoint.dir>/zoo.lock`, created exclusively: which run (host, pid, start time, command)
    owns the directory. Two runs saving into one directory would overwrite each other's steps."""

    def __init__(self, d: pathlib.Path, name: str = LOCK_FILE, key: str = "checkpoint.dir"):
        self.dir = d
        self.path = d / name
        self.key = key  # the setting that chose the directory, named in the error lines
        self.mine: Optional[dict] = None

    def held_by_another(self) -> Optional[dict]:
        """The live owner of the lock, when it is another process's (read-only)."""
        owner = self._read()
        return owner if owner and _alive(owner) and owner.get("pid") != os.getpid() else None

    def in_use_line(self, owner: dict) -> str:
        return (
            f"{self.key}: {self.dir} is in use by another run (pid {owner.get('pid')} on {owner.get('host')}, "
            f"started {owner.get('started')}); wait for it to end or give this run another {self.key} "
            f"(if that run is gone, delete {self.path})"
        )

    def _read(self) -> Optional[dict]:
        try:
            owner = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) else None

    def acquire(self, echo: Callable = print) -> None:
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "command": " ".join(sys.argv),
        }
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._read()
                if owner is None:  # being written this instant, or garbage: look again shortly
                    time.sleep(0.05)
                    continue
                if owner and _alive(owner):
                    raise ConfigError(self.in_use_line(owner))
                if owner and self._remove_stale(owner):
                    echo(f"note: {self.key}: took over the lock of pid {owner.get('pid')} on {owner.get('host')} "
                         f"(started {owner.get('started')}), which no longer runs")  # fmt: skip
                continue
            except OSError as e:
                raise ConfigError(
                    f"{self.key}: cannot create the lock file {self.path} ({e.strerror}); choose a writable directory"
                ) from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
            self.mine = me
            return
        raise ConfigError(f"{self.key}: the lock file {self.path} is unreadable; delete it if no run uses {self.dir}")

    def _remove_stale(self, owner: dict) -> bool:
        """Move the stale lock away atomically (of two runs taking it over, one wins the rename)."""
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # another run took it over first
        try:
            moved = json.loads(aside.read_text())
        except (OSError, ValueError):
            moved = None
        if moved != owner:  # a fresh lock replaced the stale one meanwhile: put it back
            try:
                os.link(aside, self.path)
            except OSError:
                pass
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def release(self) -> None:
        if self.mine is None:
            return
        owner = self._read()
        if owner and owner.get("pid") == self.mine["pid"] and owner.get("host") == self.mine["host"]:
            self.path.unlink(missing_ok=True)
        self.mine = None
