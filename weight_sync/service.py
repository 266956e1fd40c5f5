"""The weight-sync service: who holds which version, and who joins the next round.

The service never moves weights and never waits on anyone: every request is answered at once
from the state below, so a dead or slow generator cannot stall it.

A publish round (learner rank 0 sends `ready` for version N):
  members = every registered generator that is alive (not dropped by a round, heard from within
  `stale_after_s`); ranks are assigned in order, the sender being rank 0; the reply `go` lists
  them, and each member's next `poll` returns its `RoundInfo`. Unclaimed catch-up rounds of the
  previous version are cancelled (listed in `go.cancelled` so the sender releases their members).

A catch-up round (a generator polls while behind the current version):
  disk backend: the round points at the latest folder, answered on the spot;
  group backends: the generator is added to the forming catch-up round and gets its `RoundInfo` at
  once; the sender claims the round at its next `pending_request` and broadcasts its retained
  weights. Offered only while the sender is known to be serving (it promised, in its last
  `pending_request`, to ask again within `next_within_s`), so a behind generator never waits on a
  sender that is gone; otherwise it simply joins the next publish.

A generator's version is what it reports in `done` (after loading). The sender's `round_result`
names members that failed mid-round (`dead`) and members that never joined (`absent`: busy or
gone); both are left out of later publish rounds until they are heard from again, so a generator
that died between rounds costs one join window, not one per round.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from common.curve import ROLES, role_of, role_refusal
from common.guards import MemoryGuard, WarnLimiter, raise_open_files_limit
from common.ready import mark_ready
from common.zap import Guard, server_guard
from weight_sync.config import WeightSyncConfig, endpoint
from weight_sync.messages import (
    MAX_MESSAGE_BYTES,
    Ack,
    Done,
    Error,
    Go,
    Idle,
    Member,
    Offer,
    PendingRequest,
    Poll,
    ProtocolError,
    Ready,
    Register,
    Registered,
    RoundInfo,
    RoundResult,
    Status,
    StatusRequest,
    Unregister,
    decode,
    encode,
    short,
)

log = logging.getLogger("conveyor.weight_sync.service")
# With CurveZMQ on (common/curve.py), what each role may ask; a generator's requests must also
# carry its own key's name as worker_id, so one generator cannot act for another.
REQUEST_ROLES = {Register: ("generator",), Poll: ("generator",), Done: ("generator",), Unregister: ("generator",),
                 Ready: ("learner",), PendingRequest: ("learner",), RoundResult: ("learner",), StatusRequest: ROLES}


@dataclass
class Generator:
    worker_id: str
    engine_kind: str
    world_size: int
    version: int
    last_seen: float
    dead: bool = False  # dropped by a round; revived by its next poll
    absent: bool = False  # missed a round's join window (busy or gone); back at its next message
    offer: RoundInfo | None = None  # a round not yet handed out
    round_id: int | None = None  # the round it was handed (until it polls again or reports done)
    load_s: float = 0.0


@dataclass
class Round:
    round_id: int
    version: int
    catch_up: bool
    members: dict[str, int] = field(default_factory=dict)  # worker id -> first rank
    next_rank: int = 1
    state: str = "forming"  # forming (catch-up, unclaimed) | running | closed
    created: float = 0.0
    unclaimed: int = 0  # a publish round's offers not yet picked up by their generators' polls


class SyncState:
    """The service's state and its answer to each message (no sockets: easy to test)."""

    def __init__(self, cfg: WeightSyncConfig, clock=time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.generators: dict[str, Generator] = {}
        self.rounds: dict[int, Round] = {}
        self.current: Ready | None = None
        self.forming: Round | None = None  # the open catch-up round
        self.sender_serving_until = 0.0
        self.next_round_id = 1
        self.last_round: dict = {}
        self.last_fanout: dict = {}  # the latest publish round whose every offer was picked up, and how fast
        self.counts = {"rounds": 0, "catch_up_rounds": 0, "errors": 0, "dropped": 0}
        self._handlers = {Register: self.on_register, Poll: self.on_poll, Done: self.on_done,
                          Unregister: self.on_unregister, Ready: self.on_ready, PendingRequest: self.on_pending,
                          RoundResult: self.on_round_result, StatusRequest: lambda _: Status(self.status())}

    @property
    def current_version(self) -> int:
        return self.current.version if self.current else -1

    # ---- dispatch --------------------------------------------------------------------------

    def handle(self, msg):
        """The reply to one request (a reply type sent as a request is refused)."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return Error(f"{type(msg).__name__} is a reply, not a request", "envelope.type")
        return handler(msg)

    # ---- generators ------------------------------------------------------------------------

    def on_unregister(self, m: Unregister) -> Ack:
        self.generators.pop(m.worker_id, None)
        return Ack("unregistered")

    def on_register(self, m: Register):
        g = self.generators.get(m.worker_id)
        if g is None or g.engine_kind != m.engine_kind or g.world_size != m.world_size:
            g = self.generators[m.worker_id] = Generator(m.worker_id, m.engine_kind, m.world_size, m.version,
                                                         self.clock())
        else:  # the same generator again (its client reconnected): keep what we know
            g.last_seen, g.dead, g.absent, g.version = self.clock(), False, False, m.version
        return Registered(self.current_version, self.cfg.mode)

    def _known(self, worker_id: str, where: str) -> Generator | Error:
        g = self.generators.get(worker_id)
        if g is None:
            return Error(f"unknown worker {short(worker_id)}: register first", f"{where}.worker_id")
        g.last_seen = self.clock()
        g.dead = g.absent = False
        return g

    def on_poll(self, m: Poll):
        g = self._known(m.worker_id, "poll")
        if isinstance(g, Error):
            return g
        g.version = m.version
        if g.offer is not None:
            info, g.offer = g.offer, None
            self._claimed(info.round_id)
            return Offer(info)
        if g.round_id is not None:  # polling again: it is done with the round it was handed
            self._leave(g)
        cur = self.current
        if cur is not None and g.version < cur.version and self.cfg.catch_up:
            info = self._catch_up(g)
            if info is not None:
                return Offer(info)
        return Idle(self.current_version, 0.5)

    def on_done(self, m: Done):
        g = self._known(m.worker_id, "done")
        if isinstance(g, Error):
            return g
        if m.ok:
            g.version = max(g.version, m.version)
            g.load_s = m.load_s
            if self.last_round.get("version") == m.version:
                self.last_round["load_s_max"] = max(self.last_round.get("load_s_max", 0.0), m.load_s)
        self._leave(g)
        return Ack(f"{m.worker_id} at v{g.version}")

    def _leave(self, g: Generator) -> None:
        r = self.rounds.get(g.round_id) if g.round_id is not None else None
        if r is not None and r.state == "forming":
            r.members.pop(g.worker_id, None)
        g.round_id = None

    # ---- rounds ----------------------------------------------------------------------------

    def _new_round(self, version: int, catch_up: bool) -> Round:
        r = Round(self.next_round_id, version, catch_up, created=self.clock())
        self.next_round_id += 1
        self.rounds[r.round_id] = r
        # closed rounds are only kept for a while (status, late messages)
        for rid in [rid for rid, old in self.rounds.items() if old.state == "closed"][:-16]:
            del self.rounds[rid]
        return r

    def _add(self, r: Round, g: Generator) -> RoundInfo:
        """Make `g` a member of `r`; its view of the round."""
        cur = self.current
        r.members[g.worker_id] = r.next_rank
        info = RoundInfo(r.round_id, r.version, cur.backend, self.cfg.mode, cur.timeout_s, r.catch_up, cur.manifest,
                         bucket_bytes=max(cur.manifest.buckets, default=0), host=cur.host, port=cur.port,
                         path=cur.path, rank=r.next_rank, local_world_size=g.world_size,
                         world_size=r.next_rank + g.world_size, adapter=cur.adapter, shm=cur.shm,
                         secret=cur.secret)
        r.next_rank += g.world_size
        g.round_id = r.round_id
        return info

    def _eligible(self, g: Generator) -> bool:
        return not g.dead and not g.absent and self.clock() - g.last_seen <= self.cfg.stale_after_s

    def on_ready(self, m: Ready):
        if self.current is not None and m.version < self.current.version:
            return Error(f"version {m.version} is older than the current {self.current.version}", "ready.version")
        self.current = m
        cancelled = []
        if self.forming is not None:  # its members wait for the old version: release them
            cancelled.append(self.forming.round_id)
            for wid in self.forming.members:
                if wid in self.generators:
                    self.generators[wid].round_id = None
            self.forming.state = "closed"
            self.forming = None
        r = self._new_round(m.version, catch_up=False)
        r.state = "running"
        for g in self.generators.values():
            if self._eligible(g):
                g.offer = self._add(r, g)  # replaces any older offer never picked up
        r.unclaimed = len(r.members)
        self.counts["rounds"] += 1
        members = [Member(wid, rank, self.generators[wid].world_size) for wid, rank in r.members.items()]
        if m.backend == "disk":  # nothing to coordinate: members read the folder at their next poll
            r.state = "closed"
            self.last_round = {"round_id": r.round_id, "version": m.version, "backend": "disk",
                               "members": [x.worker_id for x in members], "path": m.path}
        return Go(r.round_id, m.version, members, r.next_rank, False, cancelled)

    def _claimed(self, round_id: int) -> None:
        """One offer of publish round `round_id` picked up; the last one gives the round's fan-out
        (from `ready` to every member holding its offer: what polling costs a publish)."""
        r = self.rounds.get(round_id)
        if r is None or r.unclaimed <= 0:
            return
        r.unclaimed -= 1
        if not r.unclaimed:
            self.last_fanout = {"round_id": r.round_id, "version": r.version, "members": len(r.members),
                                "fanout_s": round(self.clock() - r.created, 4)}

    def _catch_up(self, g: Generator) -> RoundInfo | None:
        cur = self.current
        if cur.backend == "disk":
            r = self._new_round(cur.version, catch_up=True)
            info = self._add(r, g)
            r.state = "closed"  # nothing to coordinate: the generator reads the folder
            self.counts["catch_up_rounds"] += 1
            return info
        if not cur.can_catch_up or self.clock() > self.sender_serving_until:
            return None
        if self.forming is None:
            self.forming = self._new_round(cur.version, catch_up=True)
        return self._add(self.forming, g)

    def on_pending(self, m: PendingRequest):
        cur = self.current
        if cur is None or m.sender_id != cur.sender_id or m.version != cur.version:
            return Idle(self.current_version, 0.5)
        self.sender_serving_until = self.clock() + m.next_within_s
        r = self.forming
        if r is None or not r.members:
            return Idle(self.current_version, 0.5)
        self.forming = None
        r.state = "running"
        self.counts["catch_up_rounds"] += 1
        members = [Member(wid, rank, self.generators[wid].world_size) for wid, rank in r.members.items()
                   if wid in self.generators]
        return Go(r.round_id, r.version, members, r.next_rank, True, [])

    def on_round_result(self, m: RoundResult):
        r = self.rounds.get(m.round_id)
        if r is not None:
            r.state = "closed"
        for wid in m.failed:
            g = self.generators.get(wid)
            if g is not None:
                g.dead = True
                g.round_id = None
                self.counts["dropped"] += 1
        for wid in m.missed:
            g = self.generators.get(wid)
            if g is not None and g.round_id == m.round_id:
                g.round_id = None
                # a generator gone before joining must not cost every later publish a join window:
                # left out until it is heard from again (a busy one then catches up at its next poll)
                g.absent = True
                if g.offer is not None and g.offer.round_id == m.round_id:
                    g.offer = None  # never picked up: its next poll gets a catch-up instead
                    if r is not None:
                        r.unclaimed -= 1
        self.last_round = {"round_id": m.round_id, "version": m.version, "ok": list(m.ok), "missed": list(m.missed),
                           "failed": list(m.failed), **msgspec.structs.asdict(m.stats)}
        return Ack(f"round {m.round_id} closed")

    # ---- status ----------------------------------------------------------------------------

    def status(self) -> dict:
        now = self.clock()
        cur = self.current_version
        gens = {}
        for g in self.generators.values():
            gens[g.worker_id] = {
                "engine_kind": g.engine_kind, "world_size": g.world_size, "version": g.version,
                "lag": (cur - g.version) if cur >= 0 else 0, "dead": g.dead, "absent": g.absent,
                "last_seen_s": round(now - g.last_seen, 3), "load_s": g.load_s,
            }
        lags = [v["lag"] for v in gens.values() if not v["dead"]]
        return {
            "current_version": cur,
            "backend": self.current.backend if self.current else "",
            "generators": gens,
            "max_lag": max(lags, default=0),
            "last_round": dict(self.last_round),
            "last_fanout": dict(self.last_fanout),
            **self.counts,
        }


# What the ROUTER queues per peer, in whole messages (libzmq counts messages; MAXMSGSIZE bounds each
# frame). Requests: a peer has one in flight, and past RCV_HWM it is simply not read (TCP pushes
# back). Replies: a ROUTER drops those past SND_HWM, so that one is roomier: the loop answers faster
# than libzmq's I/O thread hands small replies on, and a peer with a burst of requests in flight
# must still get every answer. A peer that never reads can hold no more than SND_HWM replies (the
# large one, a round's offer, is handed out once), and the memory guard bounds what they weigh.
RCV_HWM = 16
SND_HWM = 1024
POLL_MS = 100
DRAIN = 256  # requests served per wake-up before the stop flag and the memory guard are looked at


class WeightSyncService:
    """The ROUTER loop around `SyncState`: one request, one reply, never blocking on anyone.

    Nothing a peer sends stops the loop or makes it hold memory without bound: a malformed request
    gets an `error` (counted in `malformed`), an unexpected exception one too (`internal_errors`),
    warnings are rate-limited, frames are capped (MAXMSGSIZE) and so are the messages queued per
    peer. libzmq cannot bound a multipart message that never ends; when the service runs as a
    process of its own (`serve`), a memory guard drops every connection past a budget
    (`memory_resets`; `common.guards.MemoryGuard`, the buffer's rule too).
    """

    def __init__(self, cfg: WeightSyncConfig, context: zmq.Context | None = None, guard_memory: bool = False):
        self.cfg = cfg
        self.state = SyncState(cfg)
        self.state.counts.update(malformed=0, internal_errors=0, memory_resets=0)
        self.warnings = WarnLimiter(log)
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._guard_memory = guard_memory
        self.guard = server_guard(cfg.curve, cfg.host, self._ctx, "weight-sync service")
        self.state.counts.update(refused_requests=0)

    def _bind(self, tries: int = 1) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        if self.guard is not None:
            self.guard.secure(sock, "weight_sync", ("learner", "generator", "admin"))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.SNDHWM, SND_HWM)
        for attempt in range(tries):  # (binding again: the old listener may take a moment to go)
            try:
                sock.bind(endpoint(self.cfg.host, self.cfg.port))
                return sock
            except zmq.ZMQError:
                if attempt + 1 >= tries:
                    sock.close(0)
                    raise
                time.sleep(0.05)

    def serve_forever(self) -> None:
        sock = self._bind()
        self._ready.set()
        log.info("weight-sync service on %s", endpoint(self.cfg.host, self.cfg.port))
        mark_ready("weight_sync", endpoint=endpoint(self.cfg.host, self.cfg.port))
        # what it keeps on purpose is one manifest (the current version's) and replies carrying it
        # checked every 50 ms (one read of /proc): a peer that sends fast and hangs up holds its
        # frames for a fraction of a second, and must still be seen past the budget
        memory = MemoryGuard(4 * MAX_MESSAGE_BYTES, every_s=0.05) if self._guard_memory else None
        try:
            while not self._stop.is_set():
                if sock.poll(POLL_MS, zmq.POLLIN):
                    # what is queued is served before polling again: one poll per burst, not per request
                    # (a publish to 1,000 generators is answered by as many polls within its poll interval)
                    for _ in range(DRAIN):
                        if not self._serve_one(sock):
                            break
                if memory is not None and memory.over():
                    self.state.counts["memory_resets"] += 1
                    log.warning("the weight-sync service grew past its memory budget (a peer sending a message "
                                "that never ends?): dropping every connection; peers reconnect")
                    sock.close(0)
                    sock = self._bind(tries=100)
                    memory.reset()
        finally:
            sock.close(0)
            if self.guard is not None:
                self.guard.close()

    def _serve_one(self, sock: zmq.Socket) -> bool:
        """Answer the next request queued on `sock`; False when there was none."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        who = Guard.who(frames[-1]) if self.guard is not None else None
        try:
            reply = encode(self._answer([f.bytes for f in frames[1:]], who))
        except Exception:  # e.g. a reply that cannot be encoded: still an answer, and the loop goes on
            self.state.counts["internal_errors"] += 1
            self.warnings.warn("internal", "weight-sync reply failed", exc_info=True)
            reply = encode(Error("internal error in the weight-sync service", ""))
        # a ROUTER never blocks: a reply to a peer past SND_HWM (it does not read) is dropped
        sock.send_multipart([frames[0], b"", reply], zmq.NOBLOCK)
        return True

    def _answer(self, body: list[bytes], who: str | None = None):
        try:
            if len(body) != 2 or body[0] != b"":
                raise ProtocolError("message", f"expected [empty, payload] frames, got {len(body)} frames")
            msg = decode(body[1])
            refusal = self._refusal(msg, who) if self.guard is not None else None
            reply = refusal or self.state.handle(msg)
        except ProtocolError as e:
            self.state.counts["malformed"] += 1
            reply = Error(str(e), e.field)
        except Exception as e:  # a bug must not take the service down: answer and keep serving
            self.state.counts["internal_errors"] += 1
            self.warnings.warn("internal", "weight-sync request failed", exc_info=True)
            reply = Error(f"{type(e).__name__}: {str(e)[:200]}", "")
        if isinstance(reply, Error):
            self.state.counts["errors"] += 1
            self.warnings.warn("refused", "refused a request: %s", reply.message)
        return reply

    def _refusal(self, msg, who: str | None) -> Error | None:
        """Why the key named `who` may not make request `msg` (CURVE on), or None."""
        why = role_refusal(type(msg).__name__, who, REQUEST_ROLES.get(type(msg), ()))
        if not why and role_of(who) == "generator" and getattr(msg, "worker_id", who) != who:
            why = f"{type(msg).__name__} for {getattr(msg, 'worker_id')!r} from the key of {who}"
        if not why:
            return None
        self.state.counts["refused_requests"] += 1
        return Error(why, "permission")

    def start(self) -> threading.Thread:
        """Serve from a daemon thread (tests, the local launcher); returns once bound."""
        t = threading.Thread(target=self.serve_forever, name="weight-sync-service", daemon=True)
        t.start()
        if not self._ready.wait(10):
            raise RuntimeError("weight-sync service did not start")
        return t

    def stop(self) -> None:
        self._stop.set()


def serve(cfg: WeightSyncConfig) -> None:
    """Run the service until SIGINT/SIGTERM."""
    import signal

    raise_open_files_limit(log)  # one descriptor per connected generator
    service = WeightSyncService(cfg, guard_memory=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    service.serve_forever()
