"""Crashes of a real run under `launch.local`: every role a real process, the tiny model, kill -9.

What a cluster does to a long run, and what must hold afterwards (`launch.ledger.audit`): the run
reaches `total_steps`, every step is in the ledger once, no prompt group was trained twice or lost,
and no trained rollout came from a policy version newer than its step (staleness >= 0).

- the learner killed between checkpoints: the launcher stops (5); the same command with
  `--learner.resume true` and another number of generators goes on; then every process of the run
  is killed at once, and a second resume finishes the run;
- with `run.auto_resume`, a learner kill and a buffer kill are healed without a second command,
  and a killed generator is started again;
- a frozen generator (SIGSTOP) stalls the run: it stops with exit code 8 within the bound;
- the run folder's disk filled up (a tmpfs and a ballast file; root): the run stops with exit code 9
  naming the path it could not write, and the same command with `--learner.resume true` finishes it
  once the ballast is gone; with `run.auto_resume` the launcher waits for the space and resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.cluster import run_status
from tests.helpers.cluster import wait_for as wait_until
from tests.helpers.disk import fill, tmpfs
from tests.helpers.procs import ROOT, subprocess_env

DEMO_YAML = ROOT / "examples" / "demo.yaml"
SMALL = ["--buffer.prompts_per_step", "4", "--buffer.n_samples_per_prompt", "4", "--generator.groups_per_lease", "2",
         "--learner.save_every", "5"]


@pytest.fixture(scope="module")
def task(tmp_path_factory, tiny_model_dir):
    from demo.arithmetic import make_problems, write_jsonl

    d = tmp_path_factory.mktemp("crash")
    return {"dir": d, "prompts": write_jsonl(make_problems(2000, seed=0), d / "train.jsonl"), "model": tiny_model_dir}


def start(task, run_dir: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launch.local", str(DEMO_YAML), "--run.run_dir", str(run_dir),
            "--learner.model_path", str(task["model"]), "--buffer.prompts", str(task["prompts"]), *SMALL, *extra]
    return subprocess.Popen(argv, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def steps_done(run_dir: Path) -> int:
    """Distinct learner steps in the ledger (a resumed run redoes some)."""
    from learner.ledger import read_ledger

    return len(read_ledger(run_dir / "ledger.jsonl"))


def wait_for(proc: subprocess.Popen, run_dir: Path, steps: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run_dir) < steps:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before step {steps}:\n" + proc.stdout.read()[-3000:])
        if time.monotonic() > deadline:
            kill_tree(proc.pid)
            pytest.fail(f"no step {steps} within {timeout:.0f}s")
        time.sleep(0.2)


def role_pids(launcher_pid: int, module: str) -> list[int]:
    out = []
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if module in p.cmdline():
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def kill_role(launcher_pid: int, module: str) -> None:
    pids = role_pids(launcher_pid, module)
    assert pids, f"no {module} process under the launcher"
    os.killpg(os.getpgid(pids[0]), signal.SIGKILL)  # the role and what it spawned (vLLM's engine core)


def kill_tree(pid: int) -> None:
    """kill -9 of every process of the run at once, the launcher included."""
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def finish(proc: subprocess.Popen, timeout: float = 900) -> tuple[int, str]:
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        pytest.fail(f"the run did not finish within {timeout:.0f}s")
    return proc.returncode, out


def assert_exact(run_dir: Path, total: int) -> dict:
    """The run's accounting after all its crashes: every step once, nothing twice, nothing lost."""
    from launch.ledger import audit

    report = audit(run_dir)
    assert report["steps"] == total and report["missing_steps"] == [], report
    assert report["groups_trained_twice"] == 0 and report["groups_lost"] == 0, report
    assert report["dropped_and_trained"] == 0, report
    assert report["groups_trained"] == total * 4, report  # 4 whole groups per step
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert min(r["buffer/staleness_min"] for r in rows) >= 0, "a rollout newer than the step it trained"
    assert max(r["buffer/staleness_max"] for r in rows) <= 1  # examples/demo.yaml: max_staleness 1
    assert (run_dir / "checkpoints" / f"step_{total}" / "model.safetensors").is_file()
    return report


