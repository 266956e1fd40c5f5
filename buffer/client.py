"""The blocking client that generators, scorers and learner ranks use to talk to the buffer.

One client per thread (ZeroMQ sockets are not thread-safe). Requests go through a
`common.channel.Channel` (a DEALER socket to the buffer's ROUTER); a request that times out closes
and reopens the socket (so a lost reply never wedges the client) and raises `TimeoutError`.
Rollout streams use PUSH/PULL sockets, whose high-water marks give back-pressure.
"""

from __future__ import annotations

import time
from typing import Sequence

import zmq

from buffer.config import endpoints
from buffer.messages import (
    DEFAULT_LIMITS,
    Ack,
    Batch,
    BatchRequest,
    Error,
    GroupFailed,
    LeaseGrant,
    LeaseRenew,
    LeaseRequest,
    Limits,
    Metrics,
    MetricsRequest,
    ProtocolError,
    Resume,
    Rollout,
    RolloutsMsg,
    ScoredMsg,
    ScoredRollout,
    SetVersion,
    Wait,
    decode,
    encode,
)
from common.channel import Channel, recv_frames, send_frames
from common.curve import apply, client_options
from common.wire import expect


class BufferError(RuntimeError):
    """The buffer answered a request with an error."""


class BufferDone(RuntimeError):
    """The buffer has nothing more to give (dataset exhausted, or shutting down)."""


class ResumeNeeded(BufferError):
    """The buffer was restored from disk and serves no batch before the learner's `resume` handshake."""


class BufferClient:
    """Small blocking API over the buffer's sockets; sockets are opened on first use."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5555, *, timeout_s: float = 30.0,
                 limits: Limits = DEFAULT_LIMITS, context: zmq.Context | None = None):
        self.endpoints = endpoints(host, port)
        self.timeout_s = timeout_s
        self.limits = limits
        self._ctx = context or zmq.Context.instance()
        self.curve = client_options("admin")  # CurveZMQ keys when the run has them (common/curve.py)
        self.channel = Channel(self.endpoints["control"], "buffer", timeout_s, context=self._ctx,
                               options=self.curve)
        self._push_rollouts: zmq.Socket | None = None
        self._push_scored: zmq.Socket | None = None
        self._pull_rollouts: zmq.Socket | None = None

    # ---- request/reply ---------------------------------------------------------------------

    def request(self, msg, timeout_s: float | None = None):
        """Send one control message and return the decoded reply; `Error` replies raise `BufferError`."""
        frames = self.channel.request(encode(msg), type(msg).__name__, timeout_s)
        reply = decode(frames, self.limits)
        if isinstance(reply, Error):
            if reply.field == "resume":
                raise ResumeNeeded(reply.message)
            raise BufferError(f"buffer refused {type(msg).__name__}: {reply.message}"
                              + (f" (field {reply.field})" if reply.field else ""))
        return reply

    def lease(self, worker_id: str, max_groups: int = 1, version: int = 0) -> LeaseGrant | Wait:
        """A lease of up to `max_groups` prompt groups, or `Wait` (admission control or end of data)."""
        return self.request(LeaseRequest(worker_id, max_groups, version))

    def renew(self, lease_id: int) -> Ack:
        return self.request(LeaseRenew(lease_id))

    def group_failed(self, lease_id: int, group_id: int, reason: str) -> Ack:
        return self.request(GroupFailed(lease_id, group_id, reason))

    def submit_scored(self, scored: Sequence[ScoredRollout]) -> Ack:
        """Scored rollouts over the control socket, acknowledged (slower than `push_scored`)."""
        return self.request(ScoredMsg(list(scored)))

    def set_version(self, version: int) -> Ack:
        return self.request(SetVersion(version))

    def resume(self, step: int, trained: Sequence[int]) -> Ack:
        """The learner's handshake: it continues at `step`, its lineage trained the groups `trained`."""
        return self.request(Resume(step, list(trained)))

    def metrics(self) -> dict[str, float]:
        reply = self.request(MetricsRequest())
        return expect(reply, Metrics).values

    def get_batch(self, step: int, rank: int = 0, world_size: int = 1, timeout_s: float | None = None,
                  poll_s: float = 0.05, on_wait=None, report_every_s: float = 30.0) -> Batch:
        """This rank's share of step `step`'s batch, waiting until the buffer has it.

        Raises `TimeoutError` after `timeout_s` (default: the client's), naming what the buffer
        last said it waits for; `BufferDone` when the data has run out. `on_wait(waited_s, reason)`
        is called every `report_every_s` of waiting with the buffer's diagnosis.
        """
        t0 = time.monotonic()
        deadline = t0 + (self.timeout_s if timeout_s is None else timeout_s)
        next_report = t0 + report_every_s
        while True:
            reply = self.request(BatchRequest(step, rank, world_size))
            if isinstance(reply, Batch):
                return reply
            if isinstance(reply, Wait):
                if reply.done:
                    raise BufferDone(reply.reason)
                now = time.monotonic()
                if now + reply.retry_after_s > deadline:
                    raise TimeoutError(f"no batch for step {step} rank {rank} after {now - t0:.0f}s: {reply.reason}")
                if on_wait is not None and now >= next_report:
                    on_wait(now - t0, reply.reason)
                    next_report = now + report_every_s
                time.sleep(min(reply.retry_after_s, poll_s) if poll_s else reply.retry_after_s)
                continue
            raise BufferError(f"unexpected reply to batch_request: {type(reply).__name__}")

    # ---- streams ---------------------------------------------------------------------------

    def _push(self, which: str) -> zmq.Socket:
        attr = "_push_rollouts" if which == "relay_in" else "_push_scored"
        s = getattr(self, attr)
        if s is None:
            s = apply(self._ctx.socket(zmq.PUSH), self.curve)
            s.setsockopt(zmq.LINGER, 5000)  # give queued rollouts a chance to leave on close
            s.setsockopt(zmq.SNDHWM, 1000)
            s.connect(self.endpoints[which])
            setattr(self, attr, s)
        return s

    def push_rollouts(self, rollouts: Sequence[Rollout]) -> None:
        """Generator -> scorers, through the buffer's relay. Blocks when the scorers fall behind."""
        send_frames(self._push("relay_in"), encode(RolloutsMsg(list(rollouts))))

    def push_scored(self, scored: Sequence[ScoredRollout]) -> None:
        """Scorer -> buffer, fire-and-forget over PUSH (TCP delivers it while both ends live)."""
        send_frames(self._push("ingest"), encode(ScoredMsg(list(scored))))

    def pull_rollouts(self, timeout_s: float = 1.0) -> list[Rollout]:
        """Scorer side: the next message of raw rollouts, or [] after `timeout_s`.

        A malformed message is skipped (it raises `ProtocolError` for the caller to log and count).
        """
        if self._pull_rollouts is None:
            s = apply(self._ctx.socket(zmq.PULL), self.curve)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 100)
            s.connect(self.endpoints["relay_out"])
            self._pull_rollouts = s
        if not self._pull_rollouts.poll(int(timeout_s * 1000), zmq.POLLIN):
            return []
        msg = decode([f.buffer for f in recv_frames(self._pull_rollouts)], self.limits)
        if not isinstance(msg, RolloutsMsg):
            raise ProtocolError("envelope.type", f"expected rollouts on the relay, got {type(msg).__name__}")
        return msg.rollouts

    def close(self) -> None:
        self.channel.close()
        for attr in ("_push_rollouts", "_push_scored", "_pull_rollouts"):
            s = getattr(self, attr)
            if s is not None:
                s.close()
                setattr(self, attr, None)

    def __enter__(self) -> "BufferClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
