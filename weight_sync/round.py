"""One round's data plane, as both ends see it: the rendezvous keys, the roster, the group.

The sender (learner rank 0) runs a `TCPStore` server that lives as long as it does
(`store_server`); every key of round R sits under `ws/<secret>/r<R>/` on it, where `secret` is
the sender's random prefix, which only the service and the round's members learn (in `Ready` and
`RoundInfo`, over CurveZMQ when it is on): a stranger who reaches the store has no key to join a
roster or a group by, since a TCPStore cannot list its keys.

    member rank r       join/<r> = 1 | shm <pid>          "I am here" (the sender waits join_timeout_s);
                        [dev=<uuid>] [ipc]                shm: "I read the sender's segment instead",
                                                          from process <pid>; dev: its CUDA device;
                                                          ipc: it could map a slot on the sender's
                                                          device (weight_sync/shm.py `route`)
    sender              join/<r>/refused = why            left out: it cannot take this round at all
    sender              shm/roster = Roster(ranks)        the segment holds the version; these reads count
    sender              a<k>/roster = Roster(ranks, abort, later)  attempt k's members, in group-rank
                                                          order; `later`: served by a later attempt
    member rank r       a<k>/ready/<r> = 1 | holds <g>   about to build the group; holds: it keeps the
                                                          group <g> the roster offered (`Roster.group`)
    sender              a<k>/go = Go(g, reuse)            every rank is ready (else: roster k+1); reuse
                                                          the kept group g, or build g anew
    everyone in roster  a<k>/pg/...                       the new group's rendezvous (not used on reuse)
    sender              broadcast bucket 0, 1, ... from group rank 0
    member rank r       a<k>/done/<r> = ok | err
    shm member rank r   ashm/done/<r> = ok | err         its copy out of the segment

With `weight_sync.group_size` K > 0, an attempt's roster holds at most K members and the rest
wait for theirs (`later`): groups of K are served one after another, so a group's set-up (NCCL's
grows with its size) and a slow or dying member concern K members, not the whole round; the sender
sends the bytes once per group.

A member that joined and then never answers (hung, or gone between join and roster) would hold
everyone's group set-up until the deadline (a group is built by all its ranks or none). So the
group is built only after every rank of the roster said `ready`: the sender waits
`setup_timeout_s` for that, then either says `go` or writes attempt k+1's roster without the
silent ones, which the others, waiting for `go`, take up at once.

A member that dies mid-broadcast makes the others' broadcast fail (gloo reports "connection reset"
within milliseconds, and each side tearing its group down spreads the error); those report `err`,
the sender drops whoever did not report and starts attempt k+1 with the `err` reporters, all within
the round's timeout. A same-host member has no group to fail: it names its process when it joins,
and the sender counts it failed as soon as that process is gone (`RoundStore.process_of`) instead
of at the round's deadline. (A member that can open the segment, `/proc/<sender pid>/fd/<fd>`,
sees the sender's pids as the sender does: the sender can watch its pid in turn.) A member left out of a roster (or handed an `abort` one) raises `RoundMissed`;
it catches up later. The sender's side is `weight_sync.sender.WeightSender._run_round`, the
member's `weight_sync.receiver.receive_buckets`; both speak through `RoundStore` below.

A group costs no process its life: it is built so that a failure costs the round (NCCL: error
handling and a communicator that can be aborted, `group_options`, `group_env`, `nccl_env`), every
wait in a round ends by its deadline (`Bounded`, `AbortAt`), and a group whose members come back is
kept for the next round ("groups kept between rounds", at the end).

Keys are polled with `check` rather than waited on with `wait`: a `wait` that times out leaves
the store client out of step with the server (every later call then fails). For the same reason
each attempt's group gets a store client of its own: a timed-out rendezvous leaves that client
unusable, and the control keys must still get through.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
import weakref
from datetime import timedelta

import msgspec

from common.guards import proc_stat

log = logging.getLogger("conveyor.weight_sync.round")

# How often a step of the round's handshake is polled (roster, ready, go, reports): every 1 ms for
# the first 20 ms (each step answers another within milliseconds, and four in a row cost a round
# ~4 ms at this rate, 20 ms at 5 ms), then every 5 ms (a check is one store round trip, and many
# members may be waiting a long join out).
FAST_POLL_S, FAST_FOR_S, SLOW_POLL_S = 0.001, 0.02, 0.005


def process_alive(pid: int) -> bool:
    """Whether process `pid` still runs: not gone, not a zombie (alive where /proc cannot tell)."""
    fields = proc_stat(pid)
    if not fields:
        return not os.path.isdir("/proc/self")
    return fields[0] not in ("Z", "X", "x")


def pause(since: float) -> None:
    """Sleep one poll interval of a handshake step that began at `since` (monotonic)."""
    time.sleep(FAST_POLL_S if time.monotonic() - since < FAST_FOR_S else SLOW_POLL_S)


class RoundMissed(RuntimeError):
    """This generator did not get the round's weights (left out, sender gone, or timed out).

    Its weights are unchanged (nothing is loaded until every bucket arrived): do not report `done`;
    the next poll brings a catch-up round.
    """


class Roster(msgspec.Struct):
    """Attempt k's members as group ranks 1, 2, ... (in this order); `abort`: the round is off;
    `later`: the ranks a later attempt serves (groups of `weight_sync.group_size`); `group`: the
    id of a kept group the sender would use again for these ranks ("" if none, see `Go`)."""

    ranks: list[int]
    abort: bool = False
    later: list[int] = []
    group: str = ""


class Go(msgspec.Struct, frozen=True):
    """The sender's word that attempt k's group is on: `reuse` the kept group `group` (every rank
    said it holds it), or build a new one, which the members then keep as `group`."""

    group: str
    reuse: bool


_ROSTER = msgspec.msgpack.Decoder(Roster)
_GO = msgspec.msgpack.Decoder(Go)


class RoundStore:
    """Round `round_id`'s keys on the sender's store, through one store client."""

    def __init__(self, host: str, port: int, round_id: int, timeout_s: float, secret: str = ""):
        from torch.distributed import PrefixStore

        self.host, self.port, self.round_id = host, port, round_id
        self.prefix = f"ws/{secret}/r{round_id}" if secret else f"ws/r{round_id}"
        self.store = PrefixStore(self.prefix, open_store(host, port, timeout_s))

    # ---- joining --------------------------------------------------------------------------

    def join(self, rank: int, shm: bool = False, device: str = "", ipc: bool = False) -> None:
        """Say "here"; `shm`: this rank reads the version from the sender's shared memory (and
        names its process, which the sender on the same host can watch). `device`: the UUID of
        the member's CUDA device ("": not on CUDA), so that the sender never puts a member on its
        own GPU into an NCCL group; `ipc`: the member sees the sender's device and could map a
        slot there by CUDA IPC (the sender moves its slot there only then). Words after the first
        two are optional: a reader that knows only `1` / `shm <pid>` still reads the first."""
        words = [f"shm {os.getpid()}" if shm else "1"]
        if device:
            words.append(f"dev={device}")
        if ipc:
            words.append("ipc")
        self.store.set(f"join/{rank}", " ".join(words).encode())

    def joined(self, rank: int) -> str | None:
        """How member `rank` joined: "shm", "broadcast", or None (not yet)."""
        if not self.store.check([f"join/{rank}"]):
            return None
        return "shm" if self.store.get(f"join/{rank}").startswith(b"shm") else "broadcast"

    def _join_words(self, rank: int) -> list[str]:
        try:
            return self.store.get(f"join/{rank}").decode().split()
        except UnicodeDecodeError:
            return []

    def process_of(self, rank: int) -> int | None:
        """Same-host member `rank`'s process id (None: it did not name one)."""
        words = self._join_words(rank)
        try:
            return int(words[1]) if words[0] == "shm" else None
        except (ValueError, IndexError):
            return None

    def device_of(self, rank: int) -> tuple[str, bool]:
        """Member `rank`'s CUDA device UUID ("": none named) and whether it could map a device slot."""
        words = self._join_words(rank)
        uuid = next((w.removeprefix("dev=") for w in words if w.startswith("dev=")), "")
        return uuid, "ipc" in words[1:]

    def refuse(self, rank: int, why: str) -> None:
        """Member `rank` cannot take this round (before the rosters that leave it out are set)."""
        self.store.set(f"join/{rank}/refused", why.encode())

    def refusal(self, rank: int) -> str | None:
        """Why the sender refused member `rank` (None: it did not)."""
        key = f"join/{rank}/refused"
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    # ---- the shared-memory members (weight_sync/shm.py) -------------------------------------

    def set_shm_roster(self, ranks: list[int]) -> None:
        """The ranks whose reads of the segment count (the version is in it once this is set)."""
        self.store.set("shm/roster", msgspec.msgpack.encode(Roster(list(ranks))))

    def wait_shm_roster(self, deadline: float, poll_s: float = 0.002) -> Roster | None:
        """The shared-memory roster; an abort of attempt 0 (the round is off) as an empty one."""
        while True:
            if self.store.check(["shm/roster"]):
                return _ROSTER.decode(self.store.get("shm/roster"))
            if self.store.check(["a0/roster"]) and _ROSTER.decode(self.store.get("a0/roster")).abort:
                # the sender sets the abort right after the shared-memory roster when nobody takes
                # the broadcast: look again, or a reader between the two checks would miss it
                if self.store.check(["shm/roster"]):
                    continue
                return Roster([], abort=True)
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    # ---- the roster of each attempt --------------------------------------------------------

    def set_roster(self, attempt: int, ranks: list[int], abort: bool = False, later: list[int] = (),
                   group: str = "") -> None:
        self.store.set(f"a{attempt}/roster", msgspec.msgpack.encode(Roster(list(ranks), abort, list(later), group)))

    # ---- before the group: every member of the roster says it is about to build it ---------

    def set_ready(self, attempt: int, rank: int, holds: str = "") -> None:
        """`holds`: the id of the kept group the roster offered, if this rank holds it."""
        self.store.set(f"a{attempt}/ready/{rank}", f"holds {holds}".encode() if holds else b"1")

    def wait_ready(self, attempt: int, ranks: list[int], deadline: float) -> dict[int, str]:
        """The ranks of `ranks` that said `ready` for attempt `attempt` by `deadline`, each with
        the kept group it said it holds ("" none)."""
        left, since, out = set(ranks), time.monotonic(), {}
        while left:
            for r in [r for r in left if self.store.check([f"a{attempt}/ready/{r}"])]:
                word = self.store.get(f"a{attempt}/ready/{r}").decode(errors="replace")
                out[r] = word.removeprefix("holds ") if word.startswith("holds ") else ""
                left.discard(r)
            if not left or time.monotonic() >= deadline:
                break
            pause(since)
        return out

    def set_go(self, attempt: int, go: Go = Go("", False)) -> None:
        self.store.set(f"a{attempt}/go", msgspec.msgpack.encode(go))

    def wait_go(self, attempt: int, deadline: float) -> Go | None:
        """The sender's `Go` once it builds (or reuses) attempt `attempt`'s group; None when it
        moved on to the next attempt instead (someone of the roster never said ready) or the
        deadline passed."""
        since = time.monotonic()
        while True:
            if self.store.check([f"a{attempt}/go"]):
                try:
                    return _GO.decode(self.store.get(f"a{attempt}/go"))
                except msgspec.DecodeError as e:
                    raise RoundMissed(f"malformed go for attempt {attempt} of round {self.round_id}: {e}") from None
            if self.store.check([f"a{attempt + 1}/roster"]) or time.monotonic() >= deadline:
                return None
            pause(since)

    def wait_roster(self, attempt: int, deadline: float) -> Roster | None:
        """Attempt `attempt`'s roster, or None if none came by `deadline` (monotonic)."""
        key = f"a{attempt}/roster"
        if not wait_key(self.store, key, deadline):
            return None
        try:
            return _ROSTER.decode(self.store.get(key))
        except msgspec.DecodeError as e:
            raise RoundMissed(f"malformed roster for attempt {attempt} of round {self.round_id}: {e}") from None

    # ---- the group and the reports ---------------------------------------------------------

    def group(self, backend: str, attempt: int, group_rank: int, world_size: int, deadline: float,
              op_timeout_s: float | None = None, device=None):
        """Attempt `attempt`'s process group, as `group_rank` of `world_size` (on a store client
        of its own). Every rank of the roster must construct it concurrently. The set-up ends by
        `deadline`: the store client's timeout bounds the rendezvous (gloo connects its pairs in
        the constructor), and an NCCL communicator is created here (`device`: this rank's CUDA
        device), not at the first broadcast, under `AbortAt(deadline)`. `op_timeout_s`: each
        collective's own bound (the round's whole timeout: a kept group serves later rounds)."""
        from torch.distributed import PrefixStore

        timeout_s = max(0.1, deadline - time.monotonic())
        pg_store = PrefixStore(f"{self.prefix}/a{attempt}/pg", open_store(self.host, self.port, timeout_s))
        pg = make_group(backend, pg_store, group_rank, world_size, op_timeout_s or timeout_s)
        if backend == "nccl":
            connect(pg, device, deadline)
        return pg

    def report(self, attempt: int | str, rank: int, ok: bool) -> None:
        """Member `rank`'s outcome of attempt `attempt` ("shm": of its read of the segment)."""
        self.store.set(f"a{attempt}/done/{rank}", b"ok" if ok else b"err")

    def report_of(self, attempt: int | str, rank: int) -> bool | None:
        """Whether member `rank` received attempt `attempt` (None: it has not said yet)."""
        key = f"a{attempt}/done/{rank}"
        if not self.store.check([key]):
            return None
        return self.store.get(key) == b"ok"


