"""Dynamic sampling (DAPO) off and on: the demo run twice, same seed, model, prompts and steps.

    .venv/bin/python bench/dynamic_sampling.py [--steps 200] [--out runs/bench_dynamic_sampling]

Both runs start from the same warm-started tiny model (as `launch.demo` builds it) and train
`--steps` learner steps of examples/demo.yaml; the second adds `--buffer.dynamic_filtering true`.
Each is scored on the same held-out prompts (greedy accuracy of its last checkpoint) and on where
its samples went, from the buffer's counters and the learner's metrics:

    generated           rollouts the generators produced (the buffer relayed them to the scorers)
    trained             rollouts in the learner's batches
    wasted              generated - trained: filtered, stale, late, or still queued at the end
    no_signal_trained   rollouts of groups with equal rewards that were trained anyway (their
                        GRPO advantages are all 0: compute spent for no gradient); counted from
                        the buffer's `no_signal_groups` less `filtered`, so groups still queued
                        at the end count too

Prints progress to stderr and, last, one JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.demo_runs import parse_args, run_demo  # noqa: E402 (after the path is set)


def run(name: str, out: Path, warm: Path, prompts: Path, steps: int, extra: list[str]) -> dict:
    """One demo run; what it generated and trained, and its last checkpoint."""
    from buffer.store import LOG_NAME, StateStore

    run_dir = out / name
    cfg, rows = run_demo(name, out / name, [
        "--learner.model_path", str(warm), "--buffer.prompts", str(prompts),
        "--learner.total_steps", str(steps), "--learner.save_every", "0", "--generator.stop_token_ids",
        str(newline_id()), *extra])
    c = StateStore.read(Path(cfg.buffer.state_dir) / LOG_NAME).counters  # written at the buffer's shutdown
    n = cfg.buffer.n_samples_per_prompt
    generated, trained = c["relayed_rollouts"], int(sum(r["perf/samples"] for r in rows))
    return {
        "steps": len(rows),
        "wall_s": round(rows[-1]["time"] - rows[0]["time"], 1),
        "generated": generated,
        "trained": trained,
        "wasted": generated - trained,
        "filtered_groups": c["filtered"],
        "filter_cap_hits": c["filter_cap_hits"],
        "no_signal_trained": (c["no_signal_groups"] - c["filtered"]) * n,
        "reward_last": round(sum(r["reward/mean"] for r in rows[-20:]) / len(rows[-20:]), 4),
        "checkpoint": str(sorted((run_dir / "checkpoints").glob("step_*"))[-1]),
    }


def newline_id() -> int:
    from demo.tiny_model import build_tokenizer

    return build_tokenizer().convert_tokens_to_ids("\n")


def main() -> None:
    a = parse_args(__doc__, 200, "runs/bench_dynamic_sampling", "--buffer.max_staleness=2")

    from demo.arithmetic import bench_setup, greedy_accuracy

    out = Path(a.out)
    heldout, prompts, warm, acc0 = bench_setup(out, a.warm_steps)
    print(f"[bench] held-out accuracy after the warm start: {acc0:.3f}", file=sys.stderr, flush=True)

    results = {}
    for name, extra in (("off", []), ("on", ["--buffer.dynamic_filtering", "true"])):
        r = run(name, out, warm, prompts, a.steps, [*a.overrides, *extra])
        r["heldout_acc"] = greedy_accuracy(r.pop("checkpoint"), heldout)
        results[name] = r
        print(f"[bench] {name}: {r}", file=sys.stderr, flush=True)
    print(json.dumps({"steps": a.steps, "heldout_acc_start": acc0,
                      **{f"{k}_{name}": v for name, r in results.items() for k, v in r.items()}}))


if __name__ == "__main__":
    main()
