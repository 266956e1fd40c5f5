"""An emulated network link between two network namespaces, in user space: delay, jitter, loss, a rate cap, a partition.

Where the kernel has sch_netem, `tc qdisc add dev VETH root netem delay 50ms 10ms loss 1% rate 20mbit`
on a veth pair does the same; many kernels (containers, minimal builds) have no netem, no tc
classifiers and no iptables. This needs only /dev/net/tun:

    ns A: tap TA (10.213.X.1) <-fd-> this process <-fd-> tap TB (10.213.X.2) :ns B

The process opens two TAP devices (IFF_TAP | IFF_NO_PI) in the namespace it runs in; the caller
moves each into its namespace (`ip link set TAP netns NS`: the open file keeps working) and gives
it its address. Each Ethernet frame read from one tap is written to the other after what the link
costs it, as netem does without reordering:

- loss: dropped with probability `loss` (every frame alike: TCP, UDP, ARP);
- delay and jitter: ready at arrival + delay_ms + uniform(-jitter_ms, jitter_ms) (at least 0), but
  never before the frame ahead of it in the same direction (order kept);
- rate: a frame leaves once the link has sent the ones before it, len * 8 / rate_mbit us later
  (departure times: a token bucket of one frame's depth);
- queue: at most LIMIT frames wait per direction (netem's default limit); more are dropped;
- partition: every frame dropped, both ways, and those waiting too (a cable cut).

Control: one JSON object a line on stdin, answered by one line on stdout, applied at once:

    {"delay_ms": 50, "jitter_ms": 10, "loss": 0.01, "rate_mbit": 20}   -> {"ok": true, "link": {...}, "stats": {...}}
    {"partition": true} / {"partition": false}                          (the other settings stay)
    {"clear": true}                                                     a clean link again
    {"stats": true}                                                     the settings and the counters

Every answer has the settings (`link`) and, per direction, the frames `sent`, `lost` (loss),
`overflow` (the queue full), `cut` (a partition), `unsent` (the tap refused the write) and `queued`.

EOF on stdin ends the process, and the taps with it (they are not persistent). The first line it
prints, once both taps exist, is `{"ready": true, "taps": [TA, TB]}`. The taps get a large MTU
(MTU, set by the caller) so a transfer of megabytes is a few hundred frames, which a Python loop
forwards at hundreds of MB/s.

    python scripts/link.py TAP_A TAP_B [--seed N]
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import random
import select
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MTU = 65000  # the taps' MTU (a tap takes up to 65521)
FRAME_MAX = 65536 + 64  # the largest frame a read returns (MTU + Ethernet header, with room)
LIMIT = 1000  # frames waiting per direction, as netem's default `limit`
CLEAN = {"delay_ms": 0.0, "jitter_ms": 0.0, "loss": 0.0, "rate_mbit": 0.0, "partition": False}


def open_tap(name: str) -> int:
    """A new TAP device `name` in this process's namespace; its file descriptor (non-blocking)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def tap_unavailable() -> str:
    """Why this machine cannot make a TAP device ("" when it can)."""
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (the emulated link needs TAP devices)"
    try:
        os.close(open_tap(f"cvyprobe{os.getpid() % 100000}"))  # (not persistent: gone with the fd)
    except OSError as e:
        return f"cannot make a TAP device: {e}"
    return ""