# --------------------------------------------------------------------------------------------
# stores and groups


def store_server(host: str, timeout_s: float):
    """The rendezvous store's server, listening on `host` only, on a free port.

    A TCPStore master binds every interface (`::`) whatever host it is given; handed a socket
    that listens already (`master_listen_fd`, which it then owns), it serves on that one."""
    import torch.distributed as dist

    family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen(1024)  # every member rank connects at once at the start of a round
        port = s.getsockname()[1]
        fd = s.detach()
    try:
        return dist.TCPStore(host, port, None, True, timeout=timedelta(seconds=max(timeout_s, 0.1)),
                             wait_for_workers=False, master_listen_fd=fd)
    except Exception:
        os.close(fd)
        raise


def open_store(host: str, port: int, timeout_s: float, is_master: bool = False):
    """A TCPStore client (or, with `is_master`, a server on `port`, 0 = any free port)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, is_master, timeout=timedelta(seconds=max(timeout_s, 0.1)),
                         wait_for_workers=False)


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
                        "weight_sync.round.nccl_env() in this process's environment", ", ".join(missing))
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


def wait_key(store, key: str, deadline: float) -> bool:
    """Poll until `key` exists (True) or `deadline` (monotonic) passes (False)."""
    since = time.monotonic()
    while True:
        if store.check([key]):
            return True
        if time.monotonic() >= deadline:
            return False
        pause(since)


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
