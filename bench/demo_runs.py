"""What the benchmarks that compare two runs of the demo share: their command line and one run."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(doc: str, steps: int, out: str, example: str) -> argparse.Namespace:
    """`--steps`, `--warm-steps`, `--out` and run-config overrides for both runs."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=steps, help="learner steps per run")
    p.add_argument("--warm-steps", type=int, default=375, help="supervised warm-start steps")
    p.add_argument("--out", default=out, help="folder for both runs")
    p.add_argument("overrides", nargs="*", help=f"run-config overrides for both runs, e.g. {example}")
    return p.parse_args()


def run_demo(name: str, run_dir: Path, flags: list[str]):
    """examples/demo.yaml with `flags`, run to the end in a fresh `run_dir` (a buffer would resume
    old state); (its config, its metrics rows). Exits naming the logs when the run fails."""
    from launch.local import read_metrics, run_local
    from launch.run_config import load_run_config

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_run_config(ROOT / "examples" / "demo.yaml", ["--run.run_dir", str(run_dir), *flags])
    print(f"[bench] {name}: {cfg.learner.total_steps} steps, logs in {run_dir / 'logs'}", file=sys.stderr, flush=True)
    code = run_local(cfg, quiet=True)
    if code != 0:
        raise SystemExit(f"[bench] the {name} run failed with exit code {code}; see {run_dir / 'logs'}")
    return cfg, read_metrics(run_dir / "metrics.jsonl")
