"""The weight-sync service's sockets and loop: one ROUTER, one request, one reply, never blocking.

    run(cfg)                 # the role: until SIGINT/SIGTERM (or `stop`), its exit status
    WeightSyncService(cfg)   # the loop itself: `start()` serves from a thread (tests, local runs)

Every request is decoded, checked against the peer's CURVE role when CURVE is on (`REQUEST_ROLES`),
and answered at once by `weight_sync/state.py`'s `SyncState`, which holds who has which version and
who joins the next round. The service never moves weights and never waits on anyone.
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from common.curve import ROLES, role_of, role_refusal
from common.guards import MemoryGuard, WarnLimiter, raise_open_files_limit
from common.ready import mark_ready
from common.zap import Guard, server_guard
from weight_sync.config import WeightSyncConfig, endpoint
from weight_sync.messages import (
    MAX_MESSAGE_BYTES,
    Done,
    Error,
    PendingRequest,
    Poll,
    ProtocolError,
    Ready,
    Register,
    RoundResult,
    StatusRequest,
    Unregister,
    decode,
    encode,
)
from weight_sync.state import SyncState

log = logging.getLogger("conveyor.weight_sync.service")
# With CurveZMQ on (common/curve.py), what each role may ask; a generator's requests must also
# carry its own key's name as worker_id, so one generator cannot act for another.
REQUEST_ROLES = {Register: ("generator",), Poll: ("generator",), Done: ("generator",), Unregister: ("generator",),
                 Ready: ("learner",), PendingRequest: ("learner",), RoundResult: ("learner",), StatusRequest: ROLES}


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
    process of its own (`run`), a memory guard drops every connection past a budget
    (`memory_resets`; `common.guards.MemoryGuard`, the buffer's rule too). `stop`: an event of the
    caller's that ends the loop as `stop()` does.
    """

    def __init__(self, cfg: WeightSyncConfig, context: zmq.Context | None = None, guard_memory: bool = False,
                 stop: threading.Event | None = None):
        self.cfg = cfg
        self.state = SyncState(cfg)
        self.state.counts.update(malformed=0, internal_errors=0, memory_resets=0)
        self.warnings = WarnLimiter(log)
        self._ctx = context or zmq.Context.instance()
        self._stop = stop if stop is not None else threading.Event()
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


def run(cfg: WeightSyncConfig, stop: threading.Event | None = None, *, context: zmq.Context | None = None) -> int:
    """The weight-sync role: serve `cfg` (the `weight_sync:` section) as a process of its own (the
    memory guard on) until `stop` is set, or SIGINT/SIGTERM when called from the main thread (the
    handlers before come back at the end); the exit status, 0 once stopped.

    With CurveZMQ on (`cfg.curve`, for `cfg.host`) the service speaks as the run's server key
    (`CONVEYOR_KEYS`): a key folder that is missing or unsafe raises `common.curve.KeyFolderError`
    before anything is bound (`launch.entry.role_main` says it in one line, exit code 2).
    `context`: the ZeroMQ context to serve on (the process's shared one by default)."""
    import signal

    raise_open_files_limit(log)  # one descriptor per connected generator
    service = WeightSyncService(cfg, context, guard_memory=True, stop=stop)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: service.stop())
    try:
        service.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
