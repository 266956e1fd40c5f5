"""Three tasks in one run through `launch.local` (real generator, scorer, buffer, learner, weight
sync, tiny model): arithmetic rows scored by exact match, math rows by the `math` built-in, and
reasoning-gym's `chain_sum` made on the spot (`reasoning_gym:chain_sum`) and scored by the
`reasoning_gym` built-in, each row's `task` column picking its reward; the rows' other columns reach
the reward functions whole (a reward file that needs its `level` column fails without it, and the
reasoning-gym reward needs its entry). Asserted: the run completes, every step logs each task's
metrics, and the evaluation reports each task's pass rate with no prompt failed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT, subprocess_env

ARITH = '''
def reward_fn(prompts, completions, labels, level):
    # `level` is a column of the prompt row: it must arrive, one value per sample
    assert all(isinstance(x, int) for x in level), level
    return [float(c.strip()[::-1] == l) for c, l in zip(completions, labels)]
'''


@pytest.mark.slow
def test_three_tasks_score_by_their_rows_task_and_report_apart(tiny_model_dir, tmp_path):
    from demo.arithmetic import make_problems

    rows = [{**p, "task": "arith", "level": 1} for p in make_problems(16, seed=0)]
    rows += [{"prompt": f"{a}/{b}=", "label": f"\\frac{{{a}}}{{{b}}}", "task": "math", "level": 2}
             for a, b in [(1, 2), (3, 4), (2, 5), (5, 7), (1, 3), (7, 9), (4, 5), (2, 3)] * 2]
    prompts = tmp_path / "tasks.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "arith.py").write_text(ARITH)
    run_dir = tmp_path / "run"
    datasets = f"{prompts},reasoning_gym:chain_sum?size=16&seed=0"
    argv = [sys.executable, "-m", "launch.local", str(ROOT / "examples" / "demo.yaml"), "--run.run_dir", str(run_dir),
            "--learner.model_path", str(tiny_model_dir), "--buffer.prompts", datasets,
            "--scorer.tasks", f"{{arith: {tmp_path / 'arith.py'}, math: math, chain_sum: reasoning_gym}}",
            "--scorer.task_options", "{math: {extract: [last_number]}}",
            "--buffer.prompts_per_step", "8", "--buffer.n_samples_per_prompt", "2", "--learner.total_steps", "2",
            "--eval.dataset", datasets, "--eval.every", "2", "--eval.max_samples", "48"]
    res = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/policy" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        shares = [r.get(f"task/{t}/share", 0.0) for t in ("arith", "math", "chain_sum")]
        assert sum(shares) == pytest.approx(1.0) and all(0.0 <= r[k] <= 1.0 for k in r if k.endswith("pass_rate"))
    assert any("task/arith/reward_mean" in r for r in steps) and any("task/math/reward_mean" in r for r in steps)
    evals = [r for r in rows if "eval/pass@1" in r]
    assert len(evals) == 2  # versions 0 and 2
    for r in evals:  # each task's 16 prompts on their own
        for t in ("arith", "math", "chain_sum"):
            assert r[f"eval/{t}/prompts"] == 16 and 0.0 <= r[f"eval/{t}/pass@1"] <= 1.0
        # no prompt failed for want of its columns (the arithmetic reward asserts its `level` column)
        assert r["eval/failed_prompts"] == 0
