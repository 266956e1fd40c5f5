"""`launch/recovery.py` after a full disk (exit code 9), without a run: `with_auto_resume` waits, within
`run.disk_wait_s`, for `run.disk_min_free_mb` free on the run's filesystem (a tmpfs; root), then
starts the run again; past the bound it stops with code 9."""

from __future__ import annotations

import time
from types import SimpleNamespace

from launch.recovery import EXIT_CODES, RESUMABLE, with_auto_resume
from tests.helpers.disk import fill, tmpfs


def run_in(folder, wait_s: float, min_free_mb: float = 1.0):
    return SimpleNamespace(run=SimpleNamespace(auto_resume=2, run_dir=str(folder), disk_wait_s=wait_s,
                                               disk_min_free_mb=min_free_mb),
                           buffer=SimpleNamespace(state_dir=""), learner=SimpleNamespace(resume=False))


def attempts(*codes):
    it = iter(codes)
    return lambda: next(it)


def test_a_full_disk_is_resumed_once_there_is_space_and_not_past_the_bound(tmp_path):
    from launch.ray import RunFailed, attempt_code

    assert EXIT_CODES["disk"] == 9 and 9 in RESUMABLE
    said: list[str] = []
    assert attempt_code(lambda: (_ for _ in ()).throw(RunFailed("disk", "out of disk space")), said.append) == 9
    with tmpfs(tmp_path / "disk", 4) as disk:
        run = run_in(disk / "run", wait_s=60)
        ballast = fill(disk)
        waits: list[dict] = []

        def space_comes_back(state: dict) -> None:  # (while the launcher waits, someone frees space)
            waits.append(state)
            ballast.unlink(missing_ok=True)

        codes: list[int] = []
        assert with_auto_resume(run, attempts(9, 0), said.append, codes, space_comes_back) == (0, 1)
        assert codes == [9, 0] and run.learner.resume is True
        assert waits[0]["need_mb"] == 1 and waits[0]["free_mb"] == {str(disk): 0.0} and waits[0]["left_s"] > 50

        # the disk stays full: the run stops with code 9 once run.disk_wait_s has passed, not resumed
        fill(disk)
        run, t0 = run_in(disk / "run", wait_s=1.5), time.monotonic()
        assert with_auto_resume(run, attempts(9, 0), said.append) == (9, 0)
        assert 1.5 <= time.monotonic() - t0 < 10 and run.learner.resume is False
        # 0: no wait at all; with the space already there, the run resumes at once
        assert with_auto_resume(run_in(disk / "run", wait_s=0), attempts(9, 0), said.append) == (9, 0)
        (disk / "ballast").unlink()
        assert with_auto_resume(run_in(disk / "run", wait_s=0), attempts(9, 0), said.append) == (0, 1)


def test_a_roles_failure_names_the_full_disk_even_when_a_traceback_follows_it(tmp_path):
    """A role dead of a full disk says so last (launch.entry), but a thread of a library may print
    its own traceback after that line while the process ends (tensorboard's event writer does): the
    failure's detail still starts with the role's words, then the log's last lines."""
    from common.disk import OutOfDisk
    from launch.process import Process

    log = tmp_path / "learner.log"
    words = f"learner: {OutOfDisk(tmp_path / 'run' / 'tensorboard')}"
    thread = ["Exception in thread Thread-3:", "Traceback (most recent call last):"] + \
        [f'  File "writer.py", line {i}, in _run' for i in range(30)] + ["OSError: [Errno 28] No space left on device"]
    log.write_text("\n".join(["step 6 done", words, *thread]) + "\n")
    detail = Process("learner", log, tmp_path / "ready.json").tail().splitlines()
    assert detail[0] == words and detail[1:] == thread[-20:]
    # a log whose last lines hold the words already gets nothing more
    log.write_text("\n".join(["step 6 done", words]) + "\n")
    assert Process("learner", log, tmp_path / "ready.json").tail().splitlines() == ["step 6 done", words]
    # a role whose words never reached its log (the full disk took them): the failure says so
    log.write_text("step 6 done\n")
    detail = Process("learner", log, tmp_path / "ready.json").tail(disk_full=True).splitlines()
    assert detail[0].startswith(f"learner: out of disk space writing {log} (it stopped on a full disk")
    assert detail[1:] == ["step 6 done"] and Process("learner", log, tmp_path / "r").tail() == "step 6 done"
