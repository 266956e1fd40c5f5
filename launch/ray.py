"""Every role of a run on a Ray cluster: `python -m launch.ray CONFIG [--section.key VALUE ...]`.

The same roles as `launch.local` (buffer, weight sync, learner ranks, generators, scorers), each an
unchanged `python -m launch.X` process (the plan of launch/roles.py), started by a Ray actor that
holds the role's resources on its node (launch/cluster/roles.py). Section `ray:` of the config
(launch/cluster/config.py) says what each process reserves (`--ray.generator.num_gpus 1`) and how a
role's processes spread over nodes. The pieces: placement (launch/cluster/placement.py), one
attempt's start, supervision and healing (launch/cluster/run.py), `scale` (launch/cluster/scale.py), the
status report and the `scale|status|stop` commands (launch/cluster/status.py); this file joins the
cluster, runs the attempts (auto-resume) and gives the exit code.

    python -m launch.ray CONFIG [--ray.address HOST:6379] [--section.key VALUE ...]
    python -m launch.ray CONFIG --plan      # the device plan; CONVEYOR_FAKE_GPUS=2x8: as on 2 nodes of 8 GPUs
    ray job submit --address http://HEAD:8265 -- python -m launch.ray CONFIG ...
    python -m launch.ray scale --generators K [--run NAME] [--address A] [--wait]
    python -m launch.ray status [--run NAME] [--address A]

- The cluster: `--ray.address` or RAY_ADDRESS (set inside `ray job submit`); neither: a local
  cluster for this run only.
- Addresses are discovered: the buffer's and the weight-sync service's actors report their node's
  IP and free ports, and every role's resolved config (`<run_dir>/configs/<role>.yaml`) says them;
  `run.curve auto` is decided from those IPs (CurveZMQ on unless they are loopback).
- GPUs: the run's device plan (launch/devices/, as launch.local's) is made on the cluster's
  alive nodes before anything is placed, and a run that does not fit is refused with the numbers
  (exit 2). Every role process gets the plan's GPUs as CUDA_VISIBLE_DEVICES (launch/cluster/devices.py):
  in the separate layout each reserves its own as Ray `num_gpus` (Ray's ids are disjoint); in a
  colocated one the run holds its GPUs in one placement group per node and each process gets the
  ids of its planned devices' bundles; a process with none gets "". `--plan` prints the plan and
  what each process reserves, without joining a cluster or writing anything.
- Learner ranks: one actor per rank in one placement group; the launcher sets the rendezvous
  (MASTER_ADDR/MASTER_PORT of rank 0's node, RANK, WORLD_SIZE, LOCAL_RANK).
- A generator or scorer that dies is started again (`ray.max_restarts` times each; its leases expire
  and the buffer issues them again); one whose node was lost first waits, uncounted, for a node
  that can hold its bundle (a replacement joining; `run.stall_timeout_s` bounds the wait). \
A learner rank, the buffer or the weight-sync service dying
  stops the run; with `run.auto_resume N` the whole run is then started again by itself from the
  last checkpoint (every actor and placement group of the job is freed first, the cluster stays;
  addresses are discovered again), up to N times; without, go on from it with
  `--learner.resume true`. A run past `run.max_wall_s` (counted from its first start) is not resumed.
  A role out of disk space exits with code 9, which stops the run; with `run.auto_resume` the driver
  first waits for space in the run folder as it sees it (`run.disk_wait_s`, `run.disk_min_free_mb`).
- A run whose learner finishes no step for `run.stall_timeout_s` (learner rank 0's metrics.jsonl
  stops growing) stops with exit code 8 and the buffer's account of why no batch comes; it is not
  resumed. Ctrl-C, SIGTERM and `launch.ray stop` are never resumed either (130).
- `scale` changes the number of generators of the running run (a new one catches up with the
  current weights before its first lease); `status` prints roles, nodes, restarts, step and reward.

Logs: `<run_dir>/logs/<role>.log` on the role's node; what the driver says (roles placed, restarts,
resumes, a stall) also goes to `<run_dir>/logs/launcher.log` on the driver's node;
`<run_dir>/status.json` there says where each role stands (state, node, pid, restarts, its ready
record), and `<run_dir>/exit.json` gets the exit code with the counts of resumes and
generator/scorer restarts, each attempt's code and the reason of a failure.
Exit codes as `launch.local`: 0 done, 2 bad config or resources the cluster cannot give, 3 buffer,
4 weight sync, 5 learner, 6 generators, 7 scorers, 8 stalled, 130 interrupted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from launch.cluster.config import ResourceError, load
from launch.cluster.run import Proc, RayRun, RunFailed  # noqa: F401 (the attempt's pieces, named from here)
from launch.recovery import EXIT_CODES, RESUMABLE, Stalled, launcher_log


class FinalExit(Exception):
    """An attempt's exit code that must end the run even where `run.auto_resume` would start it again."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def resume_hint(run_dir: Path, config_name: str) -> str:
    ckpts = sorted((int(p.name.split("_")[1]), p) for p in (run_dir / "checkpoints").glob("step_*")
                   if p.name.split("_")[1].isdigit())
    seen = f"the last one seen from here: {ckpts[-1][1]}" if ckpts else "none seen from here yet"
    return (f"to go on from learner rank 0's latest checkpoint in {run_dir / 'checkpoints'} ({seen}): "
            f"python -m launch.ray {config_name} [the same flags] --learner.resume true "
            "(the buffer picks up its saved state by itself), or with --run.auto_resume N to do it by itself")