class Direction:
    """Frames going one way: when each leaves, and the counters."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.queue: deque[tuple[float, bytes]] = deque()  # (departure time, frame), in departure order
        self.link_free = 0.0  # when the rate-capped link has sent everything queued
        self.sent = self.lost = self.overflow = self.cut = 0
        self.unsent = 0  # written to a tap that would not take them (down, or gone with its namespace)

    def admit(self, frame: bytes, now: float, link: dict) -> None:
        """Queue `frame` (arrived at `now`) with its departure time, or count it dropped."""
        if link["partition"]:
            self.cut += 1
            return
        if link["loss"] and self.rng.random() < link["loss"]:
            self.lost += 1
            return
        if len(self.queue) >= LIMIT:
            self.overflow += 1
            return
        ready = now + link["delay_ms"] / 1e3
        if link["jitter_ms"]:
            ready = max(now, ready + self.rng.uniform(-link["jitter_ms"], link["jitter_ms"]) / 1e3)
        if self.queue:
            ready = max(ready, self.queue[-1][0])  # no reordering
        if link["rate_mbit"]:
            ready = max(ready, self.link_free) + len(frame) * 8 / (link["rate_mbit"] * 1e6)
            self.link_free = ready
        self.queue.append((ready, frame))

    def due(self) -> float | None:
        return self.queue[0][0] if self.queue else None

    def send_due(self, now: float, fd: int) -> None:
        """Write every frame whose departure time has come to `fd` (the other tap)."""
        while self.queue and self.queue[0][0] <= now:
            _, frame = self.queue.popleft()
            try:
                os.write(fd, frame)
                self.sent += 1
            except OSError:  # the tap is down or gone (its namespace deleted): the frame is lost
                self.unsent += 1

    def cut_all(self) -> None:
        self.cut += len(self.queue)
        self.queue.clear()
        self.link_free = 0.0

    def stats(self) -> dict:
        return {"sent": self.sent, "lost": self.lost, "overflow": self.overflow, "cut": self.cut,
                "unsent": self.unsent, "queued": len(self.queue)}


class Forwarder:
    """Both directions between two tap fds, and the link's settings (see the module docstring)."""

    def __init__(self, fd_a: int, fd_b: int, seed: int | None = None):
        rng = random.Random(seed)
        self.fds = (fd_a, fd_b)
        self.link = dict(CLEAN)
        self.ways = (Direction(rng), Direction(rng))  # a -> b, b -> a

    def apply(self, cmd: dict) -> dict:
        """Change the link as `cmd` says; the answer line's content."""
        if cmd.get("clear"):
            self.link = dict(CLEAN)
        for key in ("delay_ms", "jitter_ms", "loss", "rate_mbit"):
            if key in cmd:
                value = float(cmd[key])
                if value < 0 or (key == "loss" and value > 1):
                    return {"ok": False, "error": f"{key}={cmd[key]!r} out of range"}
                self.link[key] = value
        if "partition" in cmd:
            self.link["partition"] = bool(cmd["partition"])
            if self.link["partition"]:
                for way in self.ways:
                    way.cut_all()
        if not self.link["rate_mbit"]:
            for way in self.ways:
                way.link_free = 0.0
        return {"ok": True, "link": dict(self.link),
                "stats": {"a_to_b": self.ways[0].stats(), "b_to_a": self.ways[1].stats()}}

    def read_from(self, side: int, now: float) -> None:
        """Every frame waiting on tap `side` (0: a, 1: b), into its direction (a burst at most)."""
        way = self.ways[side]
        for _ in range(256):
            try:
                frame = os.read(self.fds[side], FRAME_MAX)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EIO, errno.EBADFD):  # no carrier yet (not up), or moving between namespaces
                    return
                raise
            if not frame:
                return
            way.admit(frame, now, self.link)

    def run(self, control_in, control_out) -> None:
        """Forward until EOF on `control_in` (a binary file), answering each command line on `control_out`."""
        poller = select.poll()
        ctl = control_in.fileno()
        os.set_blocking(ctl, False)
        for fd in (*self.fds, ctl):
            poller.register(fd, select.POLLIN)
        pending = b""
        while True:
            now = time.monotonic()
            for side, way in enumerate(self.ways):
                way.send_due(now, self.fds[1 - side])
            dues = [d for d in (w.due() for w in self.ways) if d is not None]
            timeout_ms = max(0.0, (min(dues) - time.monotonic()) * 1e3) if dues else 1000.0
            events = poller.poll(timeout_ms)
            now = time.monotonic()
            for fd, ev in events:
                if fd == ctl:
                    try:
                        chunk = os.read(ctl, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        return
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        if line.strip():
                            try:
                                answer = self.apply(json.loads(line))
                            except (ValueError, TypeError, AttributeError) as e:
                                answer = {"ok": False, "error": f"bad command {line[:200]!r}: {e}"}
                            control_out.write(json.dumps(answer) + "\n")
                            control_out.flush()
                elif ev & POLLIN_OR_ERR:
                    self.read_from(self.fds.index(fd), now)


POLLIN_OR_ERR = select.POLLIN | select.POLLERR | select.POLLHUP


class Link:
    """This forwarder as a child process of the caller: `start`, `ask` (a command, its answer), `stop`."""

    def __init__(self, tap_a: str, tap_b: str, log: Path, seed: int | None = None):
        self.taps, self.log, self.seed = (tap_a, tap_b), log, seed
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout_s: float = 15) -> "Link":
        """Start it; returns once both taps exist (raises with its log if it fails)."""
        argv = [sys.executable, str(Path(__file__).resolve()), *self.taps]
        if self.seed is not None:
            argv += ["--seed", str(self.seed)]
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, bufsize=0,
                                         start_new_session=True)
        first = self._line(timeout_s)
        if not first.get("ready"):
            self.stop()
            raise RuntimeError(f"link forwarder did not start: {first} ({self.log}: "
                               f"{self.log.read_text(errors='replace')[-2000:]})")
        return self

    def ask(self, timeout_s: float = 10, **cmd) -> dict:
        """Send one command (see the module docstring); its answer. Raises if it is refused or not answered."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"link forwarder is not running (see {self.log})")
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        answer = self._line(timeout_s)
        if not answer.get("ok"):
            raise ValueError(f"link forwarder refused {cmd}: {answer.get('error', answer)}")
        return answer

    def _line(self, timeout_s: float) -> dict:
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if ready else b""
        if not line:
            code = self.proc.poll()
            return {"ok": False, "error": f"no answer within {timeout_s:.0f}s (exit code {code})"}
        return json.loads(line)

    def stop(self, timeout_s: float = 10) -> None:
        """EOF on its stdin ends it (and its taps); SIGKILL if it does not end within `timeout_s`."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.stdin.close()
        except OSError:
            pass
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout_s)
        p.stdout.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/link.py", description=__doc__.split("\n\n")[0])
    p.add_argument("tap_a")
    p.add_argument("tap_b")
    p.add_argument("--seed", type=int, default=None, help="the random draws of loss and jitter")
    args = p.parse_args(argv)
    fd_a = open_tap(args.tap_a)
    fd_b = open_tap(args.tap_b)
    print(json.dumps({"ready": True, "taps": [args.tap_a, args.tap_b], "pid": os.getpid()}), flush=True)
    Forwarder(fd_a, fd_b, args.seed).run(sys.stdin.buffer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
