"""bench/chaos.py's parts without a run: the fault plan, the full-disk ballast on a filesystem of
its own, SIGSTOP and its undo, and the soak sampler's early-vs-late figures."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.chaos import ROLE_KINDS, plan_faults
from bench.chaos_faults import BALLAST, FaultRunner, RunFolder, Sampler, fill, role_pids


def test_the_plan_spreads_faults_over_the_run_one_per_slice():
    plan = plan_faults(300, 20, ["kill", "stop", "disk"], random.Random(0))
    steps = [at for at, _, _ in plan]
    assert len(plan) == 20 and steps == sorted(steps) and 5 <= steps[0] and steps[-1] < 300
    width = (300 - 10) / 20
    assert all(5 + i * width <= at < 5 + (i + 1) * width for i, at in enumerate(steps))
    assert {k for _, k, _ in plan} == {"kill", "stop", "disk"}
    assert all((role in ROLE_KINDS) == (kind != "disk") for _, kind, role in plan)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_full_for_every_writer_until_the_ballast_goes(tmp_path):
    folder = RunFolder(tmp_path / "run", size_mb=4)
    folder.make()
    try:
        assert os.path.ismount(folder.path)
        (folder.path / "kept.txt").write_text("x")
        assert fill(folder.path) > 3 << 20
        with pytest.raises(OSError) as e:
            with open(folder.path / "more", "wb") as f:
                f.write(b"y" * 8192)
        assert e.value.errno == 28  # ENOSPC
        FaultRunner(ROLE_KINDS, 1, 1, 4, 1).undo("disk", folder.path)
        (folder.path / "more").write_bytes(b"y" * 8192)
        folder.release(keep=tmp_path / "kept")
    finally:
        folder.release()
    assert not os.path.ismount(folder.path)
    assert (tmp_path / "kept" / "kept.txt").read_text() == "x" and not (tmp_path / "kept" / BALLAST).exists()


def test_a_stopped_role_is_stopped_until_its_undo(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        (tmp_path / "status.json").write_text(
            '{"roles": [{"name": "scorer-0", "kind": "scorer", "state": "running", "pid": %d},'
            ' {"name": "generator-0", "kind": "generator", "state": "restarting", "pid": 1}]}' % child.pid)
        assert role_pids(tmp_path) == {"scorer-0": ("scorer", child.pid)}
        runner = FaultRunner(ROLE_KINDS, stop_s=5, disk_s=1, disk_mb=0, partition_s=1)
        took = runner.inject("stop", "scorer", tmp_path)
        assert took == {"what": "scorer-0", "for_s": 5}
        state = lambda: Path(f"/proc/{child.pid}/stat").read_text().split(")")[1].split()[0]  # noqa: E731
        deadline = time.monotonic() + 10
        while state() != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state() == "T"
        runner.undo("stop", tmp_path)
        while state() == "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state() in ("S", "R")
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def test_the_soak_summary_compares_early_with_late_medians():
    s = Sampler(10)
    for step in range(0, 100, 2):
        s.rows.append({"step": step, "state_bytes": (1 << 20) * (2 if step >= 90 else 1),
                       "roles": {"buffer": {"rss_mb": 100.0 + (step >= 90) * 10, "fds": 30}}})
    out = s.summary(100)
    assert out["early_steps"] == [20, 30] and out["late_steps"] == [90, 100]
    assert out["state_mb"] == {"early": 1.0, "late": 2.0, "growth": 2.0}
    assert out["roles"]["buffer"]["rss_mb"]["growth"] == round(110 / 100, 3)
    assert out["roles"]["buffer"]["fds"] == {"early": 30, "late": 30, "growth": 1.0}
