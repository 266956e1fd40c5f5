"""The embedded demo: `make demo` or `python -m launch.demo [--section.key VALUE ...]`.

1. builds the tiny Llama and its character tokenizer (nothing is downloaded);
2. warm-starts it by supervised fine-tuning on two-digit addition (answer digits reversed), stopped
   early so the policy is only partly right;
3. runs async GRPO through `launch.local` with examples/demo.yaml: a vLLM generator, a scorer with
   the exact-match reward, a DeepSpeed learner and weight sync, as separate processes;
4. evaluates the policy during training, every 25 steps: the run's generator answers held-out
   prompts (never trained on) greedily at that policy version and the scorer scores them
   (`eval/pass@1` in the metrics: held-out greedy accuracy); and leaves in the run folder:
   tensorboard logs, `reward.png`, HF checkpoints, the evaluation samples and `summary.json`.

Overrides go to the run config (`--learner.total_steps 20`); `--demo.warm_steps N`,
`--demo.heldout N`, `--demo.eval_every N` and `--demo.out DIR` set the demo's own knobs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "examples" / "demo.yaml"
DEMO_DEFAULTS = {"warm_steps": 375, "heldout": 200, "train_prompts": 3000, "seed": 0, "out": "", "eval_every": 25}


def split_demo_args(argv: list[str]) -> tuple[dict, list[str]]:
    """`--demo.key V` pairs for the demo itself; everything else is a run-config override."""
    demo, rest, i = dict(DEMO_DEFAULTS), [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--demo."):
            key, _, val = a[len("--demo."):].partition("=")
            if not val:
                i += 1
                val = argv[i] if i < len(argv) else ""
            if key not in DEMO_DEFAULTS:
                raise SystemExit(f"launch.demo: unknown flag --demo.{key} (known: {', '.join(DEMO_DEFAULTS)})")
            demo[key] = type(DEMO_DEFAULTS[key])(val) if key != "out" else val
        else:
            rest.append(a)
        i += 1
    return demo, rest


def checkpoint_steps(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for p in (run_dir / "checkpoints").glob("step_*"):
        if (p / "config.json").exists():
            out.append((int(p.name.split("_")[1]), p))
    return sorted(out)


def plot(run_dir: Path, rows: list[dict], acc_points: list[tuple[int, float]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("reward/mean", float("nan")) for r in rows], label="reward (train batches)", alpha=0.8)
    if acc_points:
        ax.plot([s for s, _ in acc_points], [a for _, a in acc_points], "o-",
                label="held-out greedy accuracy (eval/pass@1)")
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Conveyor demo: async GRPO on reversed-digit addition")
    fig.tight_layout()
    path = run_dir / "reward.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summarize(run_dir: Path, rows: list[dict], acc_points: list[tuple[int, float]], wall_s: float,
              max_staleness: int) -> dict:
    rewards = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    tenth = max(1, len(rewards) // 10)
    seen = [r["buffer/staleness_max"] for r in rows if r.get("buffer/staleness_max") is not None]
    return {
        "reward_first": sum(rewards[:tenth]) / tenth if rewards else None,
        "reward_last": sum(rewards[-tenth:]) / tenth if rewards else None,
        "heldout_acc_start": acc_points[0][1] if acc_points else None,
        "heldout_acc_end": acc_points[-1][1] if acc_points else None,
        "heldout_acc": {str(s): a for s, a in acc_points},
        "steps": len(rows),
        "wall_s": round(wall_s, 1),
        "max_staleness_seen": max(seen) if seen else None,
        "max_staleness": max_staleness,
        "final_checkpoint": str(checkpoint_steps(run_dir)[-1][1]) if checkpoint_steps(run_dir) else None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    demo, overrides = split_demo_args(argv)
    from launch.config import ConfigError
    from launch.local import EXIT_CODES, read_metrics, run_local
    from launch.run_config import load_run_config

    t0 = time.monotonic()
    # the run config is checked (with placeholder paths) before anything slow happens
    try:
        probe = load_run_config(DEMO_CONFIG, [*overrides, "--learner.model_path", str(ROOT),
                                              "--buffer.prompts", str(DEMO_CONFIG)])
    except ConfigError as e:
        print(f"launch.demo: {e}", file=sys.stderr)
        return EXIT_CODES["config"]
    run_dir = Path(demo["out"] or probe.run.run_dir)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    data_dir = run_dir / "data"

    from demo.arithmetic import make_problems, warm_start, write_jsonl
    from demo.tiny_model import build_tiny_model, build_tokenizer

    heldout = make_problems(demo["heldout"], seed=10_000 + demo["seed"])
    train = make_problems(demo["train_prompts"], seed=demo["seed"], exclude={p["prompt"] for p in heldout})
    heldout_path = write_jsonl(heldout, data_dir / "heldout.jsonl")
    prompts = write_jsonl(train, data_dir / "train.jsonl")
    base = build_tiny_model(run_dir / "models" / "base", seed=demo["seed"])
    print(f"[demo] warm start: {demo['warm_steps']} supervised steps on {len(train)} problems", flush=True)
    warm = warm_start(base, run_dir / "models" / "warm", train, demo["warm_steps"], seed=demo["seed"], log_every=100)

    newline = build_tokenizer().convert_tokens_to_ids("\n")
    run = load_run_config(DEMO_CONFIG, [*overrides, "--learner.model_path", str(warm), "--buffer.prompts",
                                        str(prompts), "--run.run_dir", str(run_dir),
                                        "--generator.stop_token_ids", str(newline),
                                        # evaluation during training: greedy answers to the held-out prompts
                                        "--eval.dataset", str(heldout_path), "--eval.every", str(demo["eval_every"]),
                                        "--eval.n_samples_per_prompt", "1", "--eval.temperature", "0"])
    print(f"[demo] async GRPO for {run.learner.total_steps} steps: logs in {run_dir / 'logs'}", flush=True)
    code = run_local(run)
    if code != 0:
        print(f"[demo] the run failed (exit code {code}); see {run_dir / 'logs'}", file=sys.stderr)
        return code

    rows = read_metrics(run_dir / "metrics.jsonl")
    acc_points = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    for step, acc in acc_points:
        print(f"[demo] step {step}: held-out greedy accuracy {acc:.3f}", flush=True)
    rows = [r for r in rows if "loss/policy" in r]  # (the final evaluation has a row of its own)
    plot(run_dir, rows, acc_points)
    summary = summarize(run_dir, rows, acc_points, time.monotonic() - t0, run.buffer.max_staleness)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"[demo] done in {summary['wall_s']:.0f}s: reward {summary['reward_first']:.3f} -> "
          f"{summary['reward_last']:.3f}, held-out accuracy {summary['heldout_acc_start']:.3f} -> "
          f"{summary['heldout_acc_end']:.3f}; plot: {run_dir / 'reward.png'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
