"""A full disk, said plainly: `OutOfDisk` names the path that could not be written, how many bytes
its filesystem has free, and what can be freed.

    with writing(path):          # ENOSPC / EDQUOT raised in the block -> OutOfDisk(path)
        f.write(...)

A role that dies of `OutOfDisk` exits with code 9 (`launch.recovery.EXIT_CODES["disk"]`). Its message
must still reach its log and the launcher's `exit.json` on a disk with no byte left: the launcher
keeps a small reserve file for its roles (`reserve`, its path in $CONVEYOR_DISK_RESERVE for every role
it starts), which the first role out of disk deletes (`release_reserve`) before saying why, and one
of its own, which it deletes once every role is stopped (the others may have taken the first).
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_WORDS = "out of disk space writing"  # how OutOfDisk's message starts (a launcher looks for it in a log)
FULL_WORDS = ("No space left on device", "Disk quota exceeded")  # (libraries that do not keep the errno)
NEARLY_FULL = 1 << 20  # bytes: a failed write with less than this free is taken as a full disk (see `writing`)
RESERVE_ENV = "CONVEYOR_DISK_RESERVE"


class OutOfDisk(OSError):
    """`path` could not be written: its filesystem is full (or the user's quota is spent)."""

    def __init__(self, path: str | Path, free: int | None = None, code: int = errno.ENOSPC):
        self.path = str(path)
        self.free = free_bytes(path) if free is None else free
        super().__init__(code, f"{DISK_WORDS} {self.path} ({self.free} bytes free on its filesystem, "
                               f"mounted at {mount_point(path)}); free some: older checkpoints under "
                               f"<run_dir>/checkpoints (learner.keep_checkpoints keeps fewer), old logs under "
                               f"<run_dir>/logs, or other files on that filesystem", self.path)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return type(self), (self.path, self.free, self.errno)


def free_bytes(path: str | Path) -> int:
    """Bytes free to this user on the filesystem of `path` (or of its nearest existing parent); -1 if unknown."""
    try:
        return shutil.disk_usage(existing(path)).free
    except OSError:
        return -1


def existing(path: str | Path) -> Path:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_point(path: str | Path) -> Path:
    p = existing(path)
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from or during, says the disk is full."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS or any(w in str(e) for w in FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def writing(path: str | Path, nearly_full: bool = False) -> Iterator[None]:
    """Raise `OutOfDisk(path)` for a full disk met in the block. `nearly_full`: any error at all while
    the filesystem has under `NEARLY_FULL` bytes free counts (torch.save says only "file write failed")."""
    try:
        yield
    except OutOfDisk:
        raise
    except Exception as e:
        free = free_bytes(path)
        if is_disk_full(e) or nearly_full and 0 <= free < NEARLY_FULL:
            code = e.errno if isinstance(e, OSError) and e.errno in FULL_ERRNOS else errno.ENOSPC
            raise OutOfDisk(path, free, code) from e
        raise


def append_whole(fd: int, data: bytes, path: str | Path) -> None:
    """Append `data` (a line, a record) to the file open as `fd`, whole or not at all: a write the disk
    cannot take is cut off again, so the file still ends with its last whole line, and `OutOfDisk`
    naming `path` is raised."""
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        with writing(path):
            while data:
                data = data[os.write(fd, data):]
    except OSError:
        os.ftruncate(fd, start)
        raise


def reserve(path: str | Path, nbytes: int = 1 << 20, for_roles: bool = True) -> bool:
    """Hold `nbytes` of the disk in `path` for the last words of a run that fills it (`for_roles`: the
    roles started from now on find the path in $CONVEYOR_DISK_RESERVE); False when there is no room
    for it (nothing is held then)."""
    path = Path(path)
    if for_roles:
        os.environ[RESERVE_ENV] = str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(b"\0" * nbytes)  # (written, not sparse: the blocks must be taken now)
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        path.unlink(missing_ok=True)
        return False


def release_reserve(path: str | Path | None = None) -> bool:
    """Delete the reserve (`path`, default the one in $CONVEYOR_DISK_RESERVE); True if one was there."""
    path = path or os.environ.get(RESERVE_ENV)
    if not path:
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
