"""The faults bench/chaos.py injects, the run folder it may put on a filesystem of its own, and the
sampler of every role's memory and descriptors (its soak figures).

A role is found through `<run_dir>/status.json` (both launchers write each role's state and pid),
so the same code reaches a process group under `launch.local` and a Ray actor's process under
`launch.ray`. Every fault with a duration has an undo (SIGCONT, the ballast removed, the link
healed), and `FaultRunner.undo` is called in the chaos loop's `finally`: nothing stays stopped,
full or cut off after the benchmark.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

BALLAST = ".chaos_ballast"


def role_pids(run_dir: Path) -> dict[str, tuple[str, int]]:
    """{role name: (its kind, its pid)} of every role the launcher says is running."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return {r["name"]: (r["kind"], int(r["pid"])) for r in status.get("roles", [])
            if r.get("state") == "running" and r.get("pid")}


def tree(pid: int) -> list:
    """The process and its descendants (psutil), those still alive."""
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


class RunFolder:
    """The run folder, on a tmpfs of `size_mb` of its own when disk faults are injected (so filling
    it fills nothing else), else a plain folder. `release` keeps what the audit and a person need
    (everything but checkpoints and the ballast) beside it and unmounts."""

    def __init__(self, path: Path, size_mb: int):
        self.path, self.size_mb, self.mounted = path, size_mb, False

    def make(self) -> None:
        self.release()
        shutil.rmtree(self.path, ignore_errors=True)
        self.path.mkdir(parents=True)
        if self.size_mb:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)],
                           check=True, capture_output=True, text=True, timeout=30)
            self.mounted = True

    def release(self, keep: Path | None = None) -> None:
        if keep is not None and self.path.exists():
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(self.path, keep, ignore=shutil.ignore_patterns("checkpoints", BALLAST))
        if self.mounted or os.path.ismount(self.path):
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)
            self.mounted = False


def fill(folder: Path) -> int:
    """Fill the filesystem under `folder` with a ballast file until a write fails; its size."""
    path = folder / BALLAST
    chunk = b"\0" * (1 << 20)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            while True:
                try:
                    written += os.write(fd, chunk[:size])
                except OSError:
                    break
    finally:
        os.close(fd)
    return written


class FaultRunner:
    """Injects one fault (`inject`) and undoes it (`undo`); see bench/chaos.py for the kinds."""

    def __init__(self, role_kinds, stop_s: float, disk_s: float, disk_mb: int, partition_s: float, nodes=None,
                 group: bool = True, say=print, rng: random.Random | None = None):
        self.role_kinds, self.stop_s, self.disk_s, self.disk_mb = role_kinds, stop_s, disk_s, disk_mb
        self.partition_s, self.nodes, self.group, self.say = partition_s, nodes, group, say
        self.rng = rng or random.Random(0)
        self.stopped: list[int] = []

    def _pick(self, run_dir: Path, kind: str) -> tuple[str, int] | None:
        """A running role of `kind` (waiting up to 120 s: it may be restarting from the last fault)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = sorted((name, pid) for name, (k, pid) in role_pids(run_dir).items() if k == kind)
            found = [(n, p) for n, p in found if tree(p)]
            if found:
                return self.rng.choice(found)
            time.sleep(0.2)
        return None

    def _signal(self, pid: int, sig: int) -> list[int]:
        """Signal the role: its process group under launch.local, its process tree under Ray."""
        if self.group:
            try:
                pgid = os.getpgid(pid)
                os.killpg(pgid, sig)
                return [-pgid]
            except ProcessLookupError:
                return []
        hit = []
        for p in tree(pid):
            try:
                p.send_signal(sig)
                hit.append(p.pid)
            except Exception:  # (gone meanwhile)
                pass
        return hit

    def inject(self, kind: str, role: str, run_dir: Path) -> dict | None:
        """Start the fault; {"what": ..., "for_s": how long until `undo` (0: nothing to undo)}, or
        None when there was nothing to inject it into."""
        if kind in ("kill", "stop"):
            picked = self._pick(run_dir, role)
            if picked is None:
                return None
            name, pid = picked
            if kind == "kill":
                return {"what": name, "for_s": 0} if self._signal(pid, signal.SIGKILL) else None
            self.stopped = self._signal(pid, signal.SIGSTOP)
            return {"what": name, "for_s": self.stop_s} if self.stopped else None
        if kind == "disk":
            filled = fill(run_dir)
            return {"what": f"{filled >> 20} MB ballast", "for_s": self.disk_s}
        if kind == "partition":
            self.nodes.partition()
            return {"what": "node b", "for_s": self.partition_s}
        raise ValueError(f"unknown fault kind {kind!r}")

    def undo(self, kind: str, run_dir: Path) -> None:
        if kind == "stop":
            for target in self.stopped:
                try:
                    if target < 0:
                        os.killpg(-target, signal.SIGCONT)
                    else:
                        os.kill(target, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.stopped = []
        elif kind == "disk":
            (run_dir / BALLAST).unlink(missing_ok=True)
        elif kind == "partition":
            self.nodes.heal()

    def kill_run(self, proc: subprocess.Popen) -> None:
        """A run past its bound: the launcher and everything it started."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()


def folder_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


class Sampler:
    """Every `every_s`: each running role's resident memory (with its children: a generator's
    engine) and open descriptors, and the buffer's state folder's size, keyed by learner step."""

    def __init__(self, every_s: float, find=role_pids):
        self.every_s, self.find = every_s, find
        self.rows: list[dict] = []
        self.next_t = 0.0

    def maybe(self, run_dir: Path, step: int) -> None:
        now = time.monotonic()
        if now < self.next_t:
            return
        self.next_t = now + self.every_s
        row = {"t": time.time(), "step": step, "state_bytes": folder_bytes(run_dir / "buffer_state"), "roles": {}}
        for name, (_, pid) in self.find(run_dir).items():
            rss = fds = 0
            for p in tree(pid):
                try:
                    rss += p.memory_info().rss
                    fds += p.num_fds()
                except Exception:  # (gone meanwhile)
                    pass
            if rss:
                row["roles"][name] = {"rss_mb": round(rss / 2**20, 1), "fds": fds}
        self.rows.append(row)

    def write(self, path: Path) -> None:
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def summary(self, steps: int, warmup: float = 0.2, window: float = 0.1) -> dict:
        """Medians over steps [warmup, warmup + window) of the run ("early") and over its last
        `window` ("late"), per role and for the state folder; growth = late / early."""
        lo, hi = steps * warmup, steps * (warmup + window)
        early = [r for r in self.rows if lo <= r["step"] < hi]
        late = [r for r in self.rows if r["step"] >= steps * (1 - window)]
        out: dict = {"samples": len(self.rows), "early_steps": [int(lo), int(hi)],
                     "late_steps": [int(steps * (1 - window)), steps]}

        def med(rows, get):
            vals = [v for v in (get(r) for r in rows) if v is not None]
            return statistics.median(vals) if vals else None

        def pair(get):
            a, b = med(early, get), med(late, get)
            return {"early": a, "late": b, "growth": round(b / a, 3) if a and b is not None else None}

        out["state_mb"] = pair(lambda r: round(r["state_bytes"] / 2**20, 2))
        names = sorted({n for r in self.rows for n in r["roles"]})
        out["roles"] = {n: {"rss_mb": pair(lambda r, n=n: r["roles"].get(n, {}).get("rss_mb")),
                            "fds": pair(lambda r, n=n: r["roles"].get(n, {}).get("fds"))} for n in names}
        return out
