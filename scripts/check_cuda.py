"""Does this machine's GPU stack work? Run by `make install` after the CUDA install; exits 1 when not.

    .venv/bin/python scripts/check_cuda.py          # what it found, and a verdict with what to do
    .venv/bin/python scripts/check_cuda.py --json   # the same facts as one JSON object

A CUDA torch on a driver too old for it imports fine and reports no GPU: the learner would then
train on the CPU while vLLM fails. This script asks instead: torch sees a GPU; the driver is new
enough for the CUDA that torch and vLLM's kernels were built for; every GPU is one they were built
for; Triton (vLLM's V2 model runner, its kernels) finds a C compiler and Python's headers.

The facts are gathered by `gather()` (it needs the GPU) and judged by `verdict()`, a pure function
(tests/launch/test_gpu_env.py checks it on the CPU).

Where the numbers come from:
- torch 2.14.0 on PyPI is built for CUDA 13.0 (torch/version.py of the wheel: `cuda = '13.0'`),
  and vllm 0.33.0 requires exactly that torch (its METADATA: `Requires-Dist: torch==2.14.0`).
  vLLM's own kernels link `libcudart.so.13` (readelf -d vllm/_C_stable_libtorch.abi3.so of the
  0.33.0 wheel), so vLLM from PyPI needs CUDA 13 whatever torch is installed beside it.
- The oldest driver for a CUDA major version (NVIDIA's CUDA release notes, minor version
  compatibility): 13.x needs R580, 12.x R525, 11.x R450.
- CUDA 13 builds no code for GPUs before Turing (compute capability 7.5); the oldest architecture
  in vLLM 0.33.0's kernels is sm_75 too (the `sm_*` targets in vllm/_C_stable_libtorch.abi3.so).
- Triton compiles its C launcher with $CC, else `gcc`, else `clang`, against the headers in
  `sysconfig.get_paths()["include"]` (triton/runtime/build.py, `_build`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

# oldest driver branch for each CUDA major version (minor version compatibility)
MIN_DRIVER = {11: 450, 12: 525, 13: 580}
# the oldest GPU this stack runs on: CUDA 13 and vLLM 0.33's kernels both start at sm_75
MIN_CAPABILITY = (7, 5)
# `make install TORCH_CUDA=...`: PyTorch's own index per CUDA build (the default PyPI torch is cu130)
CUDA12_KNOB = "make install TORCH_CUDA=cu128"


@dataclass
class Facts:
    """What `gather()` found. Versions as strings ("13.0", "575.57.08"); None where unknown."""

    torch_version: str = ""
    torch_cuda: str | None = None  # torch.version.cuda: None for a CPU build
    cuda_available: bool = False  # torch.cuda.is_available()
    driver_version: str | None = None  # "575.57.08" (nvidia-smi / NVML)
    driver_cuda: str | None = None  # the newest CUDA the driver runs ("12.9", nvidia-smi's header)
    gpus: list[tuple[str, tuple[int, int]]] = field(default_factory=list)  # (name, compute capability)
    vllm_cuda: str | None = None  # the libcudart major vLLM's kernels link ("13"), None: not found
    c_compiler: str | None = None  # what Triton would use
    python_headers: str | None = None  # the folder holding Python.h, None: missing
    python_include: str = ""  # where Python.h should be
    error: str = ""  # why gathering stopped early (an exception while asking torch)


@dataclass
class Verdict:
    ok: bool
    problems: list[str]
    advice: list[str]
    notes: list[str]


def _major(v: str | None) -> int | None:
    m = re.match(r"\s*(\d+)", v or "")
    return int(m.group(1)) if m else None


def _cuda_tuple(v: str | None) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", v or "")
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def driver_runs(f: Facts, cuda: str) -> bool | None:
    """Whether the driver runs code built for CUDA `cuda`; None when the driver is unknown.

    The driver's own "CUDA Version" wins when known; else its branch against MIN_DRIVER (any 12.x
    runs on a driver of the 12 family: minor version compatibility)."""
    want = _cuda_tuple(cuda)
    if want is None:
        return None
    have = _cuda_tuple(f.driver_cuda)
    if have is not None:
        return have[0] >= want[0]
    branch = _major(f.driver_version)
    if branch is None or want[0] not in MIN_DRIVER:
        return None
    return branch >= MIN_DRIVER[want[0]]


def verdict(f: Facts) -> Verdict:
    """Judge the facts: `ok` only when the learner and vLLM can both run on these GPUs.

    Pure: everything it knows is in `f`."""
    problems: list[str] = []
    advice: list[str] = []
    notes: list[str] = []
    if f.error:
        problems.append(f"asking torch about CUDA failed: {f.error}")
    if f.torch_cuda is None:
        problems.append(f"torch {f.torch_version or '(not importable)'} is not a CUDA build")
        advice.append("on a GPU machine `make install` installs requirements/gpu.txt; start again with "
                      "`make clean && make install` (or `make install STACK=cpu` to train on the CPU knowingly)")
    if f.driver_version is None and f.driver_cuda is None:
        problems.append("no NVIDIA driver answered (nvidia-smi / NVML)")
        advice.append("install the NVIDIA driver (R580 or newer for the default CUDA 13 stack) and check "
                      "that `nvidia-smi` lists the GPUs")
    need = [("torch", f.torch_cuda)] if f.torch_cuda else []
    if f.vllm_cuda:
        need.append(("vLLM's kernels", f.vllm_cuda))
    old_driver = False
    for who, cuda in need:
        if driver_runs(f, cuda) is False:
            old_driver = True
            branch = MIN_DRIVER.get(_major(cuda) or 0)
            problems.append(f"{who} {'are' if who.endswith('s') else 'is'} built for CUDA {cuda}, but driver "
                            f"{f.driver_version or '?'} runs CUDA up to {f.driver_cuda or '?'}"
                            + (f" (CUDA {_major(cuda)} needs driver R{branch} or newer)" if branch else ""))
    if old_driver:
        advice.append(f"upgrade the NVIDIA driver to R{MIN_DRIVER[13]} or newer, then run `make install` again "
                      "(nothing else to change)")
        advice.append(f"or keep the driver and install torch built for CUDA 12: `{CUDA12_KNOB}` (or cu126, "
                      "whichever PyTorch's index has for this torch); vLLM 0.33.0 from PyPI is built for CUDA 13 "
                      "only, so give a vLLM 0.33.0 wheel built for CUDA 12 as well: `VLLM_WHEEL=/path/to/vllm-"
                      "0.33.0+cu12x-....whl` (vLLM's own CUDA 12 build where one is published, or one built "
                      "from source against a CUDA 12 toolkit)")
    if f.torch_cuda and f.vllm_cuda and _major(f.torch_cuda) != _major(f.vllm_cuda):
        problems.append(f"torch is built for CUDA {f.torch_cuda} but vLLM's kernels for CUDA {f.vllm_cuda}: "
                        "they must share a CUDA major version")
        advice.append("install a vLLM built for the same CUDA as torch (`VLLM_WHEEL=...` with `TORCH_CUDA=...`), "
                      "or neither knob: the defaults are both CUDA 13")
    if f.torch_cuda and not f.cuda_available and not old_driver and not f.error:
        problems.append("torch.cuda.is_available() is False")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        advice.append("check CUDA_VISIBLE_DEVICES (now " + (repr(visible) if visible is not None else "unset")
                      + "), that /dev/nvidia* exist in this container, and `nvidia-smi`")
    if f.cuda_available and not f.gpus:
        problems.append("torch reports CUDA but no GPU")
    for name, cap in f.gpus:
        if tuple(cap) < MIN_CAPABILITY:
            problems.append(f"{name} has compute capability {cap[0]}.{cap[1]}: CUDA 13 and vLLM 0.33's kernels "
                            f"need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Turing) or newer")
            advice.append("use a Turing or newer GPU (T4, A10/A100, L4/L40, H100/H200, ...): this stack has no "
                          "kernels for this one")
    if not f.c_compiler:
        problems.append("no C compiler: Triton (vLLM's V2 model runner and kernels) compiles C stubs with $CC, "
                        "`gcc` or `clang`")
        advice.append("install one: `apt-get install gcc` (Debian/Ubuntu), `dnf install gcc`, or set CC")
    if not f.python_headers:
        problems.append(f"no Python.h under {f.python_include or '(sysconfig has no include path)'}: Triton "
                        "compiles against Python's headers")
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        advice.append(f"install them: `apt-get install python{ver}-dev` (Debian/Ubuntu) or "
                      f"`dnf install python{ver.replace('.', '')}-devel`")
    if f.driver_cuda and f.torch_cuda and not old_driver:
        notes.append(f"driver {f.driver_version} runs CUDA up to {f.driver_cuda}; torch {f.torch_version} "
                     f"is built for CUDA {f.torch_cuda}")
    return Verdict(ok=not problems, problems=problems, advice=advice, notes=notes)


# ---------------------------------------------------------------------------------------------
# gathering the facts (needs the GPU stack)


def _nvidia_smi() -> tuple[str | None, str | None]:
    """(driver version, the newest CUDA the driver runs) from nvidia-smi; None where it did not say."""
    if not shutil.which("nvidia-smi"):
        return None, None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    drv = re.search(r"Driver Version:\s*([\d.]+)", out)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (drv.group(1) if drv else None), (cuda.group(1) if cuda else None)


def _nvml_driver() -> tuple[str | None, str | None]:
    """The same through NVML (pynvml, from nvidia-ml-py, where installed)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            drv = pynvml.nvmlSystemGetDriverVersion()
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # 12090 for 12.9
            drv = drv.decode() if isinstance(drv, bytes) else drv
            return drv, f"{cuda // 1000}.{cuda % 1000 // 10}"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver, an old NVML without the call
        return None, None