def connect(rcfg) -> bool:
    """Join the cluster (or start a local one); True when this process started it."""
    import ray

    address = rcfg.address or os.environ.get("RAY_ADDRESS", "")
    kwargs = {"namespace": rcfg.namespace, "log_to_driver": False, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
        return False
    # "local": a new cluster; a bare ray.init() would join any Ray instance found on this machine.
    # Token authentication stays off unless RAY_AUTH_MODE asks for it: Ray 2.60 would otherwise
    # write ~/.ray/auth_token, which turns it on for every later `ray start` on the machine (and
    # breaks their clients that do not expect it). The roles' own sockets are unauthenticated anyway.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=rcfg.local_num_cpus or None, include_dashboard=False, **kwargs)
    return True


def attempt_code(go: Callable[[], int], say: Callable[[str], None]) -> int:
    """The exit code of one attempt `go` (launch and supervise), its reason said. Raises FinalExit for
    a failure that must end the run even with resumes left."""
    try:
        return go()
    except ResourceError as e:
        say(str(e))
        return EXIT_CODES["config"]
    except Stalled as e:  # a restart would stall the same way: the diagnosis says what to change
        say(f"stalled: {e}")
        return EXIT_CODES["stalled"]
    except RunFailed as e:
        say(str(e))
        code = EXIT_CODES.get(e.kind, 1)
        if not e.resumable:
            raise FinalExit(code) from None
        return code
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, `launch.ray stop`: never resumed
        say(f"{str(e) or 'interrupted'}, stopping every role")
        return 130


def run_ray(rcfg, run, config_name: str = "CONFIG", quiet: bool = False) -> int:
    """Place and start every role on the cluster, wait for the learner, stop everything; the exit code.
    With `run.auto_resume`, a learner, buffer or weight-sync failure frees the job's actors and
    placement groups and starts it again from the last checkpoint, on the same cluster."""
    import ray

    from common.disk import release_reserve, reserve
    from launch.recovery import LAUNCHER_RESERVE, with_auto_resume, write_exit

    run_dir = Path(run.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = launcher_log(run_dir, "launch.ray")
    started = time.monotonic()
    try:
        own_cluster = connect(rcfg)
    except ConnectionError as e:
        print(f"launch.ray: cannot join the Ray cluster: {e}", file=sys.stderr, flush=True)
        return 1

    def on_sigterm(signum, frame):  # `ray job stop` and `kill` stop every role, as Ctrl-C does
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    attempts, restarts = 0, 0  # restarts: of generators and scorers, over every attempt
    codes: list[int] = []  # each attempt's exit code

    def attempt() -> int:
        """One start of the whole job; its actors and placement groups are always freed after it."""
        nonlocal attempts, restarts
        attempts += 1
        job = RayRun(rcfg, run, quiet, say, attempt=attempts, t0=started)
        reserve(run_dir / LAUNCHER_RESERVE, for_roles=False)  # (room for the driver's last words on a full disk)
        try:
            # each attempt writes the resolved configs again: learner.resume, the discovered ports
            code = attempt_code(job.go, say)
            if code == EXIT_CODES["disk"]:
                release_reserve(run_dir / LAUNCHER_RESERVE)
            return code
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the shutdown short
            try:
                job.shutdown()
            finally:
                restarts += job.helper_restarts()
                signal.signal(signal.SIGTERM, on_sigterm)

    # after ray.init, which installs its own SIGTERM handler (a bare sys.exit)
    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code, resumes = with_auto_resume(run, attempt, say, codes)
    except FinalExit as e:
        code, resumes = e.code, attempts - 1
        codes.append(code)
    except KeyboardInterrupt as e:  # during a shutdown, or between two attempts
        say(f"{str(e) or 'interrupted'}, stopping")
        code, resumes = 130, max(attempts - 1, 0)
    finally:
        release_reserve(run_dir / LAUNCHER_RESERVE)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if own_cluster:
                ray.shutdown()
        finally:
            signal.signal(signal.SIGTERM, old)
    reason = say.last if code else ""
    if code in RESUMABLE:
        say("every role was stopped; " + resume_hint(run_dir, config_name))
    write_exit(run_dir, code, time.monotonic() - started, resumes=resumes, restarts=restarts, attempts=codes,
               reason=reason)
    return code


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from launch.cluster.config import ray_help
    from launch.config import help_or_usage

    help_or_usage(argv, lambda: ray_help(__doc__))
    if argv[0] in ("scale", "status", "stop"):
        from launch.cluster.status import control_main

        sys.exit(control_main(argv))
    from common.config import ConfigError

    config_path = argv.pop(0) if not argv[0].startswith("--") else None
    show_plan = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    try:
        rcfg, run = load(config_path, argv, paths=not show_plan)
        if show_plan:
            sys.exit(print_plan(rcfg, run))
    except ConfigError as e:
        print(f"launch.ray: {e}", file=sys.stderr)
        sys.exit(EXIT_CODES["config"])
    sys.exit(run_ray(rcfg, run, config_path or "CONFIG"))


def print_plan(rcfg, run) -> int:
    """`--plan`: the device plan on $CONVEYOR_FAKE_GPUS's nodes or this machine's GPUs (no cluster is
    joined, nothing written), with what each role process reserves from Ray; 0, or 2 with the
    numbers when the run does not fit."""
    from common.config import ConfigError
    from launch.cluster.devices import RayDevices, offline_nodes
    from launch.devices.view import print_plan as show

    nodes, notes = offline_nodes(run)

    def on_ray(plan, specs) -> list[str]:
        devices = RayDevices.of(plan, run, rcfg, notes)
        if devices.problems():
            raise ConfigError("; ".join(devices.problems()))
        return devices.describe(specs)

    return show(run, "launch.ray", "ray", nodes, on_ray)


if __name__ == "__main__":
    main()
