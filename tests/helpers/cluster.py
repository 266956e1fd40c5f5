"""Runs of the Ray launcher and of OpenRLHF's command line, driven and watched from a test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.procs import ROOT, subprocess_env

QUICK_START = """--ref_num_nodes 1 --ref_num_gpus_per_node 1 --reward_num_nodes 1 --reward_num_gpus_per_node 1
 --critic_num_nodes 1 --critic_num_gpus_per_node 1 --actor_num_nodes 1 --actor_num_gpus_per_node 1
 --vllm_num_engines 1 --vllm_tensor_parallel_size 1 --pretrain meta-llama/Llama-3.1-8B
 --reward_pretrain meta-llama/Llama-3.1-8B-RM --save_path ./checkpoint --micro_train_batch_size 8
 --train_batch_size 128 --micro_rollout_batch_size 32 --rollout_batch_size 1024 --max_epochs 1
 --prompt_max_len 1024 --generate_max_len 1024 --learning_rate 5e-7 --init_kl_coef 0.01""".split()
SHRINK = ["--rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "4",
          "--micro_rollout_batch_size", "4", "--prompt_max_len", "64", "--generate_max_len", "16"]


def run_quick_start(files, save_path: Path, *more: str) -> list[str]:
    """The toolkit page's PPO quick start with its models and data pointed here and its sizes shrunk:
    8 prompts a step, 16 prompts in all, one episode."""
    swap = {"meta-llama/Llama-3.1-8B": files["model"], "meta-llama/Llama-3.1-8B-RM": files["rm"],
            "./checkpoint": str(save_path)}
    return [swap.get(a, a) for a in QUICK_START] + ["--prompt_data", files["prompts"], *SHRINK, *more]


def stop_driver(driver: subprocess.Popen) -> None:
    """A driver still running when its test ends (it failed early) is stopped: SIGTERM, and the
    launcher stops every role it started."""
    if driver.poll() is None:
        driver.terminate()
        driver.wait(timeout=120)


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def run_status(run_dir: Path) -> dict:
    """The driver's `<run_dir>/status.json` ({} before it wrote one): each role's state, pid, restarts,
    starts and ready record."""
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def metrics(run_dir: Path) -> list[dict]:
    from launch.local import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")


def run_local_config(config: Path, run_dir: Path, model, prompts, *extra: str,
                     timeout: float = 900) -> tuple[int, str, list[dict]]:
    """`launch.local CONFIG` on `model` and `prompts` into `run_dir`: (exit code, the output's tail, the
    metrics rows)."""
    argv = [sys.executable, "-m", "launch.local", str(config), "--run.run_dir", str(run_dir),
            "--learner.model_path", str(model), "--buffer.prompts", str(prompts), *extra]
    proc = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:], rows
