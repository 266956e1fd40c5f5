"""bench/gpu_check.sh --cpu-smoke: the GPU check's own entry points, small, on the CPU (~3 min on two
cores), so that the script a GPU machine runs is known to work up to the GPU itself."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT, subprocess_env

# every step of the script, in its order; the GPU-only ones are skipped here
STEPS = ["nvidia-smi", "make install (dry run)", "CUDA check (scripts/check_cuda.py)", "build model", "device plan",
         "generation vLLM vs transformers", "learner step", "CUDA IPC slot", "weight rounds (no vLLM on CPU)",
         "killed member (gloo)", "absent peer (gloo)", "killed member (nccl)", "vLLM V2 model runner",
         "vLLM V1 model runner", "sequence parallel (gloo)", "sequence parallel (nccl)",
         "MoE end to end (routing replay, rounds)", "vision-language engine (expansion, greedy, log-probs)",
         "vision-language end to end", "demo (2 steps, async)"]
GPU_ONLY = {"nvidia-smi", "CUDA check (scripts/check_cuda.py)", "killed member (nccl)", "vLLM V2 model runner",
            "vLLM V1 model runner", "sequence parallel (nccl)", "MoE end to end (routing replay, rounds)",
            "vision-language engine (expansion, greedy, log-probs)", "vision-language end to end"}


@pytest.mark.slow
def test_gpu_check_cpu_smoke_passes_every_step(tmp_path):
    log = tmp_path / "gpu_check.log"
    env = dict(subprocess_env(), PY=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu-smoke", str(log)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    text = log.read_text() if log.exists() else ""
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr[-2000:]}\nlog tail:\n{text[-6000:]}"
    summary = out.stdout.split("=== summary", 1)[1].strip().splitlines()
    rows = {}
    for line in summary[:-1]:
        verdict, rest = line.split(None, 1)
        rows[re.split(r": | \(\d+s", rest, maxsplit=1)[0]] = (verdict, rest)
    assert list(rows) == STEPS, summary
    for name, (verdict, rest) in rows.items():
        if name in GPU_ONLY:
            assert verdict == "SKIP" and rest.endswith("skipped: no GPU"), rest
        else:
            assert verdict == "PASS", rest
    assert summary[-1] == f"{len(STEPS) - len(GPU_ONLY)} passed, 0 failed, {len(GPU_ONLY)} skipped"
    assert summary == text.split("=== summary", 1)[1].strip().splitlines()  # the log ends the same way
