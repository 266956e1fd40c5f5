"""The embedded demos: `make demo` or `python -m launch.demo [--demo.task TASK] [--section.key V ...]`
(TASK: arithmetic, calc, guess, distill or vision).

1. builds the tiny Llama and its character tokenizer (nothing is downloaded);
2. warm-starts it by supervised fine-tuning, stopped early so the policy is only partly right:
   `--demo.task arithmetic` (the default, examples/demo.yaml) on two-digit addition (answer digits
   reversed); `--demo.task calc` (`make demo-agent`, examples/agent.yaml) on scripted episodes of
   multiplication with the calculator tool (demo/calc.py); `--demo.task guess` (examples/guess.yaml)
   on bisection's episodes of the guessing game (demo/guess.py). In the multi-turn tasks the loss is
   on the policy's turns only, the tool's results and the game's answers masked;
3. runs async GRPO through `launch.local` with the task's config: a vLLM generator (for calc and
   guess, one multi-turn episode against the environment per sample), a scorer (the exact-match
   reward; the episode's reward), a DeepSpeed learner and weight sync, as separate processes;
4. evaluates the policy during training, every `eval_every` steps: the run's generator answers
   held-out problems (arithmetic, calc) or plays one episode per secret of the range (guess; its
   prompt names only the range, so no secret is held out unless `--demo.heldout N`: demo/guess.py
   says why), greedily at that policy version, and the scorer scores them (`eval/pass@1` in the
   metrics: greedy accuracy, or the fraction of secrets found); and leaves in the run folder:
   tensorboard logs, `reward.png`, HF checkpoints, the evaluation samples and `summary.json` (with
   `run_s`, the wall clock after the warm start, and `wall_s`, all of it).

`--demo.task distill` is on-policy distillation without a reward: a teacher warm-started much longer
(`--demo.teacher_steps`, 1200: it answers every held-out problem) scores the student's own samples
token by token (a scorer of kind `teacher`, `learner.distill_coef 1`), and the student, the
arithmetic demo's warm start, is evaluated greedily on the held-out problems at each checkpoint
(with transformers: the run has no reward to judge answers by).

Overrides go to the run config (`--learner.total_steps 20`); `--demo.task`, `--demo.warm_steps N`,
`--demo.heldout N`, `--demo.train_prompts N`, `--demo.seed N`, `--demo.eval_every N` and
`--demo.out DIR`, `--demo.teacher_steps N` set the demo's own knobs (their defaults depend on the task: TASKS).
`--demo.task vision` trains a vision-language policy: the tiny Qwen2-VL (demo/tiny_vlm.py) counts red
squares in 56x56 pictures (demo/vision.py; examples/vision.yaml), warm-started for 60 steps.
`--demo.model qwen3_moe` (arithmetic and distill) trains a tiny mixture of experts instead of the
Llama (8 experts, top-2; demo/tiny_model.py), with routing replay on (docs/moe.md) and a warm start
of 500 steps.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "examples" / "demo.yaml"
AGENT_CONFIG = ROOT / "examples" / "agent.yaml"  # the tools demo (calc)
GUESS_CONFIG = ROOT / "examples" / "guess.yaml"
VISION_CONFIG = ROOT / "examples" / "vision.yaml"
DEMO_DEFAULTS = {"task": "arithmetic", "model": "llama", "warm_steps": 375, "heldout": 200, "train_prompts": 3000,
                 "seed": 0, "out": "", "eval_every": 25, "teacher_steps": 1200}
# Each task: its run config, the demo knobs it sets otherwise, and the plot's title and label.
TASKS = {
    "arithmetic": {"config": DEMO_CONFIG, "defaults": {},
                   "title": "Conveyor demo: async GRPO on reversed-digit addition",
                   "heldout_label": "held-out greedy accuracy (eval/pass@1)",
                   "eval_set": "held-out problems, one greedy answer each"},
    # calc: a warm start of 70 steps answers about 30% of the held-out problems through the tool
    "calc": {"config": AGENT_CONFIG, "defaults": {"warm_steps": 70, "heldout": 200, "train_prompts": 3000,
                                                  "eval_every": 20},
             "title": "Conveyor agent demo: async GRPO on multiplication with a calculator tool",
             "heldout_label": "held-out problems solved, greedy (eval/pass@1)",
             "eval_set": "held-out problems, one greedy episode each"},
    # distill: no reward; the student (the arithmetic demo's warm start) learns from a teacher's log-probs
    "distill": {"config": DEMO_CONFIG, "defaults": {},
                "title": "Conveyor demo: on-policy distillation (no reward) on reversed-digit addition",
                "heldout_label": "student's held-out greedy accuracy",
                "eval_set": "held-out problems, one greedy answer each, at each checkpoint (transformers)",
                "series": ("distill/reverse_kl", "reverse KL to the teacher, per token (train batches)")},
    # guess: no secret held out (see demo/guess.py); a warm start of 45 steps finds about 40% of them
    "guess": {"config": GUESS_CONFIG, "defaults": {"warm_steps": 45, "heldout": 0, "train_prompts": 8000,
                                                   "eval_every": 20},
              "title": "Conveyor agent demo: async GRPO on a multi-turn guessing game",
              "heldout_label": "secrets found in 5 guesses, greedy (eval/pass@1)",
              "eval_set": "every secret of 1-31, one greedy episode each"},
    # vision: the tiny Qwen2-VL counts red squares; a warm start of 60 steps counts about half of them
    "vision": {"config": VISION_CONFIG, "defaults": {"warm_steps": 60, "heldout": 200, "train_prompts": 2000,
                                                     "eval_every": 10},
               "title": "Conveyor vision demo: async GRPO, a tiny VLM counts red squares",
               "heldout_label": "held-out pictures counted right, greedy (eval/pass@1)",
               "eval_set": "held-out pictures, one greedy answer each"},
}


def split_demo_args(argv: list[str]) -> tuple[dict, list[str]]:
    """`--demo.key V` pairs for the demo itself (unset keys: the task's defaults, then
    DEMO_DEFAULTS); everything else is a run-config override."""
    given, rest, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--demo."):
            key, _, val = a[len("--demo."):].partition("=")
            if not val:
                i += 1
                val = argv[i] if i < len(argv) else ""
            if key not in DEMO_DEFAULTS:
                raise SystemExit(f"launch.demo: unknown flag --demo.{key} (known: {', '.join(DEMO_DEFAULTS)})")
            given[key] = type(DEMO_DEFAULTS[key])(val)
        else:
            rest.append(a)
        i += 1
    task = given.get("task", DEMO_DEFAULTS["task"])
    if task not in TASKS:
        raise SystemExit(f"launch.demo: --demo.task {task!r} is not a task (known: {', '.join(TASKS)})")
    model = given.get("model", DEMO_DEFAULTS["model"])
    if model not in ("llama", "qwen3_moe") or (model != "llama" and task not in ("arithmetic", "distill")):
        raise SystemExit(f"launch.demo: --demo.model {model!r}: llama, or qwen3_moe with the arithmetic or distill "
                         f"task (routing replay is for single-turn samples)")
    # the tiny MoE learns the task more slowly: 375 steps leave it near 0.05, from which GRPO finds
    # little to reinforce; 500 bring it to ~0.26 (bench/moe.py)
    moe = {"warm_steps": 500} if model != "llama" else {}
    return {**DEMO_DEFAULTS, **TASKS[task]["defaults"], **moe, **given}, rest


def prepare_arithmetic(demo: dict, run_dir: Path) -> tuple[Path, Path, Path, list[str]]:
    """(warm model, training prompts, held-out prompts, []) of the arithmetic demo: every
    evaluation prompt is held out."""
    from demo.arithmetic import make_problems, warm_start, write_jsonl
    from demo.tiny_model import build_tiny_model

    data_dir = run_dir / "data"
    heldout = make_problems(demo["heldout"], seed=10_000 + demo["seed"])
    train = make_problems(demo["train_prompts"], seed=demo["seed"], exclude={p["prompt"] for p in heldout})
    heldout_path = write_jsonl(heldout, data_dir / "heldout.jsonl")
    prompts = write_jsonl(train, data_dir / "train.jsonl")
    base = build_tiny_model(run_dir / "models" / "base", seed=demo["seed"], family=demo["model"])
    print(f"[demo] warm start: {demo['warm_steps']} supervised steps on {len(train)} problems", flush=True)
    warm = warm_start(base, run_dir / "models" / "warm", train, demo["warm_steps"], seed=demo["seed"], log_every=100)
    return warm, prompts, heldout_path, []


def prepare_distill(demo: dict, run_dir: Path) -> tuple[Path, Path, Path, list[str]]:
    """The arithmetic demo's student, data and held-out set, and a teacher warm-started from the same
    base for `teacher_steps` (its folder in demo["teacher"])."""
    from demo.arithmetic import make_problems, warm_start

    student, prompts, heldout_path, held = prepare_arithmetic(demo, run_dir)
    heldout = make_problems(demo["heldout"], seed=10_000 + demo["seed"])
    train = make_problems(demo["train_prompts"], seed=demo["seed"], exclude={p["prompt"] for p in heldout})
    print(f"[demo] teacher: {demo['teacher_steps']} supervised steps", flush=True)
    demo["teacher"] = warm_start(run_dir / "models" / "base", run_dir / "models" / "teacher", train,
                                 demo["teacher_steps"], seed=demo["seed"], log_every=0)
    return student, prompts, heldout_path, held


def distill_overrides(demo: dict) -> list[str]:
    """The run config of the distillation demo: the teacher scores, no reward, checkpoints to evaluate."""
    return ["--scorer.kinds", "teacher", "--scorer.teacher", str(demo["teacher"]), "--learner.distill_coef", "1.0",
            "--learner.total_steps", "100", "--learner.save_every", str(demo["eval_every"])]


def checkpoint_accuracy(run_dir: Path, start: Path, heldout_path: Path) -> list[tuple[int, float]]:
    """(step, held-out greedy accuracy) of the start model and of every checkpoint (transformers)."""
    from demo.arithmetic import greedy_accuracy

    heldout = [json.loads(line) for line in heldout_path.read_text().splitlines() if line.strip()]
    return [(step, greedy_accuracy(str(p), heldout)) for step, p in [(0, start), *checkpoint_steps(run_dir)]]


def prepare_calc(demo: dict, run_dir: Path) -> tuple[Path, Path, Path, list[str]]:
    """(warm model, training prompts, held-out prompts, []) of the tools demo: other problems are
    held out; the warm start learns scripted episodes (call, result, answer) of the training ones."""
    from demo.arithmetic import warm_start_segments, write_jsonl
    from demo.calc import episode_segments, make_problems
    from demo.tiny_model import build_tiny_model

    data_dir = run_dir / "data"
    heldout = make_problems(demo["heldout"], seed=10_000)  # one test set whatever --demo.seed
    train = make_problems(demo["train_prompts"], seed=demo["seed"], exclude={p["prompt"] for p in heldout})
    heldout_path, prompts = (write_jsonl(heldout, data_dir / "heldout.jsonl"),
                             write_jsonl(train, data_dir / "train.jsonl"))
    base = build_tiny_model(run_dir / "models" / "base", seed=demo["seed"])
    print(f"[demo] warm start: {demo['warm_steps']} supervised steps on scripted calculator episodes of "
          f"{len(train)} problems", flush=True)
    warm = warm_start_segments(base, run_dir / "models" / "warm", [episode_segments(p) for p in train],
                               demo["warm_steps"], batch_size=64, seed=demo["seed"], log_every=0)
    return warm, prompts, heldout_path, []


def guess_data(demo: dict, data_dir: Path) -> tuple[list[int], list[int], Path, Path]:
    """(training secrets, held-out secrets, training prompts, evaluation prompts) of the guessing game:
    `demo["train_prompts"]` rows of training secrets; one evaluation row per secret of the range."""
    from demo.arithmetic import write_jsonl
    from demo.guess import make_problems, prompt_of, split_secrets

    # the same held-out secrets whatever --demo.seed: one test set for every run. The evaluation
    # plays every secret once, the held-out ones among them (their success: `subset_points`).
    train_secrets, held = split_secrets(demo["heldout"], seed=0)
    eval_path = write_jsonl([{"prompt": prompt_of(), "label": str(s)} for s in sorted(train_secrets + held)],
                            data_dir / "eval.jsonl")
    prompts = write_jsonl(make_problems(demo["train_prompts"], demo["seed"], train_secrets), data_dir / "train.jsonl")
    return train_secrets, held, prompts, eval_path


def prepare_guess(demo: dict, run_dir: Path) -> tuple[Path, Path, Path, list[str]]:
    """(warm model, training prompts, evaluation prompts, held-out labels) of the guessing game; the
    warm start learns bisection's episodes of the training secrets (`guess_data`)."""
    from demo.arithmetic import warm_start_segments
    from demo.guess import bisection_segments, reachable
    from demo.tiny_model import build_tiny_model

    train_secrets, held, prompts, eval_path = guess_data(demo, run_dir / "data")
    base = build_tiny_model(run_dir / "models" / "base", seed=demo["seed"])
    print(f"[demo] warm start: {demo['warm_steps']} supervised steps on bisection's episodes of "
          f"{len(train_secrets)} secrets; held out: {held or 'none'}"
          + (f", of which bisection meets {reachable(held, train_secrets)} on the way to a training secret"
             if held else ""), flush=True)
    warm = warm_start_segments(base, run_dir / "models" / "warm", [bisection_segments(s) for s in train_secrets],
                               demo["warm_steps"], batch_size=64, seed=demo["seed"], log_every=0)
    return warm, prompts, eval_path, [str(s) for s in held]