def vllm_cudart_major() -> str | None:
    """The libcudart major version vLLM's compiled kernels link ("13"), read from the library file
    without importing vLLM (an import fails on exactly the mismatch this looks for)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = Path(list(spec.submodule_search_locations)[0])
    for name in ("_C_stable_libtorch.abi3.so", "_C.abi3.so", "_moe_C_stable_libtorch.abi3.so"):
        lib = pkg / name
        if lib.is_file():
            m = re.search(rb"libcudart\.so\.(\d+)", lib.read_bytes())
            if m:
                return m.group(1).decode()
    return None


def c_compiler() -> str | None:
    """What Triton compiles with: $CC, else gcc, else clang (triton/runtime/build.py)."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0]) or None
    return shutil.which("gcc") or shutil.which("clang")


def python_include() -> str:
    """Python's header folder as Triton finds it (Debian's posix_local scheme read as posix_prefix)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return sysconfig.get_paths(scheme=scheme).get("include", "")


def gather() -> Facts:
    f = Facts(c_compiler=c_compiler(), python_include=python_include())
    f.python_headers = f.python_include if f.python_include and Path(f.python_include, "Python.h").is_file() else None
    f.driver_version, f.driver_cuda = _nvidia_smi()
    if f.driver_version is None:
        f.driver_version, f.driver_cuda = _nvml_driver()
    f.vllm_cuda = vllm_cudart_major()
    try:
        import torch

        f.torch_version = torch.__version__
        f.torch_cuda = torch.version.cuda
        f.cuda_available = torch.cuda.is_available()
        if f.cuda_available:
            f.gpus = [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                      for i in range(torch.cuda.device_count())]
    except Exception as e:  # an import that fails on a missing CUDA library says so here
        f.error = f"{type(e).__name__}: {e}"
    return f


def report(f: Facts, v: Verdict) -> str:
    lines = [
        f"torch {f.torch_version or '?'} built for CUDA {f.torch_cuda or '(none: CPU build)'}; "
        f"torch.cuda.is_available() = {f.cuda_available}",
        f"NVIDIA driver {f.driver_version or '(none found)'}, runs CUDA up to {f.driver_cuda or '?'}",
        f"vLLM's kernels link CUDA {f.vllm_cuda or '(vLLM not found or not a CUDA build)'}",
    ]
    lines += [f"GPU {i}: {name}, compute capability {cap[0]}.{cap[1]}" for i, (name, cap) in enumerate(f.gpus)]
    lines.append(f"C compiler for Triton: {f.c_compiler or '(none)'}; Python.h in {f.python_headers or '(missing)'}")
    lines += [f"note: {n}" for n in v.notes]
    if v.ok:
        lines.append("OK: the CUDA stack works here")
    else:
        lines.append("FAILED: this GPU stack will not run here:")
        lines += [f"  - {p}" for p in v.problems]
        lines.append("what to do:")
        lines += [f"  - {a}" for a in dict.fromkeys(v.advice)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the facts and the verdict as one JSON object")
    a = p.parse_args(argv)
    f = gather()
    v = verdict(f)
    if a.json:
        print(json.dumps({"facts": asdict(f), "verdict": asdict(v)}))
    else:
        print(report(f, v), file=sys.stdout if v.ok else sys.stderr)
    return 0 if v.ok else 1


if __name__ == "__main__":
    sys.exit(main())
