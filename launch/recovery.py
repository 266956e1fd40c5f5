"""What both launchers do when a run goes wrong: name a stall, restart the whole run from its checkpoint.

- `ProgressWatch`: the learner's progress is its metrics file growing; when it has not grown for
  `run.stall_timeout_s`, the run stops with exit code 8 and the buffer's diagnosis of why no batch
  is coming (admission, generators, scorers), instead of hanging.
- `auto_resume`: a learner, buffer or weight-sync crash (exit codes 3, 4, 5) restarts the whole run
  with `learner.resume true`, up to `run.auto_resume` times. The learner resumes from its last
  checkpoint and the buffer puts itself at that point (the resume handshake), so nothing is
  trained twice and nothing is lost.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

# "failed": a failure no other key names (a role that cannot bind its port, ...)
EXIT_CODES = {"failed": 1, "config": 2, "buffer": 3, "weight_sync": 4, "learner": 5, "generator": 6, "scorer": 7,
              "stalled": 8}
RESUMABLE = {EXIT_CODES["buffer"], EXIT_CODES["weight_sync"], EXIT_CODES["learner"]}


class Stalled(RuntimeError):
    """No learner step for `stall_timeout_s`; the message says what the buffer waits for."""


def buffer_diagnosis(host: str, port: int, timeout_s: float = 5.0) -> str:
    """The buffer's own account of why no batch is ready (or why it cannot say)."""
    from buffer.client import BufferClient
    from buffer.state import describe_wait

    try:
        with BufferClient(host, port, timeout_s=timeout_s) as c:
            return "buffer: " + describe_wait(c.metrics())
    except Exception as e:  # a dead or wedged buffer is itself the diagnosis
        return f"the buffer at {host}:{port} did not answer ({type(e).__name__}: {e})"


class ProgressWatch:
    """Raises `Stalled` from `check` once `path` has not grown for `timeout_s` (0: never). Before it
    first grows, `first_grace_s` more are allowed: the first step waits for every engine to start."""

    def __init__(self, path: Path, timeout_s: float, diagnose: Callable[[], str], first_grace_s: float = 0.0):
        self.path, self.timeout_s, self.diagnose = Path(path), timeout_s, diagnose
        self.size = self._size()
        self.since = time.monotonic()
        self.grace_s = first_grace_s

    def _size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return -1

    def check(self) -> None:
        size, now = self._size(), time.monotonic()
        if size != self.size:
            self.size, self.since, self.grace_s = size, now, 0.0
            return
        if self.timeout_s and now - self.since > self.timeout_s + self.grace_s:
            raise Stalled(f"no learner step for {now - self.since:.0f}s (run.stall_timeout_s={self.timeout_s:g}); "
                          + self.diagnose())


def last_checkpoint(run_dir: str | Path) -> str:
    marker = Path(run_dir) / "checkpoints" / "latest"
    try:
        return marker.read_text().strip()
    except OSError:
        return "none yet: from step 0"


def with_auto_resume(run, attempt: Callable[[], int], say: Callable[[str], None],
                     codes: list[int] | None = None) -> tuple[int, int]:
    """Run `attempt()` (one start of the whole run; exit code) again with `learner.resume` set after a
    learner, buffer or weight-sync crash, up to `run.run.auto_resume` times. Returns (code, resumes);
    each attempt's code is appended to `codes`."""
    resumes = 0
    while True:
        code = attempt()
        if codes is not None:
            codes.append(code)
        if code not in RESUMABLE or resumes >= run.run.auto_resume:
            return code, resumes
        resumes += 1
        run.learner.resume = True
        say(f"auto-resume {resumes}/{run.run.auto_resume}: exit code {code}; restarting the whole run from "
            f"checkpoint {last_checkpoint(run.run.run_dir)}")


class LauncherLog:
    """`say(msg)`: one line on the terminal (above the progress bar), prefixed `launcher:`, and in
    `<run_dir>/logs/launcher.log`; `say.last` is the last line said (an exit's reason)."""

    def __init__(self, run_dir: str | Path, launcher: str):
        self.path = Path(run_dir) / "logs" / "launcher.log"
        self.launcher = launcher
        self.last = ""

    def __call__(self, msg: str) -> None:
        from tqdm import tqdm

        self.last = msg
        tqdm.write(f"{self.launcher}: {msg}", file=sys.stderr)
        sys.stderr.flush()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")


launcher_log = LauncherLog


def write_exit(run_dir: Path, code: int, wall_s: float, **counts) -> None:
    """`<run_dir>/exit.json`: the code, the wall time and what the launcher counted (resumes,
    restarts, each attempt's code, the reason of a failure)."""
    (Path(run_dir) / "exit.json").write_text(json.dumps({"code": code, "wall_s": wall_s, **counts}) + "\n")
