"""Async vs sync: the same shortened demo run in lockstep and in asynchronous mode, side by side.

    .venv/bin/python bench/async_vs_sync.py [--steps 40] [--out runs/bench_async_vs_sync]

Both runs start from the same warm-started tiny model and prompts, with the generator pinned to
core 0 and the learner to core 1 (`run.generator_cpus`, `run.learner_cpus`), so the two phases can
overlap only in async mode. Timed: wall seconds from the end of step 0 to the end of step K-1 (engine
start-up and the first batch are left out, they are the same in both modes).

The ideal speedup comes from the sync run's own phases: per step the learner waits `t_gen` for its
batch (generation, scoring, transfer) and then spends `t_train` training and publishing; overlapped
perfectly, a step costs max(t_gen, t_train) instead of their sum.

Prints progress to stderr and, last, one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.demo_runs import parse_args, run_demo  # noqa: E402 (after the path is set)


def run_mode(mode: str, out: Path, warm: Path, prompts: Path, steps: int, extra: list[str]) -> list[dict]:
    return run_demo(mode, out / mode, [
        "--run.mode", mode, "--learner.model_path", str(warm),
        "--buffer.prompts", str(prompts), "--learner.total_steps", str(steps), "--learner.save_every", "0",
        "--run.generator_cpus", "0", "--run.learner_cpus", "1", "--run.threads_per_role", "1", *extra])[1]


def mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


def main() -> None:
    a = parse_args(__doc__, 40, "runs/bench_async_vs_sync", "--buffer.prompts_per_step=32")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("[bench] needs at least 2 cores to pin the generator and the learner apart")

    from demo.arithmetic import bench_setup, greedy_accuracy

    out = Path(a.out)
    heldout, prompts, warm, acc0 = bench_setup(out, a.warm_steps)

    results = {}
    for mode in ("sync", "async"):
        rows = run_mode(mode, out, warm, prompts, a.steps, a.overrides)
        body = rows[1:]  # step 0 waited for engine start-up
        results[mode] = {
            "wall_s": rows[-1]["time"] - rows[0]["time"],
            "t_gen": mean([r["time/wait_for_batch"] for r in body]),
            "t_train": mean([r["time/train_step"] + r["time/publish"] + r.get("time/save", 0.0) for r in body]),
            "reward_last": mean([r["reward/mean"] for r in rows[-max(1, len(rows) // 5):]]),
            "staleness_max": max(r["buffer/staleness_max"] for r in rows),
            "heldout_acc": greedy_accuracy(str(sorted((out / mode / "checkpoints").glob("step_*"))[-1]), heldout),
        }
        print(f"[bench] {mode}: {results[mode]}", file=sys.stderr, flush=True)

    s, y = results["sync"], results["async"]
    ideal = (s["t_gen"] + s["t_train"]) / max(s["t_gen"], s["t_train"])
    speedup = s["wall_s"] / y["wall_s"]
    print(json.dumps({
        "steps": a.steps,
        "sync_wall_s": round(s["wall_s"], 2),
        "async_wall_s": round(y["wall_s"], 2),
        "speedup": round(speedup, 3),
        "ideal_speedup": round(ideal, 3),
        "fraction_of_ideal": round((speedup - 1) / (ideal - 1), 3) if ideal > 1 else None,
        "speedup_over_ideal": round(speedup / ideal, 3),
        "sync_t_gen_s": round(s["t_gen"], 4),
        "sync_t_train_s": round(s["t_train"], 4),
        "sync_reward_last": round(s["reward_last"], 4),
        "async_reward_last": round(y["reward_last"], 4),
        "heldout_acc_start": acc0,
        "sync_heldout_acc": s["heldout_acc"],
        "async_heldout_acc": y["heldout_acc"],
        "async_staleness_max": y["staleness_max"],
    }))


if __name__ == "__main__":
    main()
