"""One role process, as both launchers run it: output to its log, ready when it says so, stopped whole.

`Process` starts a role's command in its own session (process group), so stopping it also stops
what it spawned (vLLM's engine core, DeepSpeed's ranks) and nothing is orphaned. The role learns
where to say it is ready from `$CONVEYOR_READY_FILE` (common/ready.py); `wait_ready` waits for that
file (or for a port that answers) while the process lives, and a failure to get there comes with
the tail of the log. `launch.local` uses it directly (launch/supervisor.py); on a Ray cluster each
role's actor holds one (launch/cluster/roles.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from common.disk import DISK_WORDS
from common.guards import proc_stat
from common.ready import ENV as READY_ENV
from common.ready import read_ready

PYTHON = "{python}"  # in a role's argv: the interpreter of the process that starts it


def process_start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a process from a reused pid."""
    fields = proc_stat(pid)
    return fields[19] if fields else ""


def kill_group(pid: int, start_time: str, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group led by `pid` if that process is still the one that was started."""
    if not start_time or process_start_time(pid) != start_time:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def port_answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host or "127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


class Process:
    """A role's process: started again on the same log, probed for readiness, stopped by group."""

    def __init__(self, name: str, log_path: str | Path, ready_path: str | Path):
        self.name = name
        self.log_path = Path(log_path)
        self.ready_path = Path(ready_path)
        self.popen: subprocess.Popen | None = None
        self.start_time = ""

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def start(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None,
              banner: str | None = None) -> int:
        """Start `argv` (`{python}`: this interpreter) with its output appended to the log, after a
        `=== banner` line when given; the ready file of an earlier start is removed first."""
        self.ready_path.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable if a == PYTHON else a for a in argv]
        full_env = {**os.environ, **(env or {}), READY_ENV: str(self.ready_path)}
        with open(self.log_path, "ab", buffering=0) as log:
            if banner:
                try:
                    log.write(f"=== {banner}\n".encode())
                except OSError:  # (a full disk: the role still starts; the launcher's own line says why)
                    pass
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=full_env, cwd=cwd if cwd and Path(cwd).is_dir() else None,
                                          start_new_session=True)
        self.start_time = process_start_time(self.popen.pid)
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code, None while it runs (or before it was started)."""
        return None if self.popen is None else self.popen.poll()

    def ready(self) -> dict | None:
        """What the role wrote when it became ready (common/ready.py), None until then."""
        return read_ready(self.ready_path)

    def wait_ready(self, timeout_s: float, probe: str = "file", host: str = "", port: int = 0) -> str:
        """Wait until the role is ready (`probe` "file": its ready file exists; "port": host:port
        accepts a connection). Returns "" when it is, else why not (with the log's tail)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if probe == "file" and self.ready() is not None:
                return ""
            if probe == "port" and port_answers(host, port):
                return ""
            if self.poll() is not None:
                return "exited before it was ready\n" + self.tail()
            if time.monotonic() > deadline:
                return f"not ready after {timeout_s:.0f}s\n" + self.tail()
            time.sleep(0.1)

    def terminate(self, group: bool = False) -> None:
        """SIGTERM to the role (`group`: to its whole process group) if it still runs."""
        if self.popen is not None and self.popen.poll() is None:
            if group:
                self._signal_group(signal.SIGTERM)
            else:
                self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int | None:
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int | None:
        """SIGKILL the whole process group: the leader may be gone while what it spawned is not."""
        if self.popen is None:
            return None
        self._signal_group(signal.SIGKILL)
        return self.wait(5)

    def stop(self, grace_s: float, group: bool = False) -> int | None:
        """SIGTERM, up to `grace_s` to exit, then SIGKILL of what is left of the group; the exit code."""
        self.terminate(group)
        self.wait(grace_s)
        return self.kill()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, n: int = 20, disk_full: bool = False) -> str:
        """The log's last `n` lines; with the role's own last words about a full disk first when
        they are further up (a thread's traceback printed while the process ended may follow them).
        `disk_full` (the role exited with the disk's code): when its words are nowhere in the log (the
        full disk took them too), a line that says so, naming the log."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        out = lines[-n:]
        disk = [line for line in lines if DISK_WORDS in line]
        if disk and disk[-1] not in out:
            out = disk[-1:] + out
        elif not disk and disk_full:
            out = [f"{self.name}: {DISK_WORDS} {self.log_path} (it stopped on a full disk, and its own account "
                   f"of what it could not write did not reach its log)"] + out
        return "\n".join(out)
