"""On-policy distillation through `launch.local` (real generator, teacher scorer, buffer, learner,
weight sync, tiny model), with the student's own starting weights as the teacher, beside a task
reward (the completion's length, which moves the student from step 0 on; an identical teacher alone
would never move it): at step 0 the teacher's log-probs of the sampled tokens must equal the
learner's own pi_old exactly (the same tokens, aligned, the same function), so the reverse KL is 0;
once the student has moved, it is not."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT, subprocess_env


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_gives_zero_kl_until_the_student_moves(tiny_model_dir, tmp_path):
    from demo.arithmetic import make_problems, write_jsonl

    prompts = write_jsonl(make_problems(64, seed=0), tmp_path / "p.jsonl")
    (tmp_path / "length.py").write_text("def reward_fn(prompts, completions, labels):\n"
                                        "    return [len(c) / 5 for c in completions]\n")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launch.local", str(ROOT / "examples" / "demo.yaml"), "--run.run_dir", str(run_dir),
            "--learner.model_path", str(tiny_model_dir), "--buffer.prompts", str(prompts),
            "--scorer.kinds", "reward_fn,teacher", "--scorer.reward_fn", str(tmp_path / "length.py"),
            "--scorer.teacher", str(tiny_model_dir), "--learner.distill_coef", "1.0",
            "--buffer.prompts_per_step", "4", "--buffer.n_samples_per_prompt", "2", "--learner.total_steps", "4",
            "--learner.lr", "1e-3", "--run.mode", "sync"]
    res = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "loss/policy" in x]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-5, rows[0]["distill/reverse_kl"]
    assert math.isfinite(rows[-1]["distill/reverse_kl"]) and abs(rows[-1]["distill/reverse_kl"]) > 1e-4
