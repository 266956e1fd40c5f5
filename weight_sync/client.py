"""The generator's side of the control plane, and the request helper the sender shares.

A generator's loop (finish mode):

    ws = GeneratorSyncClient(host, port, worker_id)
    ws.register("vllm")
    info = ws.wait_current(timeout_s=120)        # a newcomer first catches up with the learner
    if info: engine.receive_weights(info); ws.done(info.version)
    while True:
        info = ws.poll()                          # non-blocking: a round to join now, or None
        if info: engine.receive_weights(info); ws.done(info.version)
        ... lease prompts, generate a batch, push rollouts ...

where `info` is a `RoundInfo` and `engine.receive_weights(info)` loads it and stamps the engine
with `info.version` (vLLM: through `collective_rpc` into `actors.engines.vllm.worker.WorkerExtension`;
transformers: `weight_sync.receiver.receive_into_model`). If it raises (`RoundMissed`: the round
went on without this generator; its weights are untouched), report `done(version, ok=False)` or
nothing: the next poll brings a catch-up round.

One client per thread (ZeroMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from common.channel import Channel
from common.curve import client_options
from common.wire import expect
from weight_sync.config import endpoint
from weight_sync.messages import (
    Ack,
    Done,
    Error,
    Idle,
    Msg,
    Offer,
    Poll,
    Register,
    Registered,
    RoundInfo,
    Status,
    StatusRequest,
    Unregister,
    decode,
    encode,
)

log = logging.getLogger("conveyor.weight_sync.client")


class WeightSyncError(RuntimeError):
    """The service answered a request with an error; `field` names the bad part when there is one."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message + (f" (field {field})" if field else ""))
        self.field = field


def channel(host: str, port: int, timeout_s: float = 10.0, context: zmq.Context | None = None) -> Channel:
    """A request/reply channel to the weight-sync service at `host:port` (CurveZMQ with the run's keys)."""
    return Channel(endpoint(host, port), "weight-sync service", timeout_s, context, options=client_options("admin"))


def ask(ch: Channel, msg: Msg, timeout_s: float | None = None) -> Msg:
    """Send `msg` and return the service's reply; an `error` reply raises `WeightSyncError`, a
    silent service `TimeoutError`, a malformed reply `ProtocolError`."""
    reply = decode(ch.request([encode(msg)], type(msg).__name__, timeout_s))
    if isinstance(reply, Error):
        raise WeightSyncError(f"service refused {type(msg).__name__}: {reply.message}", reply.field)
    return reply


class GeneratorSyncClient:
    """A generator's handle on the weight-sync service (see the module docstring for the loop)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 5600, worker_id: str = "generator0", *,
                 timeout_s: float = 10.0, context: zmq.Context | None = None):
        self.worker_id = worker_id
        self.channel = channel(host, port, timeout_s, context)
        self.version = -1  # the version this generator's weights are at
        self.current_version = -1  # the learner's latest, as last heard
        self.mode = "finish"
        self.retry_after_s = 0.5
        self._registration: Register | None = None

    def _ask(self, msg: Msg) -> Msg:
        return ask(self.channel, msg)

    def register(self, engine_kind: str, world_size: int = 1, version: int = -1) -> dict:
        """Announce this generator; `world_size`: its engine's workers (tensor-parallel ranks)."""
        self.version = version
        self._registration = Register(self.worker_id, engine_kind, world_size, version)
        reply = self._ask(self._registration)
        expect(reply, Registered)
        self.current_version, self.mode = reply.current_version, reply.mode
        return {"current_version": reply.current_version, "mode": reply.mode}

    def poll(self) -> RoundInfo | None:
        """A round this generator should join now, or None. Does not wait."""
        try:
            reply = self._ask(Poll(self.worker_id, self.version))
        except WeightSyncError as e:
            if e.field != "poll.worker_id" or self._registration is None:
                raise
            # the service restarted and forgot us: register again, then ask once more
            self._ask(msgspec.structs.replace(self._registration, version=self.version))
            reply = self._ask(Poll(self.worker_id, self.version))
        if isinstance(reply, Offer):
            self.current_version = max(self.current_version, reply.info.version)
            return reply.info
        expect(reply, Idle)
        self.current_version, self.retry_after_s = reply.current_version, reply.retry_after_s
        return None

    def wait_current(self, timeout_s: float) -> RoundInfo | None:
        """The round that brings this generator to the learner's current version (blocking).

        None when there is nothing to catch up with (nothing published yet, or already current),
        and also when no round came within `timeout_s` (logged: the sender is not serving catch-up
        rounds; the generator then starts on its own weights, stamped with their true version, and
        joins the next publish).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.poll()
            if info is not None:
                return info
            if self.current_version < 0 or self.version >= self.current_version:
                return None
            if time.monotonic() + self.retry_after_s > deadline:
                log.warning("%s: no round to version %d within %.0fs (is the sender serving catch-up "
                            "rounds?); going on at version %d", self.worker_id, self.current_version, timeout_s,
                            self.version)
                return None
            time.sleep(min(self.retry_after_s, 0.2))

    def done(self, version: int, ok: bool = True, load_s: float = 0.0, error: str = "") -> None:
        """Report that this generator's weights are now at `version` (or that it gave up)."""
        if ok:
            self.version = max(self.version, version)
        reply = self._ask(Done(self.worker_id, version, ok, float(load_s), error[:4000]))
        expect(reply, Ack)

    def status(self) -> dict:
        reply = self._ask(StatusRequest())
        expect(reply, Status)
        return reply.values

    def unregister(self) -> None:
        self._ask(Unregister(self.worker_id))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "GeneratorSyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