def fake_role(name: str, kind: str, code: str, **kw):
    """A RoleSpec whose process runs `code` (common.ready importable) instead of a real role."""
    from launch.roles import PYTHON, RoleSpec

    return RoleSpec(name, kind, [PYTHON, "-c", code], {"PYTHONPATH": str(ROOT)}, **kw)


def test_supervisor_waits_for_the_ready_file_and_heals_helpers(tmp_path):
    """The process wrapper and launch.local's supervision with stand-in roles: readiness is the
    ready file (a log line saying "ready" is not), a helper that dies is restarted while its restarts
    last, and once every one of its kind is gone for good the run fails naming that kind."""
    from launch.roles import Readiness, RestartPolicy, State
    from launch.supervisor import RoleFailed, Supervisor

    waited = Readiness(wait=True, timeout_s=20)
    serves = "import time; from common.ready import mark_ready; time.sleep(0.3); mark_ready('x', n=7); time.sleep(60)"
    says_only = "import time; print('buffer ready', flush=True); time.sleep(60)"
    with Supervisor(tmp_path / "logs", tmp_path / "ready", grace_s=2, say=lambda m: None) as sup:
        svc = sup.start(fake_role("buffer", "buffer", serves, finishes=False, ready=waited), "cfg")
        assert svc.proc.ready()["n"] == 7 and svc.proc.ready()["pid"] == svc.proc.pid
        with pytest.raises(RoleFailed, match="not ready after 1s"):
            sup.start(fake_role("weight_sync", "weight_sync", says_only, finishes=False,
                                ready=Readiness(wait=True, timeout_s=1)), "cfg")
        assert "buffer ready" in (tmp_path / "logs" / "weight_sync.log").read_text()
        with pytest.raises(RoleFailed, match="exited before it was ready") as e:
            sup.start(fake_role("learner", "learner", "raise SystemExit(3)", ready=waited), "cfg")
        assert e.value.code == 3

    with Supervisor(tmp_path / "logs2", tmp_path / "ready2", grace_s=2, say=lambda m: None) as sup:
        gen = sup.start(fake_role("generator-0", "generator", "raise SystemExit(1)", required=False,
                                  restart=RestartPolicy(2, 0.0)), "cfg")
        deadline = time.monotonic() + 30
        with pytest.raises(RoleFailed, match="every generator has exited") as e:
            while time.monotonic() < deadline:
                sup.supervise()
                time.sleep(0.05)
        assert e.value.role == "generator"
        assert (gen.state, gen.code, gen.starts, sup.restarts["generator-0"]) == (State.FAILED, 1, 3, 2)
        assert sup.status()[0]["state"] == "failed" and sup.status()[0]["restarts"] == 2


@pytest.mark.slow
def test_learner_kill_then_resume_twice_with_another_generator_count(task):
    run_dir, total = task["dir"] / "manual", 20
    proc = start(task, run_dir, "--learner.total_steps", str(total))
    wait_for(proc, run_dir, 7)  # last checkpoint: step 5; steps 5, 6 were trained after it
    kill_role(proc.pid, "launch.learner")
    code, out = finish(proc)
    assert code == 5, out[-3000:]
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert (exit_info["code"], exit_info["attempts"]) == (5, [5]), exit_info
    assert "role 'learner' exited with code -9" in exit_info["reason"], exit_info

    proc = start(task, run_dir, "--learner.total_steps", str(total), "--learner.resume", "true",
                 "--run.num_generators", "2")
    wait_for(proc, run_dir, 13)
    kill_tree(proc.pid)  # everything at once: the buffer's log and the ledger may be cut anywhere

    proc = start(task, run_dir, "--learner.total_steps", str(total), "--learner.resume", "true")
    code, out = finish(proc)
    assert code == 0, out[-3000:]
    report = assert_exact(run_dir, total)
    assert report["groups_in_flight"] >= 0


