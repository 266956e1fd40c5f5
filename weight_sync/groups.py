"""A round's process group, as both ends build it: so that its failure costs the round, never the
process, and so that a group whose members come back serves the next round too.

An attempt's group (`weight_sync/round.py`: `RoundStore.group` builds it on the round's keys) is
a standalone group (`make_group`), separate from the learner's and the engines' own: NCCL's gets
error handling that aborts rather than tears down and a communicator that can be aborted while
it is set up (`group_options`, `group_env`, and `nccl_env` for the launcher). Every wait of a
round ends by its deadline (`Bounded` for the collectives, `AbortAt` for the calls that take no
timeout); a failed group is aborted (`failed_group`) and finished ones are dropped off the round's
path (`dispose`). Groups kept between rounds: `SenderGroups` at the sender, `MemberGroups` in a
member's process (the last section says how both ends agree on one).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import secrets
import threading
import time
import weakref
from datetime import timedelta

log = logging.getLogger("conveyor.weight_sync.groups")

# ---- how a group is built, so that its failure costs a round, not the process ---------------
#
# Read in torch 2.14's torch/csrc/distributed/c10d/ProcessGroupNCCL.{hpp,cpp} (the header as the
# 2.14.0+cu130 wheel ships it; the .cpp of the same era's main branch):
# - `ProcessGroupNCCL::ProcessGroupNCCL` reads TORCH_NCCL_ASYNC_ERROR_HANDLING once, into the
#   group's own `asyncErrorHandling_` (default 3), and TORCH_NCCL_ENABLE_MONITORING into its
#   `HeartbeatMonitor`; later changes of the variables do not touch a group that exists.
# - `Watchdog::runLoop`: a collective that failed or ran past the group's timeout is handled with
#   that mode: `SHOULD_CLEAN_UP` (1, 2) aborts the communicators, `WorkNCCL::handleException`
#   rethrows on the watchdog thread when `SHOULD_TEAR_DOWN` (1, 3), which takes the process down.
#   So: 0 NoHandling (nothing), 1 TearDown (abort, then die), 2 CleanUpOnly (abort, live on),
#   3 SkipCleanUp (die without aborting). Only 0 and 2 let a caller survive, and abort itself
#   (`ProcessGroupNCCL::abort`: it sets terminateProcessGroup_, so the watchdog stops checking the
#   aborted communicators). 2 also aborts a communicator the caller missed, after the group's
#   timeout (the watchdog first sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC for a dump).
# - `HeartbeatMonitor::runLoop` kills the process when the watchdog thread is stuck (for example
#   inside ncclCommAbort) for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 min) unless monitoring is off.
# - `WorkNCCL::wait(timeout)`: with a timeout it blocks the calling thread until the collective
#   completes or the timeout passes, then aborts the work's communicator and raises (on the
#   calling thread: a Python exception, not a teardown); without one it only makes the current
#   stream wait. TORCH_NCCL_BLOCKING_WAIT=1 would make every wait do so, and skips the watchdog
#   thread altogether: not needed here, and it would change DeepSpeed's groups in the learner.
# - `ProcessGroupNCCL::useNonblocking`: `Options.config.blocking` = 0 comes first (then
#   TORCH_NCCL_USE_COMM_NONBLOCKING); a non-blocking communicator is created without blocking the
#   caller and sits in `inInitializationCommMap_` meanwhile, which `abortComms` (under `abort`)
#   aborts too: a set-up waiting for a peer that never comes can be cut off at the deadline. A
#   blocking ncclCommInitRank cannot. torch waits for a non-blocking call at most
#   TORCH_NCCL_NONBLOCKING_TIMEOUT seconds (`c10d::nccl_nonblocking_timeout`, read once per
#   process, default 30 min).
# - `eagerConnectSingleDevice(device)` creates the communicator now instead of at the first
#   collective (what `init_process_group(device_id=...)` does for a bound device).
# - gloo: `ProcessGroupGloo` has no `abort` of its own (Backend.hpp `virtual void abort() {}`, in
#   torch 2.13 and 2.14 alike): a no-op, safe to call; its `wait(timeout)` raises "Operation timed
#   out!" at the timeout (checked on CPU), and the constructor's rendezvous ends with the store
#   client's timeout.
#
# The learner's and the generators' own NCCL groups (DeepSpeed's, vLLM's) keep torch's default
# (a training collective that times out must stop the learner, not let it step on partial data):
# the weight-sync group gets its handling by a change of the variables for the span of its
# constructor only (`scoped_env`). Changing a variable that is already set swaps one pointer of
# `environ` (glibc setenv), harmless to other threads reading the environment; adding one may move
# `environ` under them. So the launcher sets them beforehand, at torch's defaults (`nccl_env`).

ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ENABLE_MONITORING = "TORCH_NCCL_ENABLE_MONITORING"
NONBLOCKING_TIMEOUT = "TORCH_NCCL_NONBLOCKING_TIMEOUT"
CLEAN_UP_ONLY = "2"  # abort the communicators on a failure, never take the process down
TORCH_DEFAULTS = {ASYNC_ERROR_HANDLING: "3", ENABLE_MONITORING: "1"}


def nccl_env(timeout_s: float = 120.0) -> dict[str, str]:
    """The environment a process that joins weight-sync NCCL groups (learner rank 0, every
    generator) needs from its start, for the launcher to add to its own: the two variables that
    `group_env` changes while a weight-sync group is built, set at torch's own defaults (so the
    process's other groups behave as before, and the change later swaps values rather than
    adding variables), and the bound on torch's waits for a non-blocking communicator
    (`timeout_s`: the round's, `weight_sync.timeout_s`; only non-blocking communicators read it,
    and only the weight-sync groups are non-blocking)."""
    return {**TORCH_DEFAULTS, NONBLOCKING_TIMEOUT: str(max(1, math.ceil(timeout_s)))}


def group_env(backend: str) -> dict[str, str]:
    """The variables in force while a weight-sync group of `backend` is constructed: CleanUpOnly
    error handling and no heartbeat monitor (a stuck abort costs the group, not the process)."""
    return {ASYNC_ERROR_HANDLING: CLEAN_UP_ONLY, ENABLE_MONITORING: "0"} if backend == "nccl" else {}


def group_options(backend: str, timeout_s: float) -> dict:
    """What a weight-sync group of `backend` is constructed with: `timeout`, each collective's
    bound (gloo: the constructor's rendezvous too; NCCL: `Options._timeout`, the watchdog's);
    for NCCL also `blocking` = 0 (`Options.config.blocking`: a communicator that can be aborted
    while it is set up) and `is_high_priority_stream` = False (nothing else runs on the device
    during a round that the broadcast should pass: the learner waits for its publish, a generator
    for its load)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"no process group for backend {backend!r}")
    opts = {"timeout": timedelta(seconds=max(timeout_s, 0.1))}
    if backend == "nccl":
        opts.update(blocking=0, is_high_priority_stream=False)
    return opts


