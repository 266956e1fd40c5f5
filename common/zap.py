"""The service side of CurveZMQ (`common/curve.py` has the keys and the rules): a ZAP handler that
admits only the run's keys, of the roles a socket is for, and counts every peer it turns away.

`server_guard(mode, host, ctx, service)` is what a service calls before it binds: None when CURVE
is off for it, else a `Guard` whose `secure(sock, name, roles)` makes a socket a CURVE server and
whose `who(frame)` names the key that sent a message. Refusals are counted by socket name in
`Guard.refused`: by ZAP (a key not of the run, or of a role the socket is not for) and from the
sockets' monitor events (a peer without CURVE at all, or a broken handshake).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from common.curve import SERVER, KeyFolderError, curve_on, ensure_pair, keys_folder, read_key, role_of

log = logging.getLogger("conveyor.curve")


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, naming each admitted peer after its key file instead of its key."""

    keyring: "_Keyring"

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.keyring.name_of(zmq.utils.z85.encode(client_public_key)) or "?"


class _Keyring:
    """The folder's public keys by name, read again when an unknown key knocks and the folder has
    changed since, so a generator that made its pair after the service started is admitted."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.names: dict[bytes, str] = {}
        self.policies: dict[str, frozenset[str]] = {}  # ZAP domain (socket) -> roles admitted
        self.refused: Counter = Counter()
        self._mtime = 0
        self._lock = threading.Lock()
        self.reload()

    def reload(self) -> None:
        mtime = self.folder.stat().st_mtime_ns
        names = {}
        for pub in self.folder.glob("*.pub"):
            if pub.stem != SERVER and (self.folder / f"{pub.stem}.secret").exists():
                try:
                    names[read_key(pub)] = pub.stem
                except (OSError, KeyFolderError):
                    continue
        with self._lock:
            self.names, self._mtime = names, mtime

    def name_of(self, key: bytes) -> str | None:
        name = self.names.get(key)
        if name is None and self.folder.stat().st_mtime_ns != self._mtime:
            self.reload()
            name = self.names.get(key)
        return name

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question for one connecting peer: may the holder of `key` use socket `domain`?"""
        name = self.name_of(key)
        ok = name is not None and role_of(name) in self.policies.get(domain, ())
        if not ok:
            self.refused[domain] += 1
            if self.refused[domain] in (1, 10, 100, 1000) or self.refused[domain] % 10000 == 0:
                log.warning("CURVE: refused a peer on %s (%s; %d refused there so far)", domain,
                            f"key of {name}, whose role may not use it" if name else "a key not of this run",
                            self.refused[domain])
        return ok


class _Watcher:
    """Counts the peers refused before ZAP is asked (a plain-TCP or malformed handshake on a CURVE
    socket), from the sockets' monitor events, in a thread of its own."""

    EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    def __init__(self, ctx: zmq.Context, keyring: _Keyring):
        self.ctx, self.keyring = ctx, keyring
        self.added: list[tuple[str, str]] = []  # (monitor endpoint, socket name), for the thread to connect
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.pipes = 0  # monitor pipes open (one per watched socket still open)

    def watch(self, sock: zmq.Socket, domain: str) -> None:
        addr = f"inproc://conveyor-curve-monitor-{id(self)}-{len(self.added)}"
        # (MONITOR_STOPPED comes when `sock` closes: its pipe is closed then, so a service that
        # rebinds its sockets, as the buffer's memory guard does, leaves none behind)
        sock.monitor(addr, self.EVENTS | zmq.EVENT_MONITOR_STOPPED)
        self.added.append((addr, domain))
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="curve-monitor", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller, socks, seen = zmq.Poller(), {}, 0
        try:
            while not self.stop.is_set():
                for addr, domain in self.added[seen:]:
                    s = self.ctx.socket(zmq.PAIR)
                    s.connect(addr)
                    poller.register(s, zmq.POLLIN)
                    socks[s] = domain
                    seen += 1
                for s, _ in poller.poll(200):
                    event = recv_monitor_message(s)
                    if event["event"] & self.EVENTS:
                        self.keyring.refused[socks[s]] += 1
                    elif event["event"] == zmq.EVENT_MONITOR_STOPPED:
                        poller.unregister(s)
                        del socks[s]
                        s.close(0)
                self.pipes = len(socks)
        except zmq.ContextTerminated:
            pass
        finally:
            for s in socks:
                s.close(0)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=2)


_GUARDS: dict[int, "Guard"] = {}
_GUARDS_LOCK = threading.Lock()


class Guard:
    """CURVE for one service's sockets in context `ctx`; the ZAP thread is shared by every guard of
    the context (ZeroMQ allows one handler per context)."""

    def __init__(self, ctx: zmq.Context, folder: Path):
        self.folder = folder
        self.server_public, self.server_secret = ensure_pair(folder, SERVER)
        with _GUARDS_LOCK:
            shared = _GUARDS.get(id(ctx))
            if shared is None or shared.ctx is not ctx:
                self.keyring = _Keyring(folder)
                self.auth = _Authenticator(ctx)
                self.auth.keyring = self.keyring
                self.auth.start()
                self.watcher = _Watcher(ctx, self.keyring)
                self.ctx, self.owners = ctx, [self]
                _GUARDS[id(ctx)] = self
            else:
                self.keyring, self.auth, self.watcher = shared.keyring, shared.auth, shared.watcher
                self.ctx, self.owners = ctx, shared.owners
                self.owners.append(self)

    @property
    def refused(self) -> Counter:
        return self.keyring.refused

    def secure(self, sock: zmq.Socket, domain: str, roles: tuple[str, ...]) -> zmq.Socket:
        """Make `sock` (before it binds) a CURVE server admitting only the run's keys of `roles`."""
        self.keyring.policies[domain] = frozenset(roles)
        self.auth.configure_curve_callback(domain, self.keyring)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        self.watcher.watch(sock, domain)
        return sock

    @staticmethod
    def who(frame) -> str | None:
        """The key name of the peer that sent `frame` (a `zmq.Frame` from a CURVE socket)."""
        try:
            return frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            return None

    def close(self) -> None:
        with _GUARDS_LOCK:
            if self in self.owners:
                self.owners.remove(self)
            if not self.owners:
                self.watcher.close()
                self.auth.stop()
                if _GUARDS.get(id(self.ctx)) is not None and _GUARDS[id(self.ctx)].owners is self.owners:
                    del _GUARDS[id(self.ctx)]


def server_guard(mode: str, host: str, ctx: zmq.Context, service: str) -> Guard | None:
    """The guard of a service binding `host` under `mode`, or None when CURVE is off for it."""
    if not curve_on(mode, host):
        return None
    why = f"the {service} binds {host}" + (" (not loopback)" if mode == "auto" else " with curve on")
    return Guard(ctx, keys_folder(required_by=why))