@pytest.mark.slow
def test_auto_resume_heals_learner_and_buffer_kills_and_restarts_a_generator(task):
    run_dir, total = task["dir"] / "auto", 20
    proc = start(task, run_dir, "--learner.total_steps", str(total), "--run.auto_resume", "3",
                 "--run.restart_delay_s", "0.5")
    wait_for(proc, run_dir, 7)
    kill_role(proc.pid, "launch.learner")
    wait_for(proc, run_dir, 12)
    kill_role(proc.pid, "launch.buffer")
    wait_for(proc, run_dir, 16)
    kill_role(proc.pid, "launch.generator")
    code, out = finish(proc)
    assert code == 0, out[-3000:]
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert exit_info["resumes"] == 2 and exit_info["restarts"] == 1, exit_info
    # a crash of a core role (the learner, then the buffer: 5, 3) twice, then done
    assert len(exit_info["attempts"]) == 3 and exit_info["attempts"][-1] == 0, exit_info
    assert set(exit_info["attempts"][:2]) <= {3, 4, 5}, exit_info
    # the last attempt started generator-0 again after its kill, and it served again
    gen0 = next(r for r in json.loads((run_dir / "status.json").read_text())["roles"] if r["name"] == "generator-0")
    assert (gen0["restarts"], gen0["starts"]) == (1, 2), gen0
    assert gen0["ready"] and gen0["ready"]["pid"] == gen0["pid"], gen0
    assert_exact(run_dir, total)


@pytest.mark.slow
def test_a_frozen_generator_stalls_the_run_with_exit_code_8(task):
    run_dir = task["dir"] / "stall"
    proc = start(task, run_dir, "--learner.total_steps", "50", "--run.stall_timeout_s", "15",
                 "--learner.batch_timeout_s", "600")
    wait_for(proc, run_dir, 3)
    frozen = role_pids(proc.pid, "launch.generator")
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)  # alive (nothing to restart) but doing nothing
    t0 = time.monotonic()
    code, out = finish(proc, timeout=300)
    took = time.monotonic() - t0
    assert code == 8, out[-3000:]
    assert took < 15 + 60, took  # the bound, plus the time to stop every role
    exit_info = json.loads((run_dir / "exit.json").read_text())
    assert (exit_info["code"], exit_info["attempts"]) == (8, [8]), exit_info
    assert "stall_timeout_s=15" in exit_info["reason"] and "buffer" in exit_info["reason"], exit_info


DISK_MB = 48  # the run folder's filesystem: two checkpoints of the tiny model (keep_checkpoints 2), logs


@pytest.mark.slow
def test_a_full_disk_stops_the_run_with_code_9_and_a_resume_finishes_it(task):
    with tmpfs(task["dir"] / "disk_manual", DISK_MB) as disk:
        run_dir, total = disk / "run", 20
        flags = ("--learner.total_steps", str(total), "--learner.keep_checkpoints", "2")
        proc = start(task, run_dir, *flags)
        wait_for(proc, run_dir, 7)
        ballast = fill(disk)
        code, out = finish(proc, timeout=180)
        assert code == 9, out[-3000:]
        exit_info = json.loads((run_dir / "exit.json").read_text())
        assert exit_info["code"] == 9 and exit_info["attempts"] == [9], exit_info
        # the message names what could not be written, under the run folder (the buffer's log, the
        # ledger, metrics.jsonl or a checkpoint: whichever met the full disk first)
        named = f"out of disk space writing {run_dir}/"
        assert named in exit_info["reason"] and named in out, exit_info["reason"]

        ballast.unlink()
        proc = start(task, run_dir, *flags, "--learner.resume", "true")
        code, out = finish(proc, timeout=300)
        assert code == 0, out[-3000:]
        assert_exact(run_dir, total)


@pytest.mark.slow
def test_with_auto_resume_a_full_disk_waits_for_space_and_resumes(task):
    with tmpfs(task["dir"] / "disk_auto", DISK_MB) as disk:
        run_dir, total = disk / "run", 20
        proc = start(task, run_dir, "--learner.total_steps", str(total), "--learner.keep_checkpoints", "2",
                     "--run.auto_resume", "2", "--run.disk_wait_s", "120", "--run.disk_min_free_mb", "8")
        wait_for(proc, run_dir, 7)
        ballast = fill(disk)
        waiting = wait_until(lambda: run_status(run_dir).get("waiting_for_disk"), 120,
                             "the launcher waiting for disk space (status.json)")
        assert waiting["need_mb"] == 8 and min(waiting["free_mb"].values()) < 8, waiting
        assert proc.poll() is None
        ballast.unlink()
        code, out = finish(proc, timeout=300)
        assert code == 0, out[-3000:]
        exit_info = json.loads((run_dir / "exit.json").read_text())
        assert exit_info["resumes"] >= 1 and 9 in exit_info["attempts"], exit_info
        assert_exact(run_dir, total)