_env_lock = threading.Lock()
_env_warned: list[str] = []


@contextlib.contextmanager
def scoped_env(changes: dict[str, str]):
    """`changes` in the environment for the span of the block, then the values before (a variable
    that was not set comes back at torch's default, `TORCH_DEFAULTS`, rather than removed: see
    above). Serialised: two groups built at once see the same values."""
    if not changes:
        yield
        return
    with _env_lock:
        missing = [k for k in changes if k not in os.environ]
        if missing and not _env_warned:
            _env_warned.append("x")
            log.warning("%s not set when a weight-sync NCCL group was built: the launcher should set "
                        "weight_sync.groups.nccl_env() in this process's environment", ", ".join(missing))
        before = {k: os.environ.get(k, TORCH_DEFAULTS.get(k)) for k in changes}
        os.environ.update(changes)
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def make_group(backend: str, store, rank: int, world_size: int, timeout_s: float):
    """A standalone process group on `store` (separate from any default group: DeepSpeed's stays
    untouched), built as `group_options` and `group_env` say. Every rank must construct it
    concurrently."""
    import torch.distributed as dist

    opts = group_options(backend, timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, opts["timeout"])
    nccl = dist.ProcessGroupNCCL.Options(is_high_priority_stream=opts["is_high_priority_stream"])
    nccl._timeout = opts["timeout"]
    nccl.config.blocking = opts["blocking"]
    with scoped_env(group_env(backend)):
        return dist.ProcessGroupNCCL(store, rank, world_size, nccl)


def connect(pg, device, deadline: float) -> None:
    """Create `pg`'s NCCL communicator on `device` (None: the current CUDA device) now, aborted at
    `deadline` if it is not up (a peer that never comes); raises then."""
    import torch

    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with AbortAt(pg, deadline) as guard:
        pg.eager_connect_single_device(device)
    if guard.fired:
        raise TimeoutError("the NCCL communicator was not up by the round's deadline")


