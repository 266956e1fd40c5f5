"""What a replay buffer keeps on disk (`buffer.state_dir`): one append-only log of msgpack records.

    ["base", next_group, next_lease_id, version, [open group ids], [[group id, counter, version], ...]]
                                         a snapshot: what follows it is relative to it
    ["lease", lease_id, [group ids]]     a grant; fresh group ids extend the issued range
    ["group", group_id, [frames]]        an accepted complete group: its scored-rollout frames as received
    ["served", step, [group ids]]        every rank fetched step `step`'s batch, made of these groups
    ["dropped", [group ids], counter, version]
                                         stale, failed, overflowed or filtered (`counter`: the reason)
                                         at learner `version`
    ["version", v]                       the learner's version moved
    ["counters", {name: value}]          metrics counters, at each served step, summary and shutdown

Replaying the log gives the groups accepted and not yet served (they are queued again), the groups
issued but never answered (issued again) and every drop with its reason (a restored buffer counts
each reason at least as often as the log holds it, whatever its last counters record says). Served
groups are the issued ones that are none of these, so nothing per served group needs keeping.

Size: the log is rewritten as one `base` record plus the unserved groups when it is loaded, after
a resume, and while the buffer runs whenever it has grown by more than `compact_bytes` and more
than its size after the last rewrite; the folder stays proportional to what is in flight.

Durability: records are written unbuffered, so each is in the OS before the buffer answers the
request that caused it: a killed buffer loses nothing it acknowledged. `fsync` decides what a
lost machine may lose: `never` (the OS writes back when it likes), `batch` (fsync once per pass
of the buffer's loop that wrote anything), `record` (fsync after every record), or a number of
seconds (fsync at most that often). A torn last record (a kill mid-write) is ignored on load.

A full disk (`common.disk.OutOfDisk`, naming the log): a record that cannot be written whole is cut
off again (the log ends with the last whole record) and the error goes up, so the buffer stops
before it answers the request that caused it; a rewrite that cannot be written leaves the old log
as it was and removes its temporary file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from buffer.config import fsync_policy
from common.disk import writing

log = logging.getLogger("buffer.store")

LOG_NAME = "buffer.log"
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16  # buffers one writev takes


class StateLocked(RuntimeError):
    """Another live buffer holds the state dir."""


@dataclass
class Restored:
    next_group: int = 0
    next_lease_id: int = 1
    version: int = 0
    counters: Counter = field(default_factory=Counter)
    open_groups: list[int] = field(default_factory=list)  # issued, neither accepted nor dropped
    groups: dict[int, list[bytes]] = field(default_factory=dict)  # accepted, not served
    dropped: dict[int, tuple[str, int]] = field(default_factory=dict)  # group id -> (counter, version)
    served: dict[int, list[int]] = field(default_factory=dict)  # step -> groups (since the last base)
    records: int = 0
    bad_records: int = 0


class StateStore:
    def __init__(self, state_dir: str, fsync: str = "never", compact_bytes: int = 64 << 20):
        self.dir = Path(state_dir)
        self.path = self.dir / LOG_NAME
        self.fsync_every = fsync_policy(fsync)
        self.compact_bytes = compact_bytes
        self._f = None
        self._lock = None
        self._dirty = False
        self._last_fsync = time.monotonic()
        self._base_bytes = 0  # size right after the last rewrite
        self._size = 0
        self.compactions = 0

    def lock(self) -> None:
        """Hold `state_dir/lock` while this process lives: two buffers appending to one log would corrupt it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.dir / "lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise StateLocked(f"{self.dir} is in use by another buffer (it holds {self.dir / 'lock'})") from None

    def exists(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    # ---- reading ---------------------------------------------------------------------------

    @classmethod
    def read(cls, path: str | Path) -> Restored:
        """Replay a log without changing it (what `load` and the ledger audit read)."""
        r = Restored()
        open_ids: set[int] = set()
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=(1 << 31) - 1, strict_map_key=False)
            try:
                for rec in unpacker:
                    r.records += 1
                    if not cls._apply(rec, r, open_ids):
                        r.bad_records += 1
            except (ValueError, msgpack.UnpackException) as e:
                log.warning("%s: stopped reading at a corrupt record (%s); the rest is ignored", path, e)
                r.bad_records += 1
        r.open_groups = sorted(open_ids)
        return r

    def load(self) -> Restored:
        """Replay the log, then rewrite it compacted. A truncated last record (a kill mid-write) is ignored."""
        r = self.read(self.path)
        self._write_base(r.next_group, r.next_lease_id, r.version, r.open_groups, r.dropped, r.counters,
                         sorted(r.groups.items()))
        return r

    @staticmethod
    def _apply(rec, r: Restored, open_ids: set[int]) -> bool:
        if not (isinstance(rec, list) and rec and isinstance(rec[0], str)):
            return False
        kind, args = rec[0], rec[1:]
        try:
            if kind == "base":
                r.next_group, r.next_lease_id, r.version, ids, dropped = args
                open_ids.clear()
                open_ids.update(int(i) for i in ids)
                r.groups.clear()
                r.served.clear()
                r.dropped = {int(g): (str(c), int(v)) for g, c, v in dropped}
            elif kind == "lease":
                lease_id, ids = args
                r.next_lease_id = max(r.next_lease_id, lease_id + 1)
                top = max(ids, default=-1)
                if top >= r.next_group:  # fresh ids are issued in order
                    open_ids.update(range(r.next_group, top + 1))
                    r.next_group = top + 1
            elif kind == "group":
                gid, frames = args
                open_ids.discard(gid)
                r.groups[gid] = [bytes(x) for x in frames]
            elif kind == "served":
                step, ids = args
                for gid in ids:
                    r.groups.pop(gid, None)
                    open_ids.discard(gid)
                r.served[int(step)] = [int(g) for g in ids]
            elif kind == "dropped":
                ids, counter, version = args
                for gid in ids:
                    open_ids.discard(gid)
                    r.groups.pop(gid, None)
                    r.dropped[int(gid)] = (str(counter), int(version))
            elif kind == "version":
                r.version = max(r.version, args[0])
            elif kind == "counters":
                r.counters = Counter(args[0])
            else:
                return False
        except (TypeError, ValueError):
            return False
        return True

    # ---- rewriting -------------------------------------------------------------------------

    def _write_base(self, next_group: int, next_lease_id: int, version: int, open_ids, dropped: dict,
                    counters, groups) -> None:
        """Replace the log by a snapshot, atomically (a kill mid-way leaves the old log)."""
        tmp = self.path.with_suffix(".tmp")
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            with writing(tmp), open(tmp, "wb") as f:
                f.write(_pack(["base", next_group, next_lease_id, version, list(open_ids),
                               [[g, c, v] for g, (c, v) in sorted(dropped.items())]]))
                f.write(_pack(["counters", dict(counters)]))
                for gid, frames in groups:
                    f.write(_pack(["group", gid, frames]))
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)  # the old log stays whole
            raise
        reopen = self._f is not None
        if reopen:
            self._f.close()
        os.replace(tmp, self.path)
        self._base_bytes = self._size = self.path.stat().st_size
        self.compactions += 1
        if reopen:
            self._f = open(self.path, "ab", buffering=0)

    def snapshot(self, state) -> None:
        """Rewrite the log from a live `BufferState`: what a restart needs, nothing more."""
        self._write_base(state.next_group, state.next_lease_id, state.version, state.open_groups(),
                         state.dropped, state.counters,
                         [(g.group_id, [s.frame for s in g.samples]) for g in sorted(state.ready)])

    def maybe_compact(self, state) -> bool:
        """Snapshot when the log has grown past `compact_bytes` and past its size after the last rewrite."""
        grown = self._size - self._base_bytes
        if grown > self.compact_bytes and grown > self._base_bytes:
            before = self._size
            self.snapshot(state)
            log.info("state log compacted: %.1f MB -> %.1f MB", before / 1e6, self._size / 1e6)
            return True
        return False

    # ---- writing ---------------------------------------------------------------------------

    def open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", buffering=0)
        self._size = self._base_bytes = self.path.stat().st_size

    def _append(self, rec: list) -> None:
        self._write([_pack(rec)])

    def _write(self, parts: list) -> None:
        """Append one record's bytes, `parts` in order, in a system call per IOV_MAX parts
        (unbuffered: in the OS before the request that caused it is answered)."""
        fd, start = self._f.fileno(), self._size
        try:
            with writing(self.path):
                for i in range(0, len(parts), _IOV_MAX):
                    chunk = parts[i:i + _IOV_MAX]
                    done, want = os.writev(fd, chunk), sum(map(len, chunk))
                    if done < want:  # (a short write: a signal, a full disk) the rest, or OSError
                        rest = b"".join(map(bytes, chunk))[done:]
                        while rest:
                            rest = rest[os.write(fd, rest):]
                    self._size += want
                self._dirty = True
                if self.fsync_every == 0.0:
                    os.fsync(fd)
                    self._dirty = False
        except OSError:
            os.ftruncate(fd, start)  # (half a record: cut off, the log ends with the last whole one)
            self._size = start
            raise

    def lease(self, lease_id: int, group_ids: list[int]) -> None:
        self._append(["lease", lease_id, group_ids])

    def group(self, group_id: int, frames: list) -> None:
        # the msgpack of ["group", group_id, frames], written from where the frames lie: packing them
        # would copy every accepted rollout once more
        parts = [_GROUP_HEAD + msgpack.packb(group_id) + _array_header(len(frames))]
        for f in frames:
            parts += (_bin_header(len(f)), f)
        self._write(parts)

    def served(self, step: int, group_ids: list[int]) -> None:
        self._append(["served", step, group_ids])

    def dropped(self, group_ids: list[int], counter: str, version: int) -> None:
        self._append(["dropped", group_ids, counter, version])

    def version(self, version: int) -> None:
        self._append(["version", version])

    def counters(self, counters: dict) -> None:
        self._append(["counters", dict(counters)])

    def flush(self) -> None:
        """Once per pass of the buffer's loop: fsync by the policy."""
        if not self._dirty or self.fsync_every is None:
            return
        now = time.monotonic()
        if self.fsync_every < 0 or now - self._last_fsync >= self.fsync_every:
            with writing(self.path):
                os.fsync(self._f.fileno())
            self._dirty = False
            self._last_fsync = now

    @property
    def size(self) -> int:
        return self._size

    def close(self) -> None:
        if self._f is not None:
            if self.fsync_every is not None:
                os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


_GROUP_HEAD = b"\x93" + msgpack.packb("group")  # a 3-array, then its first item


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else \
        b"\xdd" + n.to_bytes(4, "big")


def _bin_header(n: int) -> bytes:
    return b"\xc4" + n.to_bytes(1, "big") if n < 1 << 8 else b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else \
        b"\xc6" + n.to_bytes(4, "big")


def _pack(rec: list) -> bytes:
    # frames are kept as received (`zmq.Frame`s): anything with the buffer protocol is written as bin
    return msgpack.packb(rec, use_bin_type=True, default=memoryview)
