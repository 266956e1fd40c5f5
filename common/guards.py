"""Guards a long-running service keeps against its peers: warnings that cannot flood the log,
memory that a peer cannot grow without bound, and room for as many peers as the system allows."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Callable


def raise_open_files_limit(log: logging.Logger, per_peer: int = 1) -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit (returned). Each peer holds `per_peer`
    descriptors (a generator holds three on the buffer: control, relay_in, its lease keeper), and
    at the usual soft limit of 1,024 libzmq stops accepting peers, silently, near a thousand of
    them (bench/scale.py, docs/scaling.md). Warns when the limit leaves room for fewer than 1,300."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # (an unlimited hard limit some systems refuse as a soft one)
            pass
    if soft != resource.RLIM_INFINITY and soft // per_peer < 1300:
        log.warning("open files limited to %d (RLIMIT_NOFILE): room for about %d peers; raise the hard limit "
                    "(ulimit -Hn, LimitNOFILE=) for more", soft, soft // per_peer)
    return soft


class WarnLimiter:
    """At most one warning per `every_s` per kind; says how many were held back."""

    def __init__(self, log: logging.Logger, every_s: float = 5.0):
        self.log = log
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, msg: str, *args, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        self.log.warning(msg + (f" ({held} more since the last warning of this kind)" if held else ""), *args,
                         exc_info=exc_info)


class MemoryGuard:
    """Bounds what peers can make this process hold beyond what it keeps on purpose.

    libzmq keeps every frame of a multipart message until the last one arrives, with no bound:
    MAXMSGSIZE is per frame and high-water marks count whole messages. A peer that never ends a
    message (2 bytes on the wire per empty frame, ~64 bytes held) fills memory until it hangs up,
    and libzmq does not say which connection holds it. So the loop asks `over` now and then, and
    once the process is `budget` bytes past its size at start plus what it `held` on purpose, it
    closes and binds its sockets again: every connection drops (peers reconnect by themselves; what
    was in flight is lost, as when a peer restarts) and what they held is freed. Linux only (RSS
    from /proc); elsewhere it never trips.
    """

    def __init__(self, budget: int, every_s: float = 0.25):
        self.budget = budget
        self.every_s = every_s
        self.base = rss_bytes()
        self._next = 0.0
        self._trim = False

    def over(self, now: float | None = None, held: Callable[[], int] = lambda: 0) -> bool:
        """Past the budget? `held()`: bytes kept on purpose (only asked when it may matter)."""
        now = time.monotonic() if now is None else now
        if now < self._next or not self.base:
            return False
        self._next = now + self.every_s
        if self._trim:  # the sockets closed a check ago: libzmq has freed their queues by now
            self._trim = False
            release_free_memory()
            self.base = max(self.base, rss_bytes() - held())  # what could not be given back stays
            return False
        rss = rss_bytes()
        return rss > self.base + self.budget and rss > self.base + held() + self.budget

    def reset(self) -> None:
        """The caller closed and bound its sockets again."""
        self._trim = True


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (the state first), or None where there
    is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def release_free_memory() -> None:
    """Give freed heap back to the OS: glibc keeps it (many small frames freed leave RSS as it was)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
