"""Supervised role processes: start them, send each one's output to its own log, stop them all.

Every role runs in its own session (process group), so stopping a role also stops what it spawned
(vLLM's engine core, DeepSpeed's ranks) and nothing is orphaned. The first role to fail stops the
rest, and the failure names the role and its exit code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


@dataclass
class Role:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    ready_line: str | None = None  # text the log must show before the role counts as started
    required: bool = True  # its failure stops the run (generators and scorers may be optional)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log_path: Path | None = None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


class RoleFailed(RuntimeError):
    def __init__(self, role: str, code: int | None, log_path: Path | None, detail: str = ""):
        self.role, self.code, self.log_path = role, code, log_path
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"role {role!r} exited with code {code}{where}{': ' + detail if detail else ''}")


def tail(path: Path | None, n: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


class Supervisor:
    """Starts roles, watches them, stops them; use as a context manager so every exit path cleans up."""

    def __init__(self, log_dir: str | Path, grace_s: float = 10.0):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.roles: list[Role] = []

    def start(self, role: Role, ready_timeout_s: float = 300.0) -> Role:
        role.log_path = self.log_dir / f"{role.name}.log"
        log = open(role.log_path, "ab", buffering=0)
        env = {**os.environ, **(role.env or {})}
        role.proc = subprocess.Popen(role.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        log.close()
        if role not in self.roles:
            self.roles.append(role)
        if role.ready_line:
            self.wait_ready(role, ready_timeout_s)
        return role

    def restart(self, role: Role, note: str) -> Role:
        """Start `role` again (same argv, same log, after a `=== note` line); leftovers of its last
        run (a vLLM engine core outliving its parent) are killed first."""
        if role.proc is not None:
            _signal_group(role.proc, signal.SIGKILL)
            try:
                role.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with open(self.log_dir / f"{role.name}.log", "ab") as f:
            f.write(f"=== {note} ===\n".encode())
        return self.start(role)

    def wait_ready(self, role: Role, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if role.log_path.exists() and role.ready_line in role.log_path.read_text(errors="replace"):
                return
            if role.returncode is not None:
                raise RoleFailed(role.name, role.returncode, role.log_path, "exited before it was ready\n"
                                 + tail(role.log_path))
            time.sleep(0.1)
        raise RoleFailed(role.name, None, role.log_path, f"not ready after {timeout_s:.0f}s\n" + tail(role.log_path))

    def check(self) -> None:
        """Raise `RoleFailed` for the first required role that has exited with an error."""
        for r in self.roles:
            code = r.returncode
            if code is not None and code != 0 and r.required:
                raise RoleFailed(r.name, code, r.log_path, "\n" + tail(r.log_path))

    def wait(self, role: Role, timeout_s: float | None = None, on_tick: Callable[[], None] | None = None,
             tick_s: float = 1.0) -> int:
        """Wait for `role` to exit (0 expected) while every other required role stays healthy."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_tick = 0.0
        while role.returncode is None:
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                raise RoleFailed(role.name, None, role.log_path, f"did not finish within {timeout_s:.0f}s")
            if on_tick and time.monotonic() >= next_tick:
                on_tick()
                next_tick = time.monotonic() + tick_s
            time.sleep(0.2)
        if role.returncode != 0:
            raise RoleFailed(role.name, role.returncode, role.log_path, "\n" + tail(role.log_path))
        return 0

    def stop(self, roles: Sequence[Role] | None = None) -> None:
        """SIGTERM each role's process group, then SIGKILL what is left after the grace period."""
        roles = list(self.roles if roles is None else roles)
        for r in roles:
            if r.proc is not None and r.proc.poll() is None:
                _signal_group(r.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for r in roles:
            if r.proc is None:
                continue
            try:
                r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the leader may be gone while children it spawned (vLLM engine core) are not
            _signal_group(r.proc, signal.SIGKILL)
            try:
                r.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
