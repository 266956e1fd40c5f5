"""One blocking request/reply channel over a DEALER socket, used by every client of a service.

A request is `[b"", *frames]` (the empty delimiter a ROUTER service expects); a reply is read
within a bound or the call raises `TimeoutError` naming the service and the request. A timed-out
request closes the socket, so a late reply is never taken for the answer to the next request.
"""

from __future__ import annotations

from typing import Sequence

import zmq

from common.wire import ProtocolError


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
        sock.send_multipart([b"", *frames], copy=False)
        timeout_ms = max(1, int(1000 * (self.timeout_s if timeout_s is None else timeout_s)))
        if not sock.poll(timeout_ms, zmq.POLLIN):
            self.close()
            raise TimeoutError(f"{self.service} at {self.endpoint} did not answer {what} "
                               f"within {timeout_ms / 1000:.1f}s")
        reply = sock.recv_multipart(copy=False)
        if len(reply) < 2 or reply[0].bytes != b"":
            self.close()
            raise ProtocolError("reply", f"expected [empty, payload...] frames, got {len(reply)} frame(s)")
        return [f.buffer for f in reply[1:]]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
