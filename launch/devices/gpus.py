"""Finding the GPUs a run may use, as nodes of GPUs (no CUDA call), and `PlanError`, the refusal
every step of the plan raises.

    run.gpus (a list of device indices), else $CONVEYOR_FAKE_GPUS ("8", "2x8", "8:141": N GPUs
    of G GiB on each of K nodes, for planning on a machine without them), else nvidia-smi
    (no CUDA initialisation); none found: every role runs on the CPU, nothing is planned
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

FAKE_ENV = "CONVEYOR_FAKE_GPUS"
FAKE_GPU_GB = 80.0  # a fake GPU's memory unless "N:GiB" says otherwise


class PlanError(ValueError):
    """The layout cannot work (too few devices, or a device over its memory); the message has the
    numbers and the knob to turn."""


@dataclass(frozen=True)
class Gpu:
    index: str  # the id CUDA_VISIBLE_DEVICES takes on its node (nvidia-smi's index)
    memory_gb: float
    name: str = ""
    uuid: str = ""


@dataclass
class Node:
    name: str
    gpus: list[Gpu]


def parse_fake(spec: str) -> list[Node]:
    """$CONVEYOR_FAKE_GPUS: "8" (one node of 8), "2x8" (2 nodes of 8), "8:141" (141 GiB each)."""
    text, _, mem = spec.strip().partition(":")
    nodes, _, per = text.rpartition("x")
    try:
        n_nodes, n_gpus = int(nodes or 1), int(per)
        gb = float(mem) if mem else FAKE_GPU_GB
    except ValueError:
        raise PlanError(f"{FAKE_ENV}={spec!r}: expected N, KxN or N:GiB (e.g. 8, 2x8, 8:141)") from None
    if n_nodes < 1 or n_gpus < 0 or gb <= 0:
        raise PlanError(f"{FAKE_ENV}={spec!r}: counts must be positive")
    return [Node(f"node{k}", [Gpu(str(i), gb, "fake") for i in range(n_gpus)]) for k in range(n_nodes)]


def nvidia_smi() -> list[Gpu]:
    """This machine's GPUs as nvidia-smi lists them (NVML: no CUDA context is made), or []."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,name",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            gpus.append(Gpu(parts[0], float(parts[2]) / 1024, parts[3], parts[1]))
    return gpus


def cpu_torch() -> bool:
    """Whether the installed torch is a CPU build (`make install STACK=cpu` on a GPU machine): then
    no role can use the GPUs nvidia-smi lists. Read from the package's version, without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def local_gpus(gpus: str = "auto", memory_gb: float = 0.0, environ=None) -> list[Node]:
    """This machine's GPUs for a run (`run.gpus`: `auto`, `none` or a list such as "0,1,2,3"), as
    one node; `memory_gb` overrides what each reports (0: as found).

    Only the GPUs the launcher itself may use: with CUDA_VISIBLE_DEVICES set (a scheduler's share
    of the machine, indices or UUIDs), those, in that order. Each keeps nvidia-smi's index, which
    is what the roles' own CUDA_VISIBLE_DEVICES name (with CUDA_DEVICE_ORDER=PCI_BUS_ID, so that
    CUDA counts as nvidia-smi does)."""
    environ = os.environ if environ is None else environ
    fake = environ.get(FAKE_ENV, "").strip()
    if gpus.strip() == "none":
        return [Node("local", [])]
    if fake:
        found = parse_fake(fake)[0].gpus
    elif cpu_torch():
        return [Node("local", [])]
    else:
        found = nvidia_smi()
    outer = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if "CUDA_VISIBLE_DEVICES" in environ:
        by_id = {**{g.index: g for g in found}, **{g.uuid: g for g in found if g.uuid}}
        found = [by_id[x] for x in outer if x in by_id]  # ("" or "-1": none at all)
    by_index = {g.index: g for g in found}
    if gpus.strip() not in ("", "auto"):
        wanted = [x.strip() for x in gpus.split(",") if x.strip()]
        unknown = [i for i in wanted if i not in by_index]
        if unknown and found:
            raise PlanError(f"run.gpus={gpus!r}: no GPU {', '.join(unknown)} here (this launcher may use "
                            f"{', '.join(by_index) or 'none'})")
        chosen = [by_index.get(i, Gpu(i, memory_gb or 0.0)) for i in wanted]
    else:
        chosen = found
    if memory_gb:
        chosen = [Gpu(g.index, memory_gb, g.name, g.uuid) for g in chosen]
    return [Node("local", chosen)]
