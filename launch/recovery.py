"""What both launchers do when a run goes wrong: name a stall, restart the whole run from its checkpoint.

- `ProgressWatch`: the learner's progress is its metrics file growing; when it has not grown for
  `run.stall_timeout_s`, the run stops with exit code 8 and the buffer's diagnosis of why no batch
  is coming (admission, generators, scorers), instead of hanging.
- `auto_resume`: a learner, buffer or weight-sync crash (exit codes 3, 4, 5) restarts the whole run
  with `learner.resume true`, up to `run.auto_resume` times. The learner resumes from its last
  checkpoint and the buffer puts itself at that point (the resume handshake), so nothing is
  trained twice and nothing is lost.
- a full disk: a role that cannot write (`common.disk.OutOfDisk`) exits with code 9 naming the path.
  With `run.auto_resume`, the launcher first waits, at most `run.disk_wait_s`, for
  `run.disk_min_free_mb` to be free on every filesystem the run writes (`wait_for_space`), then
  resumes as above; else the run stops with code 9.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

from common.disk import free_bytes, mount_point

# "failed": a failure no other key names (a role that cannot bind its port, ...)
EXIT_CODES = {"failed": 1, "config": 2, "buffer": 3, "weight_sync": 4, "learner": 5, "generator": 6, "scorer": 7,
              "stalled": 8, "disk": 9}
# (a full disk once there is space again: `with_auto_resume`)
RESUMABLE = {EXIT_CODES["buffer"], EXIT_CODES["weight_sync"], EXIT_CODES["learner"], EXIT_CODES["disk"]}
# room for the last words of a run that fills its disk (common/disk.py): its roles', and the launcher's own
RESERVE_NAME, LAUNCHER_RESERVE = ".disk_reserve", ".disk_reserve_launcher"


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


def written_dirs(run) -> list[Path]:
    """The folders a run writes (the run folder, the buffer's state): where a full disk can stop it."""
    return [Path(d) for d in dict.fromkeys([run.run.run_dir, run.buffer.state_dir or run.run.run_dir])]


def wait_for_space(paths: list[Path], min_free_mb: float, wait_s: float, say: Callable[[str], None],
                   on_wait: Callable[[dict], None] | None = None, poll_s: float = 1.0) -> bool:
    """True once the filesystem of every path has `min_free_mb` free, polled for at most `wait_s`
    (0: looked at once); False past it. Says once what it waits for; `on_wait(state)` at each poll."""
    need = min_free_mb * 1e6
    deadline = time.monotonic() + wait_s

    def short() -> dict[str, int]:  # mount point -> free bytes, where fewer than `need`
        return {str(mount_point(p)): free for p in paths if (free := free_bytes(p)) < need}

    lacking = short()
    if lacking and wait_s > 0:
        say(f"waiting up to {wait_s:g} s for {min_free_mb:g} MB free on "
            + ", ".join(f"{m} (free now {free / 1e6:.1f} MB)" for m, free in lacking.items())
            + " (run.disk_wait_s, run.disk_min_free_mb)")
    while lacking and time.monotonic() < deadline:
        if on_wait is not None:
            on_wait({"need_mb": min_free_mb, "free_mb": {m: round(f / 1e6, 3) for m, f in lacking.items()},
                     "left_s": round(deadline - time.monotonic(), 1)})
        time.sleep(poll_s)
        lacking = short()
    if lacking:
        say(f"not enough free space after run.disk_wait_s={wait_s:g}: "
            + ", ".join(f"{m} has {free / 1e6:.1f} MB free (run.disk_min_free_mb={min_free_mb:g})"
                        for m, free in lacking.items()))
    return not lacking


def with_auto_resume(run, attempt: Callable[[], int], say: Callable[[str], None],
                     codes: list[int] | None = None,
                     on_wait: Callable[[dict], None] | None = None) -> tuple[int, int]:
    """Run `attempt()` (one start of the whole run; exit code) again with `learner.resume` set after a
    learner, buffer or weight-sync crash, up to `run.run.auto_resume` times; after a full disk (9)
    once there is space again (`wait_for_space`, `on_wait`). Returns (code, resumes); each
    attempt's code is appended to `codes`."""
    resumes = 0
    r = run.run
    while True:
        code = attempt()
        if codes is not None:
            codes.append(code)
        if code not in RESUMABLE or resumes >= r.auto_resume:
            return code, resumes
        if code == EXIT_CODES["disk"] and not wait_for_space(written_dirs(run), r.disk_min_free_mb, r.disk_wait_s,
                                                             say, on_wait):
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
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
        except OSError as e:  # a full disk: the terminal has the line
            tqdm.write(f"{self.launcher}: (not in {self.path}: {e})", file=sys.stderr)


launcher_log = LauncherLog


def write_exit(run_dir: Path, code: int, wall_s: float, **counts) -> None:
    """`<run_dir>/exit.json`: the code, the wall time and what the launcher counted (resumes,
    restarts, each attempt's code, the reason of a failure)."""
    text = json.dumps({"code": code, "wall_s": wall_s, **counts}) + "\n"
    try:
        (Path(run_dir) / "exit.json").write_text(text)
    except OSError as e:  # a full disk: said where it can be
        print(f"cannot write {Path(run_dir) / 'exit.json'} ({e}): {text}", file=sys.stderr, flush=True)
