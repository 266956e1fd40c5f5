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
sees the sender's pids as the sender does: the sender can watch its pid in turn.) A member left
out of a roster (or handed an `abort` one) raises `RoundMissed`; it catches up later. The
sender's side is `weight_sync.sender.WeightSender._run_round` (its attempts:
`weight_sync.broadcast.Broadcast`), the member's `weight_sync.receiver.receive_buckets` (a
same-host member's: `weight_sync.slot`); both speak through `RoundStore` below.

A group costs no process its life: it is built so that a failure costs the round, every wait in
a round ends by its deadline, and a group whose members come back is kept for the next round
(`weight_sync/groups.py`; `RoundStore.group` builds an attempt's group on this store).

Keys are polled with `check` rather than waited on with `wait`: a `wait` that times out leaves
the store client out of step with the server (every later call then fails). For the same reason
each attempt's group gets a store client of its own: a timed-out rendezvous leaves that client
unusable, and the control keys must still get through.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import msgspec

from common.guards import proc_stat
from weight_sync.groups import connect, make_group

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


def member_store(info, rank: int, deadline: float) -> RoundStore:
    """Member `rank`'s client of the round `info` (its `RoundInfo`) describes, its calls bounded by
    `deadline`; `RoundMissed` when the store cannot be reached (the sender is gone)."""
    try:
        return RoundStore(info.host, info.port, info.round_id, deadline - time.monotonic(), info.secret)
    except Exception as e:  # sender gone
        raise RoundMissed(f"rank {rank}: cannot reach the rendezvous store {info.host}:{info.port}: {e}") from None


# --------------------------------------------------------------------------------------------
# the store


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


def wait_key(store, key: str, deadline: float) -> bool:
    """Poll until `key` exists (True) or `deadline` (monotonic) passes (False)."""
    since = time.monotonic()
    while True:
        if store.check([key]):
            return True
        if time.monotonic() >= deadline:
            return False
        pause(since)
