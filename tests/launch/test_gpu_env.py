"""The GPU path's environment, checked on the CPU: no role asks torch whether CUDA is there before
vLLM can fork its engine core, and the install's CUDA check (scripts/check_cuda.py) judges a
machine's versions as its docstring says."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.helpers.procs import ROOT, subprocess_env

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _check_cuda():
    spec = importlib.util.spec_from_file_location("check_cuda", ROOT / "scripts" / "check_cuda.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_cuda"] = mod  # (dataclasses look their module up by name)
    spec.loader.exec_module(mod)
    return mod


cc = _check_cuda()


def _run(code: str, env: dict | None = None, timeout: int = 120) -> dict:
    env = env if env is not None else subprocess_env()
    env.pop(NVML_CHECK, None)  # as a process started by hand, outside any launcher
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_kwargs_do_not_ask_torch_cuda_before_vllm():
    """Every torch.cuda.is_available() on the way to the engine's arguments runs with the NVML-based
    check on (vLLM's import sets it): a call without it initialises the CUDA driver in a process
    from which vLLM then forks its engine core (it forks unless torch.cuda.is_initialized())."""
    got = _run(f"""
import json, os, torch
calls = []
real = torch.cuda.is_available
def spy():
    calls.append(os.environ.get("{NVML_CHECK}"))
    return real()
torch.cuda.is_available = spy
from actors.engines.vllm.engine import _vllm_kwargs
kw = _vllm_kwargs("m", "", "float32", 0, 1, 0.0, 0, "")
from vllm.platforms import current_platform
print(json.dumps({{"calls": calls, "gmu": kw["gpu_memory_utilization"], "cuda": current_platform.is_cuda_alike()}}))
""")
    assert all(c == "1" for c in got["calls"]), got
    # the default share: 90% of a GPU, or 5% of host memory for the CPU build's KV cache
    assert got["gmu"] == (0.9 if got["cuda"] else 0.05)


def test_role_config_turns_on_the_nvml_cuda_check_before_heavy_imports():
    got = _run(f"""
import json, os, sys
from launch.entry import role_config
from weight_sync.config import WeightSyncConfig
role_config(WeightSyncConfig, "weight_sync", [])
print(json.dumps({{"env": os.environ.get("{NVML_CHECK}"), "torch": "torch" in sys.modules}}))
""")
    assert got == {"env": "1", "torch": False}
    # a value the user set stays
    env = subprocess_env()
    got = _run(f"""
import json, os
os.environ["{NVML_CHECK}"] = "0"
from launch.entry import role_config
from weight_sync.config import WeightSyncConfig
role_config(WeightSyncConfig, "weight_sync", [])
print(json.dumps({{"env": os.environ.get("{NVML_CHECK}")}}))
""", env)
    assert got == {"env": "0"}


# ---------------------------------------------------------------------------------------------
# scripts/check_cuda.py: the verdict on a machine's versions


def _facts(**kw):
    """A working H200 machine on the default stack; tests change one thing at a time."""
    base = dict(torch_version="2.14.0+cu130", torch_cuda="13.0", cuda_available=True,
                driver_version="580.95.05", driver_cuda="13.0", gpus=[("NVIDIA H200", (9, 0))],
                vllm_cuda="13", c_compiler="/usr/bin/gcc", python_headers="/usr/include/python3.11",
                python_include="/usr/include/python3.11")
    base.update(kw)
    return cc.Facts(**base)


def test_check_cuda_passes_a_working_stack():
    v = cc.verdict(_facts())
    assert v.ok and not v.problems and not v.advice


def test_check_cuda_old_driver_says_upgrade_or_cuda12():
    # torch cu130 on an R550 driver: is_available() is False, the driver is the reason given
    v = cc.verdict(_facts(driver_version="550.54.15", driver_cuda="12.4", cuda_available=False, gpus=[]))
    assert not v.ok
    assert any("CUDA 13.0" in p and "R580" in p for p in v.problems), v.problems
    assert not any("is_available() is False" in p for p in v.problems), v.problems
    assert any("R580" in a for a in v.advice) and any("TORCH_CUDA=cu128" in a and "VLLM_WHEEL" in a for a in v.advice)
    # the driver's branch alone decides when its CUDA version is unknown (R575 < R580)
    v = cc.verdict(_facts(driver_version="575.57.08", driver_cuda=None, cuda_available=False, gpus=[]))
    assert not v.ok and any("R580" in p for p in v.problems)


def test_check_cuda_cuda12_torch_needs_a_cuda12_vllm():
    cu128 = dict(torch_version="2.14.0+cu128", torch_cuda="12.8", driver_version="550.54.15", driver_cuda="12.4")
    v = cc.verdict(_facts(**cu128))  # vLLM from PyPI still links CUDA 13's runtime
    assert not v.ok
    assert any("vLLM's kernels are built for CUDA 13" in p for p in v.problems), v.problems
    assert any("share a CUDA major" in p for p in v.problems)
    assert cc.verdict(_facts(**cu128, vllm_cuda="12")).ok  # with VLLM_WHEEL built for CUDA 12


def test_check_cuda_rejects_pre_turing_gpus():
    v = cc.verdict(_facts(gpus=[("NVIDIA H200", (9, 0)), ("Tesla V100-SXM2-16GB", (7, 0))]))
    assert not v.ok
    assert [p for p in v.problems if "compute capability" in p] == [
        "Tesla V100-SXM2-16GB has compute capability 7.0: CUDA 13 and vLLM 0.33's kernels need 7.5 (Turing) or newer"]
    assert cc.verdict(_facts(gpus=[("Tesla T4", (7, 5))])).ok


def test_check_cuda_triton_prerequisites():
    v = cc.verdict(_facts(c_compiler=None, python_headers=None))
    assert not v.ok and len(v.problems) == 2
    assert any("apt-get install gcc" in a for a in v.advice)
    assert any(re.search(r"apt-get install python3\.\d+-dev", a) for a in v.advice)


def test_check_cuda_cpu_torch_and_no_driver():
    v = cc.verdict(_facts(torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False, driver_version=None,
                          driver_cuda=None, gpus=[], vllm_cuda=None))
    assert not v.ok
    assert any("not a CUDA build" in p for p in v.problems) and any("no NVIDIA driver" in p for p in v.problems)
    # a driver that answers but torch that cannot see the GPUs (an empty CUDA_VISIBLE_DEVICES)
    v = cc.verdict(_facts(cuda_available=False, gpus=[]))
    assert not v.ok and any("CUDA_VISIBLE_DEVICES" in a for a in v.advice)


@pytest.mark.parametrize("driver_version,driver_cuda,cuda,runs", [
    (None, "12.9", "12.8", True),  # minor version compatibility: any 12.x on a 12.x driver
    (None, "12.4", "13.0", False),
    ("580.65.06", None, "13.0", True),
    ("570.86.10", None, "13.0", False),
    ("525.60.13", None, "12.8", True),
    (None, None, "13.0", None),  # unknown driver: no verdict from it
])
def test_check_cuda_driver_runs(driver_version, driver_cuda, cuda, runs):
    assert cc.driver_runs(cc.Facts(driver_version=driver_version, driver_cuda=driver_cuda), cuda) is runs


def test_check_cuda_help_answers():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_cuda.py"), "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "TORCH_CUDA" not in out.stderr and "driver" in out.stdout


def test_gpu_requirements_pin_the_cpu_stacks_transformers():
    """Both stacks run the transformers range the project is tested with (vllm 0.33.0 accepts
    >=5.16.1,<5.21.0), and the Makefile's TORCH_CUDA knob finds torch's pin in gpu.txt."""
    def pins(name: str) -> dict[str, str]:
        lines = (ROOT / "requirements" / name).read_text().splitlines()
        return dict(re.match(r"([A-Za-z0-9_.\-\[\]]+)\s*(\S*)", ln).groups() for ln in lines
                    if ln.strip() and not ln.startswith("#"))

    gpu, cpu = pins("gpu.txt"), pins("cpu.txt")
    assert gpu["transformers"] == cpu["transformers"]
    assert re.fullmatch(r"==\d+\.\d+\.\d+", gpu["torch"]) and re.fullmatch(r"==\d+\.\d+\.\d+", gpu["torchvision"])
