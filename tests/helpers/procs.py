"""Role processes as tests start them: the project on the path (`subprocess_env`), a role by its
entry point (`start_role`), and bounded waits for their end (`wait_exit`, `stop`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.ready import ENV as READY_ENV

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = str(ROOT / "examples" / "rewards" / "arithmetic.py")  # the reward file of the arithmetic task


def subprocess_env() -> dict[str, str]:
    """Environment for role subprocesses started by tests: the project on the path, quiet libraries."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start_role(tmp_path: Path, role: str, name: str, port: int, **cfg) -> tuple[subprocess.Popen, Path]:
    """`python -m launch.<role>` with `--<role>.key value` flags; stderr goes to <name>.log, its
    ready record (common/ready.py) to <name>.ready.json."""
    args = [sys.executable, "-m", f"launch.{role}", f"--{role}.buffer_port", str(port)]
    for k, v in cfg.items():
        args += [f"--{role}.{k}", str(v)]
    log = tmp_path / f"{name}.log"
    env = {**subprocess_env(), READY_ENV: str(tmp_path / f"{name}.ready.json")}
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    return proc, log


def wait_exit(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{log.stem} did not finish within {timeout}s:\n{log.read_text()[-4000:]}")


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
