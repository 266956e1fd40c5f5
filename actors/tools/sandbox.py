"""Run a snippet of Python in a fresh, limited subprocess: the engine behind the `python` tool.

`await run_python(code, limits)` returns a `SandboxResult` and never raises for anything the code
does. One call:

1. writes the code to `main.py` in a new temporary directory (removed afterwards, whatever happens);
2. starts `sys.executable -I -u -c BOOTSTRAP` there as an asyncio subprocess, in a new session (its
   own process group), with stdin closed and a minimal environment (no variable of ours is
   inherited, so no token or key leaks into it);
3. the bootstrap, before any of the code runs, sets the limits on itself: address space
   (`RLIMIT_AS`), CPU seconds (`RLIMIT_CPU`), size of any file written (`RLIMIT_FSIZE`); then
   leaves the network: `unshare(CLONE_NEWUSER | CLONE_NEWNET)` puts it in a network namespace of
   its own where only an unconfigured loopback exists (connecting anywhere, 127.0.0.1 included,
   fails with "Network is unreachable"), owned by a new user namespace, so that even when we run as
   root the code holds no capability outside it (it cannot re-enter our namespace or raise its
   limits). Where user namespaces are refused it tries `CLONE_NEWNET` alone (root keeps its
   privileges then); where both are refused it runs with the network and says so. It reports what
   it got on a pipe of its own (`SandboxResult.network`), then runs `main.py` as `__main__`;
4. we read stdout (its first `max_output_bytes` kept) and stderr (its last `max_error_bytes`
   kept, where a traceback ends) as they come, in chunks, so a program that prints 10 MB costs us
   a few chunks of memory, never 10 MB; what is dropped is counted;
5. at the wall-clock limit (or when we are cancelled), and in any case once the program exits, the
   whole process group is SIGKILLed: a subprocess the code started dies with it.

Limits are for a policy's mistakes (an endless loop, a huge allocation, a flood of output, a stray
download), not a jail for hostile code: the filesystem is readable as usual, and a process that
leaves the group (`setsid`) outlives the call until its CPU limit ends it. Many calls run at once
on one event loop; a hanging one costs its own time limit and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from actors.tools.registry import Tool, ToolResult

# Runs in the child before the code: limits, then the network namespace, then main.py. argv is
# [-c, FD, AS_BYTES, CPU_S, FSIZE_BYTES]; the report goes to FD as one JSON object.
BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
fd, mem, cpu, fsize = (int(a) for a in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
    network = "isolated"
elif libc.unshare(CLONE_NEWNET) == 0:
    network = "isolated (network namespace only; root keeps its privileges)"
else:
    network = "NOT isolated: unshare failed: " + os.strerror(ctypes.get_errno())
os.write(fd, json.dumps({"network": network}).encode())
os.close(fd)
del ctypes, json, os, resource, libc, fd, mem, cpu, fsize, network, CLONE_NEWUSER, CLONE_NEWNET
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as f:
    source = f.read()
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""

CHUNK = 64 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    """Wall-clock seconds from start to kill; the CPU limit is the same, rounded up."""
    memory_mb: int = 1024
    """Address space of the child (`RLIMIT_AS`); an allocation past it raises MemoryError there."""
    max_output_bytes: int = 64 * 1024
    """stdout kept from its start; the rest is read and dropped (and counted)."""
    max_error_bytes: int = 8 * 1024
    """stderr kept from its end (a traceback's tail)."""
    max_file_bytes: int = 16 * 1024 * 1024
    """Largest file the code may write in its working directory (`RLIMIT_FSIZE`)."""

    def __post_init__(self):
        if not self.timeout_s > 0 or self.memory_mb < 64 or self.max_output_bytes < 1 or self.max_error_bytes < 1:
            raise ValueError(f"SandboxLimits: timeout_s must be > 0, memory_mb >= 64 (Python itself needs some) "
                             f"and the output bounds >= 1, got {self}")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    """The first `max_output_bytes` of stdout, decoded (invalid UTF-8 replaced)."""
    stderr: str
    """The last `max_error_bytes` of stderr."""
    returncode: int | None
    """The exit status; negative: killed by that signal (ours at the time limit: SIGKILL)."""
    timed_out: bool
    """Killed at the wall-clock limit (`returncode` is then None)."""
    stdout_dropped: int
    """Bytes of stdout read past `max_output_bytes` and not kept."""
    stderr_dropped: int
    elapsed_s: float
    """From start to exit or kill."""
    network: str
    """What the bootstrap got: "isolated", or why not; "unknown" if it never reported."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def observation(self, limits: SandboxLimits) -> str:
        """The text a model sees: the output; or "error: ..." then the output so far or the traceback."""
        out = self.stdout
        if self.stdout_dropped:
            out += f"\n[output truncated: {self.stdout_dropped} more bytes dropped]"
        if self.timed_out:
            head = f"error: python timed out after {limits.timeout_s:.1f} s"
            return head + (f"\noutput so far:\n{out}" if out else "")
        if self.returncode == 0:
            return out + (f"\n{self.stderr}" if self.stderr else "")
        if self.returncode is not None and self.returncode < 0:
            name = signal.Signals(-self.returncode).name
            why = f" (CPU limit of {limits_cpu_s(limits)} s)" if name == "SIGXCPU" else ""
            head = f"error: python was killed by {name}{why}"
        else:
            head = f"error: python exited with status {self.returncode}"
        return "\n".join(part for part in (head, out, self.stderr.rstrip("\n")) if part)


def limits_cpu_s(limits: SandboxLimits) -> int:
    return max(1, math.ceil(limits.timeout_s))


def _minimal_env(workdir: str) -> dict[str, str]:
    # One thread per numeric library: each thread would reserve address space under RLIMIT_AS.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


async def _read_head(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """Up to `limit` bytes from the start of `stream`; the rest is drained and counted."""
    kept, dropped = bytearray(), 0
    while chunk := await stream.read(CHUNK):
        room = max(0, limit - len(kept))
        kept += chunk[:room]
        dropped += len(chunk) - min(room, len(chunk))
    return bytes(kept), dropped


async def _read_tail(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """The last `limit` bytes of `stream`; what came before is counted."""
    kept, dropped = bytearray(), 0
    while chunk := await stream.read(CHUNK):
        kept += chunk
        if len(kept) > limit:
            dropped += len(kept) - limit
            del kept[: len(kept) - limit]
    return bytes(kept), dropped


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_report(fd: int) -> str:
    try:
        return json.loads(os.read(fd, 4096) or b"{}").get("network", "unknown")
    except (OSError, ValueError):
        return "unknown"


async def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` under `limits` (see the module docstring) and return what happened.

    Raises only where the subprocess cannot be started at all (OSError: no file descriptors left).
    """
    workdir = tempfile.mkdtemp(prefix="conveyor-python-")
    report_r, report_w = os.pipe()
    os.set_blocking(report_r, False)
    proc = None
    readers: list[asyncio.Task] = []
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        start = time.monotonic()
        argv = [sys.executable, "-I", "-u", "-c", BOOTSTRAP, str(report_w), str(limits.memory_mb << 20),
                str(limits_cpu_s(limits)), str(limits.max_file_bytes)]
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=workdir, env=_minimal_env(workdir), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, pass_fds=(report_w,))
        os.close(report_w)
        report_w = -1
        readers = [asyncio.ensure_future(_read_head(proc.stdout, limits.max_output_bytes)),
                   asyncio.ensure_future(_read_tail(proc.stderr, limits.max_error_bytes))]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        # Whether it exited or not: nothing it started may outlive the call.
        _kill_group(proc.pid)
        await proc.wait()
        # The group is gone, so the pipes reach EOF at once; the bound is for a process that left it.
        done, _ = await asyncio.wait(readers, timeout=1.0)
        (out, out_dropped), (err, err_dropped) = (r.result() if r in done else (b"", 0) for r in readers)
        return SandboxResult(
            stdout=out.decode("utf-8", errors="replace"), stderr=err.decode("utf-8", errors="replace"),
            returncode=None if timed_out else proc.returncode, timed_out=timed_out,
            stdout_dropped=out_dropped, stderr_dropped=err_dropped,
            elapsed_s=time.monotonic() - start, network=_read_report(report_r))
    finally:
        if proc is not None and proc.returncode is None:  # cancelled or failed mid-way
            _kill_group(proc.pid)
            await proc.wait()  # at once after SIGKILL; reaps it and closes its transport
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


class PythonTool(Tool):
    """Run a Python program in the sandbox of `actors/tools/sandbox.py`; its output is the observation."""

    name = "python"
    description = ("Run a Python 3 program and return what it prints (stdout, then stderr). "
                   "No network; limited time, memory and output.")
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the program"}},
                  "required": ["code"], "additionalProperties": False}

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits

    async def call(self, arguments: dict[str, Any]) -> str:
        return (await self.invoke(arguments)).text

    async def invoke(self, arguments: dict[str, Any]) -> ToolResult:
        r = await run_python(arguments["code"], self.limits)
        info = {"elapsed_s": r.elapsed_s, "returncode": r.returncode, "timed_out": r.timed_out,
                "output_dropped": r.stdout_dropped, "network": r.network}
        return ToolResult(self.name, r.observation(self.limits), ok=r.ok, info=info)