def abort_group(pg) -> None:
    """Abort `pg`'s communicators (NCCL: kernels still running end, waits on them fail; gloo: a
    no-op). Never raises: it runs on failure paths."""
    abort = getattr(pg, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as e:  # already aborted, or torn down
        log.debug("abort of a weight-sync group: %s", e)


ABORT_JOIN_S = 10.0  # how long the end of an `AbortAt` block waits for an abort under way


class AbortAt:
    """`with AbortAt(pg, deadline) as guard:` aborts `pg` (`abort_group`) at `deadline`
    (monotonic) if the block has not ended by then; `guard.fired` says whether it did. The bound
    for a call that takes no timeout of its own (an NCCL communicator's set-up, a collective's
    enqueue that waits for it); a thread of its own, started only for the block."""

    def __init__(self, pg, deadline: float):
        self.pg, self.deadline = pg, deadline
        self.fired = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "AbortAt":
        self._thread = threading.Thread(target=self._watch, name="weight-sync-abort-at", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        if not self._done.wait(max(0.0, self.deadline - time.monotonic())):
            self.fired = True
            abort_group(self.pg)

    def __exit__(self, *exc) -> None:
        self._done.set()
        # an abort that hangs in the driver (it fired: the block ended because of it) is left to its
        # daemon thread; the round goes on to its own failure path instead of waiting for it
        self._thread.join(ABORT_JOIN_S)
        if self._thread.is_alive():
            log.warning("a weight-sync group's abort has not returned after %.0fs; leaving it", ABORT_JOIN_S)


def wait_work(work, deadline: float) -> None:
    """Wait for a collective until `deadline` (monotonic) at most: `TimeoutError` past it. Both
    backends take the timeout (gloo's AsyncWork, NCCL's `WorkNCCL::wait`, which also aborts the
    communicator then); `timedelta(0)` would mean no bound, hence the floor."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the round's deadline passed before the collective completed")
    work.wait(timedelta(seconds=max(left, 0.001)))


# Finished groups are dropped by one thread, `TEARDOWN_AFTER_S` after they finished: a gloo group's
# destructor joins its threads and closes its pairs holding the GIL (~15 ms with a peer in another
# process), which would otherwise stall the round that just ended (or the next one).
TEARDOWN_AFTER_S = 0.5
_retired: "queue.SimpleQueue[tuple[float, object]]" = queue.SimpleQueue()
_teardown_lock = threading.Lock()
_teardown_thread: list[threading.Thread] = []


def dispose(pg, after_s: float = TEARDOWN_AFTER_S) -> None:
    """Hand a finished group to the teardown thread (see `TEARDOWN_AFTER_S`); the caller drops its
    own references."""
    if pg is None:
        return
    _retired.put((time.monotonic() + after_s, pg))
    with _teardown_lock:
        if not _teardown_thread or not _teardown_thread[0].is_alive():
            t = threading.Thread(target=_tear_down, name="weight-sync-pg-teardown", daemon=True)
            t.start()
            _teardown_thread[:] = [t]


def _tear_down() -> None:
    while True:
        at, pg = _retired.get()
        time.sleep(max(0.0, at - time.monotonic()))
        del pg, at


@atexit.register
def _tear_down_now() -> None:
    """At exit, the groups still waiting for the teardown thread go while the interpreter is whole
    (one destroyed during finalisation aborts the process: `terminate called without an active
    exception`)."""
    while True:
        try:
            _, pg = _retired.get_nowait()
        except queue.Empty:
            return
        del pg


# --------------------------------------------------------------------------------------------
# groups kept between rounds
#
# A group costs its set-up (NCCL's communicator: seconds at scale) every time it is built, so a
# group whose members come back in the next round, in the same group ranks, is used again. Both
# ends keep it: the sender offers a kept group's id in the roster (`Roster.group`) when the
# attempt's members, in group-rank order, are the ones it was built with; each member says in its
# `ready` whether it holds that group as the same group rank; the sender's `Go` then says
# `reuse` only if every member does, else it names a new group, which everyone builds under the
# attempt's keys (`a<k>/pg`) and keeps. A group that failed (an error, a timeout, a member silent
# or `err`) is aborted and forgotten at both ends; a roster change retires the groups it
# concerns. Whoever is in the group is decided by this exchange alone, never by a guess at either
# end: a process that restarted holds nothing, and a member in another group rank answers "no".


def retire(pg) -> None:
    """A sound group no longer used (its members changed): abort it, hand it to the teardown thread."""
    if pg is None:
        return
    abort_group(pg)
    dispose(pg)


def failed_group(pg, error: BaseException) -> None:
    """End a group whose collective failed with `error`: abort it. The caller then drops its last
    reference at once, so that the group is destroyed now, with the collectives still queued on
    it, and peers still receiving through it are told at once (gloo closes its pairs) instead of
    at the round's deadline; except after a timeout, when a gloo collective still waits in the
    group's thread and the destructor would wait for it (up to the group's own timeout): that
    group goes to the teardown thread."""
    if pg is None:
        return
    abort_group(pg)
    if isinstance(error, TimeoutError) or "timed out" in str(error).lower():
        dispose(pg, 0.0)


class Bounded:
    """A group whose collectives' `wait()` ends by `deadline` (`wait_work`): what a round's code
    is handed, so that none of its waits can outlast the round."""

    def __init__(self, pg, deadline: float):
        self.pg, self.deadline = pg, deadline

    def broadcast(self, tensor, root: int):
        return _BoundedWork(self.pg.broadcast(tensor, root), self.deadline)


class _BoundedWork:
    def __init__(self, work, deadline: float):
        self.work, self.deadline = work, deadline

    def wait(self, timeout=None) -> bool:
        wait_work(self.work, self.deadline)
        return True


class SenderGroups:
    """The sender's kept groups: id -> (the members it serves in group-rank order, the group).
    A member is any hashable name of a member rank (the sender uses (worker id, local rank))."""

    def __init__(self, limit: int = 8):
        self.limit = limit
        self._kept: dict[str, tuple[tuple, object]] = {}
        _all_kept.add(self)

    def __len__(self) -> int:
        return len(self._kept)

    def offer(self, members) -> tuple[str, tuple]:
        """The kept group built for exactly the members `members` (in any order): (its id, its
        members in group-rank order, the order a roster must list them in), or ("", ())."""
        members = set(members)
        return next(((gid, m) for gid, (m, _) in self._kept.items() if set(m) == members), ("", ()))

    def get(self, gid: str):
        return self._kept[gid][1]

    def keep(self, gid: str, members, pg) -> None:
        """Keep `pg` as `gid`; a kept group sharing a member with it is retired (that member has
        left it for this one), and the oldest beyond `limit`."""
        members = tuple(members)
        for old in [g for g, (m, _) in self._kept.items() if g != gid and set(m) & set(members)]:
            self.drop(old)
        self._kept[gid] = (members, pg)
        while len(self._kept) > self.limit:
            self.drop(next(iter(self._kept)))

    def forget(self, gid: str):
        """Take `gid` out (its group, or None); the caller ends it (`failed_group`)."""
        kept = self._kept.pop(gid, None)
        return kept[1] if kept is not None else None

    def drop(self, gid: str) -> None:
        retire(self.forget(gid))

    def clear(self) -> None:
        for gid in list(self._kept):
            self.drop(gid)

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(8)


class MemberGroups:
    """A member process's kept group, one per sender (its store's address): the sender's secret,
    the group's id and this process's group(s) in it by group rank (several when generators run
    as threads of one process, as tests do). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: dict[tuple[str, int], tuple[str, str, dict[int, object]]] = {}
        _all_kept.add(self)

    def holds(self, where: tuple[str, int], secret: str, gid: str, group_rank: int):
        """This process's group `gid` as `group_rank`, or None."""
        with self._lock:
            kept = self._kept.get(where)
            if not gid or kept is None or kept[:2] != (secret, gid):
                return None
            return kept[2].get(group_rank)

    def keep(self, where: tuple[str, int], secret: str, gid: str, group_rank: int, pg) -> None:
        """Keep `pg` as `group_rank` of `gid`; a group kept before for that sender is retired."""
        with self._lock:
            kept = self._kept.get(where)
            if kept is None or kept[:2] != (secret, gid):
                old = kept[2] if kept is not None else {}
                kept = self._kept[where] = (secret, gid, {})
                for stale in old.values():
                    retire(stale)
            kept[2][group_rank] = pg

    def clear(self) -> None:
        with self._lock:
            kept, self._kept = self._kept, {}
        for _, _, pgs in kept.values():
            for pg in pgs.values():
                retire(pg)

    def forget(self, where: tuple[str, int], group_rank: int):
        """Take this process's `group_rank` of the group kept for that sender out (it, or None);
        the caller ends it (`failed_group`)."""
        with self._lock:
            kept = self._kept.get(where)
            pg = kept[2].pop(group_rank, None) if kept is not None else None
            if kept is not None and not kept[2]:
                del self._kept[where]
        return pg


_all_kept: "weakref.WeakSet" = weakref.WeakSet()
member_groups = MemberGroups()


@atexit.register
def _drop_kept() -> None:
    """At exit, kept groups go to the teardown queue, which `_tear_down_now` (registered before,
    so run after this) empties while the interpreter is whole."""
    for kept in list(_all_kept):
        kept.clear()
