"""Chaos: a long run under `launch.local` with kill -9 of random roles at random moments, auto-resume on.

    .venv/bin/python bench/chaos.py [--steps 150] [--kills 10] [--seed 0] [--out runs/bench_chaos]

The same run is made twice from the same tiny model and prompts: once untouched (`clean_wall_s`),
once with `--kills` kill -9s of a role drawn at random (generator, scorer, learner, buffer,
weight-sync service) at learner steps drawn at random. Generators and scorers are restarted by the
launcher; a learner, buffer or weight-sync kill restarts the whole run from its last checkpoint
(`run.auto_resume`). Afterwards the ledger is audited (`launch.ledger`): every step once, no group
trained twice, none lost, no rollout newer than the step it trained (negative staleness).

Prints progress to stderr and, last, one JSON line on stdout: kills, restarts, resumes,
attempt_codes (each whole-run start's exit code, from exit.json), reached_total_steps, \
groups_lost, groups_trained_twice, negative_staleness_steps, wall_s,
clean_wall_s, overhead (wall_s / clean_wall_s).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROLES = {"generator": "launch.generator", "scorer": "launch.scorer", "learner": "launch.learner",
         "buffer": "launch.buffer", "weight_sync": "launch.weight_sync"}


def say(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


def steps_done(run_dir: Path) -> int:
    """Distinct learner steps in the ledger (a resumed run redoes some)."""
    from learner.ledger import read_ledger

    return len(read_ledger(run_dir / "ledger.jsonl"))


def role_pid(launcher_pid: int, module: str) -> int | None:
    import psutil

    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            cmd = p.cmdline()
            if module in cmd and p.status() != psutil.STATUS_ZOMBIE:
                return p.pid
        except psutil.Error:
            pass
    return None


def start(run_dir: Path, model: Path, prompts: Path, steps: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launch.local", str(ROOT / "examples" / "demo.yaml"), "--run.run_dir", str(run_dir),
            "--learner.model_path", str(model), "--buffer.prompts", str(prompts), "--learner.total_steps", str(steps),
            "--learner.save_every", "10", "--buffer.prompts_per_step", "4", "--buffer.n_samples_per_prompt", "4",
            "--generator.groups_per_lease", "2", "--buffer.lease_ttl_s", "15", "--run.auto_resume", "100",
            "--run.max_restarts", "100", "--run.restart_delay_s", "1", "--run.stall_timeout_s", "600"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def chaos_run(run_dir: Path, model: Path, prompts: Path, steps: int, kills: int, rng: random.Random,
              timeout_s: float) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # kill points spread over the run: one per slice of steps, at a random step and role in each
    width = (steps - 10) / max(kills, 1)
    plan = sorted((5 + int(i * width + rng.random() * width), rng.choice(sorted(ROLES))) for i in range(kills))
    t0 = time.monotonic()
    proc = start(run_dir, model, prompts, steps)
    done_kills = []
    try:
        for at, role in plan:
            while steps_done(run_dir) < at and proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"no step {at} within {timeout_s:.0f}s")
                time.sleep(0.2)
            if proc.poll() is not None:
                break
            time.sleep(rng.random() * 2.0)  # a random moment within the step, not just at its end
            pid = None
            deadline = time.monotonic() + 120
            while pid is None and time.monotonic() < deadline and proc.poll() is None:
                pid = role_pid(proc.pid, ROLES[role])  # it may be restarting from the last kill
                time.sleep(0.2)
            if pid is None:
                say(f"step {at}: no {role} process to kill")
                continue
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                continue
            done_kills.append((steps_done(run_dir), role))
            say(f"kill -9 {role} (pid {pid}) at step {done_kills[-1][0]}")
        remaining = max(60.0, timeout_s - (time.monotonic() - t0))
        code = proc.wait(timeout=remaining)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return {"code": code, "wall_s": time.monotonic() - t0, "kills": done_kills}


def negative_staleness_steps(run_dir: Path) -> int:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        rows[r["step"]] = r  # the final lineage's row of each step
    return sum(1 for r in rows.values() if r["buffer/staleness_min"] < 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_chaos"))
    args = ap.parse_args()

    from demo.arithmetic import make_problems, write_jsonl
    from demo.tiny_model import build_tiny_model
    from launch.ledger import audit

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(make_problems(3000, seed=0), out / "train.jsonl")
    model = build_tiny_model(out / "model", seed=0)

    say(f"clean run: {args.steps} steps")
    clean = chaos_run(out / "clean", model, prompts, args.steps, 0, random.Random(args.seed), args.timeout_s)
    say(f"clean run: exit {clean['code']} in {clean['wall_s']:.0f}s")
    say(f"chaos run: {args.steps} steps, {args.kills} kills")
    chaos = chaos_run(out / "chaos", model, prompts, args.steps, args.kills, random.Random(args.seed), args.timeout_s)
    report = audit(out / "chaos")
    exit_info = json.loads((out / "chaos" / "exit.json").read_text())
    result = {
        "steps": args.steps,
        "kills": len(chaos["kills"]),
        "killed": [f"{role}@{at}" for at, role in chaos["kills"]],
        "restarts": exit_info.get("restarts"),
        "resumes": exit_info.get("resumes"),
        "attempt_codes": exit_info.get("attempts"),
        "exit_code": chaos["code"],
        "reached_total_steps": chaos["code"] == 0 and report["steps"] == args.steps and not report["missing_steps"],
        "groups_lost": report.get("groups_lost"),
        "groups_trained_twice": report["groups_trained_twice"],
        "groups_dropped": report.get("groups_dropped"),
        "negative_staleness_steps": negative_staleness_steps(out / "chaos"),
        "wall_s": round(chaos["wall_s"], 1),
        "clean_wall_s": round(clean["wall_s"], 1),
        "overhead": round(chaos["wall_s"] / clean["wall_s"], 2),
        "command": "python bench/chaos.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
