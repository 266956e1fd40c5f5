"""Save, kill, resume: the resumed run's next steps match an uninterrupted run's.

Each run is a real learner process (a world of one, ZeRO-2) fed the same fabricated batches; the
interrupted one is SIGKILLed while it asks for step 3, after it saved checkpoint step_2 and trained
step 2. Resuming from step_2 must restore weights, AdamW moments and the LR schedule exactly, so
steps 2 and 3 give the same losses (to 1e-5 relative) and the same final weights (to 1e-6).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.procs import subprocess_env

DRIVER = r'''
import os, signal, sys
from tests.helpers.learner import ListSource, make_group
from learner.config import LearnerConfig
from learner.trainer import train

model_dir, run_dir, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
# 4 steps x 2 groups of 4; random behaviour log-probs (so w != 1 and TIS caps some), mixed rewards,
# tokens one version old from step 1 on
steps = {s: make_group(2 * s, 4, [1.0, 0.0, 0.5, 0.2], version=max(0, s - 1), seed=s)
            + make_group(2 * s + 1, 4, [0.0, 0.3, 1.0, 1.0], version=max(0, s - 1), seed=s)
         for s in range(4)}


class KillingSource(ListSource):
    def get_batch(self, step, rank=0, world_size=1, timeout_s=None):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing gets to clean up
        return super().get_batch(step, rank, world_size, timeout_s)


cfg = LearnerConfig(model_path=model_dir, run_dir=run_dir, total_steps=4, save_every=2, resume=resume,
                    advantage_estimator="grpo", lr=3e-3, warmup_steps=3, lr_schedule="cosine",
                    ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=2, zero_stage=2,
                    behav_correction="tis", behav_tis_cap=2.0, tensorboard=False)
cfg.validate()
train(cfg, source=KillingSource(steps))
'''


def _env():
    env = subprocess_env()
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a world of one, whatever the test process holds
    return env


def _start(driver: Path, model: Path, run_dir: Path, kill_at: int, resume: bool) -> subprocess.Popen:
    argv = [sys.executable, str(driver), str(model), str(run_dir), str(kill_at), "1" if resume else "0"]
    return subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _by_step(run_dir: Path) -> dict[int, dict]:
    """Last metrics line of each step (a resumed run appends to the same file)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def _weights(folder: Path):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow
def test_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"

    # the uninterrupted run and the one that crashes run side by side
    p_straight = _start(driver, tiny_model_dir, straight, kill_at=-1, resume=False)
    p_crash = _start(driver, tiny_model_dir, crashed, kill_at=3, resume=False)
    rc, out = _finish(p_crash)
    assert rc == -signal.SIGKILL, out[-3000:]
    rc, out = _finish(p_straight)
    assert rc == 0, out[-3000:]
    assert (crashed / "checkpoints" / "latest").read_text().strip() == "step_2"
    before_crash = _by_step(crashed)
    assert sorted(before_crash) == [0, 1, 2]  # step 2 was trained (not saved) before the crash

    rc, out = _finish(_start(driver, tiny_model_dir, crashed, kill_at=-1, resume=True))
    assert rc == 0, out[-3000:]
    # the resumed run appended steps 2 and 3 only: it started from step_2, not from scratch
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [0, 1, 2, 2, 3]

    a, b = _by_step(straight), _by_step(crashed)
    assert sorted(a) == sorted(b) == [0, 1, 2, 3]
    for step in (2, 3):
        for key in ("loss/policy", "policy/clip_frac", "optim/lr", "optim/grad_norm", "policy/ess"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
    # the crashed run's own step 2 (before the kill) agrees too: training is deterministic
    assert before_crash[2]["loss/policy"] == pytest.approx(a[2]["loss/policy"], rel=1e-5)
    # the losses moved between steps (a resume that silently restarted from scratch would not match)
    assert a[3]["loss/policy"] != pytest.approx(a[0]["loss/policy"], rel=1e-3)

    wa, wb = _weights(straight / "checkpoints" / "step_4"), _weights(crashed / "checkpoints" / "step_4")
    w0 = _weights(tiny_model_dir)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert (wa[name] - wb[name]).abs().max().item() < 1e-6, name
    assert any((wa[n] - w0[n]).abs().max().item() > 1e-4 for n in wa)  # and training did change them
