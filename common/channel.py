"""One blocking request/reply channel over a DEALER socket, used by every client of a service, and
the two calls that move a multipart message on any of the project's sockets.

A request is `[b"", *frames]` (the empty delimiter a ROUTER service expects); a reply is read
within a bound or the call raises `TimeoutError` naming the service and the request. A timed-out
request closes the socket, so a late reply is never taken for the answer to the next request.

`recv_frames` and `send_frames` are pyzmq's `recv_multipart(copy=False)` and
`send_multipart(copy=False)` with the same semantics, at less than half their cost per part:
pyzmq asks the socket for RCVMORE after every part it receives (where the part itself knows) and
builds its flags as enums in Python for every part it sends. A rollout is one part, so on the
buffer's path these calls run once per rollout each way.
"""

from __future__ import annotations

from typing import Sequence

import zmq

from common.wire import ProtocolError

_SNDMORE = int(zmq.SNDMORE)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """The next whole message on `sock`, as `zmq.Frame`s (nothing copied). `flags` apply to the
    first part (`zmq.NOBLOCK`: raise `zmq.Again` if none is there); the rest of a multipart
    message is already there once its first part is (ZeroMQ delivers messages whole)."""
    recv = sock.recv
    part = recv(int(flags), False)
    parts = [part]
    while part.more:
        part = recv(0, False)
        parts.append(part)
    return parts


def send_frames(sock: zmq.Socket, frames: Sequence, flags: int = 0) -> None:
    """Send `frames` as one message without copying them (`zmq.Frame`s, bytes, memoryviews); with
    `zmq.NOBLOCK`, `zmq.Again` means none of it was queued."""
    send, flags = sock.send, int(flags)
    more = flags | _SNDMORE
    for f in frames[:-1]:
        send(f, more, False)
    send(frames[-1], flags, False)


def send_reply(sock: zmq.Socket, frames: Sequence) -> bool:
    """A ROUTER's reply (the socket has ROUTER_MANDATORY set): True once queued, False where its peer
    is gone or does not read (its queue stays full). The socket hears how much a peer has read only
    in batches of half its high-water mark, and processes that news lazily under load: a reply
    refused for a full queue is tried once more after the socket's pending commands are processed
    (reading ZMQ_EVENTS does that), so that a peer reading each reply never loses one."""
    for attempt in (0, 1):
        try:
            send_frames(sock, frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if attempt:
                return False
            sock.getsockopt(zmq.EVENTS)
        except zmq.ZMQError:  # EHOSTUNREACH: the peer has disconnected
            return False
    return False


class Channel:
    """`request(frames) -> reply frames` to one service endpoint; the socket opens on first use."""

    def __init__(self, endpoint: str, service: str, timeout_s: float = 10.0,
                 context: zmq.Context | None = None, options: dict | None = None):
        self.endpoint = endpoint
        self.service = service  # named in errors: "buffer at tcp://...", "weight-sync service at ..."
        self.timeout_s = timeout_s
        self.options = dict(options or {})  # socket options set before connecting (e.g. CURVE keys)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None

    def socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            for opt, value in self.options.items():
                s.setsockopt(opt, value)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def request(self, frames: Sequence, what: str, timeout_s: float | None = None) -> list[memoryview]:
        """Send `frames`, return the reply's frames (delimiter removed) as memoryviews.

        `what` names the request in a timeout (usually the message type)."""
        sock = self.socket()
        send_frames(sock, [b"", *frames])
        timeout_ms = max(1, int(1000 * (self.timeout_s if timeout_s is None else timeout_s)))
        if not sock.poll(timeout_ms, zmq.POLLIN):
            self.close()
            raise TimeoutError(f"{self.service} at {self.endpoint} did not answer {what} "
                               f"within {timeout_ms / 1000:.1f}s")
        reply = recv_frames(sock)
        if len(reply) < 2 or len(reply[0]):
            self.close()
            raise ProtocolError("reply", f"expected [empty, payload...] frames, got {len(reply)} frame(s)")
        return [f.buffer for f in reply[1:]]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
