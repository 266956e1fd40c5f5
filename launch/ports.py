"""Free TCP ports on this machine, for launchers, tests and benchmarks that start role processes."""

from __future__ import annotations

import socket


def free_port_block(n: int = 1, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base+n-1 were all free on `host` a moment ago.

    All n are bound at once before any is released, so the block is checked as a whole; another
    process may still take one before the caller binds it (the roles then fail to start, loudly).
    """
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} consecutive free ports on {host}")