def prepare_vision(demo: dict, run_dir: Path) -> tuple[Path, Path, Path, list[str]]:
    """(warm model, training prompts, held-out prompts, []) of the vision demo: the tiny Qwen2-VL
    warm-started on counting; the training pictures in Parquet (image structs), the held-out ones
    in JSONL (base64), as datasets hold them."""
    from demo.tiny_vlm import build_tiny_vlm
    from demo.vision import make_rows, warm_start, write_jsonl, write_parquet

    data_dir = run_dir / "data"
    heldout = make_rows(demo["heldout"], seed=10_000 + demo["seed"])
    train = make_rows(demo["train_prompts"], seed=demo["seed"])
    heldout_path = write_jsonl(heldout, data_dir / "heldout.jsonl")
    prompts = write_parquet(train, data_dir / "train.parquet")
    base = build_tiny_vlm(run_dir / "models" / "base", seed=demo["seed"])
    print(f"[demo] warm start: {demo['warm_steps']} supervised steps on {len(train)} pictures", flush=True)
    warm = warm_start(base, run_dir / "models" / "warm", train, demo["warm_steps"], seed=demo["seed"], log_every=20)
    return warm, prompts, heldout_path, []


def subset_points(eval_dir: Path, labels: list[str]) -> list[tuple[int, float]]:
    """(version, fraction of the evaluation samples with these labels that passed) per round written to
    `eval_dir` (buffer/eval.py's `version_<v>.jsonl`); a sample passes when its reward is positive."""
    points = []
    for path in eval_dir.glob("version_*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        mine = [r for r in rows if r.get("label") in labels and "reward" in r]
        if mine:
            points.append((int(path.stem.split("_")[1]), sum(r["reward"] > 0 for r in mine) / len(mine)))
    return sorted(points)


def checkpoint_steps(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for p in (run_dir / "checkpoints").glob("step_*"):
        if (p / "config.json").exists():
            out.append((int(p.name.split("_")[1]), p))
    return sorted(out)


def plot(run_dir: Path, rows: list[dict], acc_points: list[tuple[int, float]], task: str = "arithmetic",
         held_points: list[tuple[int, float]] = ()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    key, label = TASKS[task].get("series", ("reward/mean", "reward (train batches)"))
    ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label, alpha=0.8)
    if acc_points:
        ax.plot([s for s, _ in acc_points], [a for _, a in acc_points], "o-", label=TASKS[task]["heldout_label"])
    if held_points:
        ax.plot([s for s, _ in held_points], [a for _, a in held_points], "s--", label="held-out secrets found, greedy")
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("reward / accuracy" if key == "reward/mean" else "reverse KL / accuracy")
    if key == "reward/mean":
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(TASKS[task]["title"])
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
    show_plan = "--plan" in argv
    demo, overrides = split_demo_args([a for a in argv if a != "--plan"])
    from common.config import ConfigError
    from launch.local import EXIT_CODES, device_plan, print_plan, read_metrics, run_local
    from launch.run_config import load_run_config

    task = TASKS[demo["task"]]
    t0 = time.monotonic()
    # the run config is checked (with placeholder paths) before anything slow happens
    try:
        probe = load_run_config(task["config"], [*overrides, "--learner.model_path", str(ROOT),
                                                 "--buffer.prompts", str(task["config"])])
        if show_plan:  # (the tiny model is not built yet: its size is left unchecked)
            return print_plan(probe, "launch.demo")
        device_plan(probe)  # a layout that cannot fit is refused before the warm start
    except ConfigError as e:
        print(f"launch.demo: {e}", file=sys.stderr)
        return EXIT_CODES["config"]
    run_dir = Path(demo["out"] or probe.run.run_dir)
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)

    from demo.tiny_model import build_tokenizer

    prepare = {"arithmetic": prepare_arithmetic, "calc": prepare_calc, "guess": prepare_guess,
               "distill": prepare_distill, "vision": prepare_vision}[demo["task"]]
    warm, prompts, heldout_path, held = prepare(demo, run_dir)
    warm_s = time.monotonic() - t0
    newline = build_tokenizer().convert_tokens_to_ids("\n")
    distill = demo["task"] == "distill"
    # evaluation during training: greedy answers to the held-out prompts (distill: of the checkpoints, after)
    evaluation = [] if distill else ["--eval.dataset", str(heldout_path), "--eval.every", str(demo["eval_every"]),
                                     "--eval.n_samples_per_prompt", "1", "--eval.temperature", "0"]
    moe = ["--learner.routing_replay", "rollout"] if demo["model"] != "llama" else []
    run = load_run_config(task["config"], [*(distill_overrides(demo) if distill else []), *moe, *overrides,
                                           "--learner.model_path", str(warm), "--buffer.prompts",
                                           str(prompts), "--run.run_dir", str(run_dir),
                                           "--generator.stop_token_ids", str(newline), *evaluation])
    what = "on-policy distillation" if distill else "async GRPO"
    print(f"[demo] {what} for {run.learner.total_steps} steps: logs in {run_dir / 'logs'}", flush=True)
    code = run_local(run)
    if code != 0:
        print(f"[demo] the run failed (exit code {code}); see {run_dir / 'logs'}", file=sys.stderr)
        return code

    rows = read_metrics(run_dir / "metrics.jsonl")
    acc_points = [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]
    if distill:
        acc_points = checkpoint_accuracy(run_dir, warm, heldout_path)
    for step, acc in acc_points:
        print(f"[demo] step {step}: {task['heldout_label']} {acc:.3f}", flush=True)
    rows = [r for r in rows if "loss/policy" in r]  # (the final evaluation has a row of its own)
    held_points = subset_points(Path(run.eval.samples_dir or run_dir / "eval"), held) if held else []
    plot(run_dir, rows, acc_points, demo["task"], held_points)
    wall_s = time.monotonic() - t0
    summary = {"task": demo["task"], "eval_set": task["eval_set"],
               **summarize(run_dir, rows, acc_points, wall_s, run.buffer.max_staleness),
               "warm_start_s": round(warm_s, 1), "run_s": round(wall_s - warm_s, 1)}
    if held:
        summary.update(heldout_labels=held, heldout_subset={str(v): a for v, a in held_points})
    if distill:
        kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
        tenth = max(1, len(kl) // 10)
        from demo.arithmetic import greedy_accuracy

        heldout = [json.loads(line) for line in heldout_path.read_text().splitlines() if line.strip()]
        summary.update(teacher_acc=greedy_accuracy(str(demo["teacher"]), heldout),
                       reverse_kl_first=sum(kl[:tenth]) / tenth, reverse_kl_last=sum(kl[-tenth:]) / tenth)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"[demo] done in {summary['wall_s']:.0f}s ({summary['run_s']:.0f}s after the warm start): reward "
          f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, {task['heldout_label']} "
          f"{summary['heldout_acc_start']:.3f} -> {summary['heldout_acc_end']:.3f}; plot: {run_dir / 'reward.png'}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
