"""The roles of a run, declared once: what each process is, how it starts, when it counts as ready.

`plan(run, launcher, restart)` lists the processes of a run in start order (buffer, weight-sync
service, scorers, generators, learner) as `RoleSpec`s; `launch.local` and `launch.ray` both start
exactly these, each through one `launch.process.Process`. What differs between them is said here:

- `launch.local` runs the learner's ranks as one `torchrun` process named `learner` and pins
  generators and learner to `run.generator_cpus` / `run.learner_cpus`;
- `launch.ray` runs one process per rank (`learner-0`, `learner-1`, ...: its actors set the
  rendezvous) and reads its per-role config `<run_dir>/configs/<role>.yaml` (`{config}` in argv).

Readiness is explicit: a role writes its ready file (common/ready.py) once it serves; the launcher
waits for it before the next role where the next one needs it (`Readiness.wait`: the buffer, the
weight-sync service, learner rank 0) and reports it for the others. A role's life is a `State`:

    NEW --start--> RUNNING --exit 0 (a role that finishes)--> DONE
                      |------exit, restarts left--> RESTARTING --restart_delay_s--> RUNNING
                      |------exit, required or no restarts left--> FAILED
                      '------scaled down--> STOPPING --exit--> STOPPED

Each launcher writes where its roles stand to `<run_dir>/status.json` (`write_status`) as it goes.
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.curve import KEYS_ENV, NAME_ENV, make_keys
from launch.process import PYTHON
from launch.run_config import secret_env

CONFIG = "{config}"  # in a role's argv: the path of the resolved config it reads
ROOT = Path(__file__).resolve().parents[1]
STATUS_NAME = "status.json"


class State(str, enum.Enum):
    """Where one role process stands (the diagram in the module docstring)."""

    NEW = "new"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 0
    """Times the role is started again after it exited with an error (over the run)."""
    delay_s: float = 0.0
    """Pause before each such restart (a dead generator's leases expire meanwhile)."""


@dataclass(frozen=True)
class Readiness:
    """How a launcher knows a role serves: "file" (it wrote $CONVEYOR_READY_FILE), "port" (`port`
    on its host accepts a connection), "none" (it never says: a learner rank past 0)."""

    probe: str = "file"
    wait: bool = False
    """Start the next role only once this one is ready (within `timeout_s`)."""
    timeout_s: float = 600.0
    port: int = 0


@dataclass
class RoleSpec:
    """One process of a run."""

    name: str  # buffer, weight_sync, scorer-0, generator-1, learner (local) or learner-0 (Ray); its log's name
    kind: str  # buffer | weight_sync | scorer | generator | learner: the exit code's key (launch.recovery)
    argv: list[str]  # with {python} and {config} for the launcher to fill in
    env: dict[str, str] = field(default_factory=dict)
    required: bool = True
    """Its failure stops the run (the learner and the services); generators and scorers are healed."""
    finishes: bool = True
    """Exit code 0 means its work is done (the learner at total_steps, a generator told the buffer is
    done); a service's (buffer, weight sync) every exit is a failure."""
    restart: RestartPolicy = RestartPolicy()
    ready: Readiness = Readiness()
    cpus: str = ""  # taskset CPU list (launch.local only)

    @property
    def log_name(self) -> str:
        return f"{self.name}.log"

    def command(self, config: str) -> list[str]:
        """argv with the config path filled in (and pinned to `cpus` when set); {python} stays for
        the process wrapper of the node it runs on."""
        argv = [config if a == CONFIG else a for a in self.argv]
        return ["taskset", "-c", self.cpus, *argv] if self.cpus else argv


def after_exit(spec: RoleSpec, restarts: int, code: int | None, lost: bool = False) -> State:
    """What a role's exit (`code`; `lost`: its Ray actor went away) means, before any stop was asked."""
    if code == 0 and not lost and spec.finishes:
        return State.DONE
    if spec.required:
        return State.FAILED
    if restarts < spec.restart.max_restarts:
        return State.RESTARTING
    return State.FAILED


def gone_for_good(states: list[State]) -> bool:
    """Every generator (or every scorer) failed with no restarts left, or was stopped: the run has none."""
    return bool(states) and all(s in (State.FAILED, State.STOPPED) for s in states)


def role_env(threads: int, keys: str = "", key_name: str = "") -> dict[str, str]:
    """The environment every role process gets on top of its launcher's; with `keys` (the run's
    CurveZMQ key folder), also that folder and the process's identity `key_name`."""
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false",
           # torch.cuda.is_available() then asks NVML instead of initialising CUDA: a process that
           # asked it before importing vLLM would otherwise fork vLLM's engine core with a CUDA
           # that cannot start (vLLM picks fork unless torch.cuda.is_initialized(); it sets this
           # variable itself, but only once imported: vllm/env_override.py)
           "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if keys:
        env.update({KEYS_ENV: keys, **({NAME_ENV: key_name} if key_name else {})})
    return env


def keys_dir(run) -> str:
    """The run's CurveZMQ key folder when its sockets speak CURVE (see run.curve), else ""."""
    return str(Path(run.run.run_dir).resolve() / "keys") if run.buffer.curve == "on" else ""


def prepare_keys(run) -> str:
    """Make the run's keys (kept if they exist: a resumed run keeps them); the folder or ""."""
    folder = keys_dir(run)
    if folder:
        make_keys(folder)
        os.environ[KEYS_ENV] = folder  # (the launcher asks the buffer too, as `admin`)
    return folder


def generator_spec(run, i: int, launcher: str, restart: RestartPolicy) -> RoleSpec:
    """Generator `i` (also a generator added by `launch.ray scale`)."""
    r = run.run
    return RoleSpec(f"generator-{i}", "generator",
                    [PYTHON, "-m", "launch.generator", CONFIG, "--generator.worker_id", f"gen-{i}",
                     "--generator.seed", str(run.generator.seed + i)],
                    role_env(r.threads_per_role, keys_dir(run), f"gen-{i}"), required=False, restart=restart,
                    ready=Readiness(timeout_s=r.ready_timeout_s),
                    cpus=r.generator_cpus if launcher == "local" else "")


def plan(run, launcher: str, restart: RestartPolicy, devices=None) -> list[RoleSpec]:
    """The processes of `run` in start order, for `launcher` "local" or "ray"; `restart` is the
    generators' and scorers' policy (run.max_restarts or ray.max_restarts); `devices` the run's
    device plan (launch/devices/): each process's GPUs and memory share, and a role that
    shares a device with the next is waited for before the next starts."""
    specs = _plan(run, launcher, restart)
    if devices is not None:
        for spec in specs:
            place(spec, devices, run.weight_sync.timeout_s)
    return specs


def place(spec: RoleSpec, devices, round_timeout_s: float = 120.0) -> RoleSpec:
    """`spec` with its devices from the plan: CUDA_VISIBLE_DEVICES (and a memory share) in its
    environment, an engine's gpu_memory_utilization on its command line; on GPUs, the learner and
    the generators (the processes that join weight-sync NCCL groups) also get what those groups
    need from the process's start (weight_sync.groups.nccl_env)."""
    spec.env = {**spec.env, **devices.env(spec.name)}
    if devices.layout != "cpu" and spec.kind in ("learner", "generator"):
        from weight_sync.groups import nccl_env

        spec.env.update(nccl_env(round_timeout_s))
    spec.argv = [*spec.argv, *devices.overrides(spec.name)]
    if spec.name in devices.waited():
        spec.ready = Readiness(spec.ready.probe, True, spec.ready.timeout_s, spec.ready.port)
    return spec


def _plan(run, launcher: str, restart: RestartPolicy) -> list[RoleSpec]:
    r = run.run
    keys = keys_dir(run)
    env = role_env(r.threads_per_role, keys)
    waited = Readiness(wait=True, timeout_s=r.ready_timeout_s)
    specs = [RoleSpec(kind, kind, [PYTHON, "-m", f"launch.{kind}", CONFIG], env, finishes=False, ready=waited)
             for kind in ("buffer", "weight_sync")]
    specs += [RoleSpec(f"scorer-{i}", "scorer", [PYTHON, "-m", "launch.scorer", CONFIG, "--scorer.worker_id",
                                                 f"scorer-{i}"],
                       {**role_env(r.threads_per_role, keys, f"scorer-{i}"), **secret_env(run)},
                       required=False, restart=restart,
                       ready=Readiness(timeout_s=r.ready_timeout_s))
              for i in range(r.num_scorers)]
    specs += [generator_spec(run, i, launcher, restart) for i in range(r.num_generators)]
    learner = [PYTHON, "-m", "launch.learner", CONFIG]
    if launcher == "ray":  # one process per rank; only rank 0 says it is ready
        specs += [RoleSpec(f"learner-{rank}", "learner", learner, role_env(r.threads_per_role, keys, "learner"),
                           ready=waited if rank == 0 else Readiness(probe="none"))
                  for rank in range(r.learner_ranks)]
    else:
        if r.learner_ranks > 1:
            learner = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(r.learner_ranks),
                       "--master_port", str(run.weight_sync.port + 1), "-m", "launch.learner", CONFIG]
        specs.append(RoleSpec("learner", "learner", learner, role_env(r.threads_per_role, keys, "learner"),
                              ready=waited, cpus=r.learner_cpus))
    return specs


def write_status(run_dir: str | Path, status: dict) -> None:
    """`<run_dir>/status.json`: the launcher's account of its roles, replaced whole (never half-written)."""
    path = Path(run_dir) / STATUS_NAME
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**status, "time": time.time()}, indent=1, default=str) + "\n")
    os.replace(tmp, path)
