"""Every role of a run on this machine: `python -m launch.local CONFIG [--section.key VALUE ...]`.

Starts the buffer, the weight-sync service, S scorers, G generators and the learner ranks (the
processes of launch/roles.py, in that order) as separate supervised processes; the buffer, the
weight-sync service and the learner each write a ready file before the next role starts (never a
log line: see common/ready.py). Each role's output goes to `<run_dir>/logs/<role>.log`, and
`<run_dir>/status.json` says where every role stands (state, pid, restarts, ready); the terminal
gets a progress bar with a one-line status (step, reward, staleness, throughput). Ctrl-C or any
required role's failure stops every process (whole process groups: no orphans, no leaked ports),
and the exit code says what failed:

    0 done  2 bad config  3 buffer  4 weight sync  5 learner  6 generators  7 scorers  8 stalled  9 disk full
    130 Ctrl-C

What heals by itself: a generator or scorer that dies is started again (`run.max_restarts` each,
after `run.restart_delay_s`); with `run.auto_resume N`, a learner, buffer or weight-sync crash
restarts the whole run from its last checkpoint, up to N times. A run that finishes no step for
`run.stall_timeout_s` stops with exit code 8 and the buffer's account of why. A role that runs out of
disk space stops the run with exit code 9 and the path it could not write; with `run.auto_resume`
the run waits for space (`run.disk_wait_s`, `run.disk_min_free_mb`) and resumes. Each such event is
said on the terminal and in `<run_dir>/logs/launcher.log`.

Before anything starts, the run's device plan (launch/devices/) gives every role process its own
GPUs (CUDA_VISIBLE_DEVICES), or a memory share of one it shares, and refuses a layout that cannot
fit with the numbers (exit code 2); `--plan` prints it and exits:

    python -m launch.local CONFIG --plan          # CONVEYOR_FAKE_GPUS=8: as if this machine had 8 GPUs

Another generator can join a running run from a second terminal:

    python -m launch.generator <run_dir>/config.yaml --generator.worker_id gen-extra

OpenRLHF's `train_ppo_ray` flags are accepted with their meaning (0.11.2's dotted ones and 0.11's,
`--pretrain`, `--n_samples_per_prompt`, ...) or refused with the reason: launch/openrlhf/flags.py holds
the table, and `--help` lists it.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from launch.devices.view import device_plan, print_plan  # noqa: F401 (launch.demo takes them from here)
from launch.recovery import EXIT_CODES, LAUNCHER_RESERVE, RESERVE_NAME, RESUMABLE


def plan_roles(run, devices=None) -> list:
    """The processes of the run in start order (launch/roles.py), with launch.local's restart
    policy, each on its devices (`devices`: the run's plan; None: made here)."""
    from launch.roles import RestartPolicy, plan, prepare_keys

    devices = device_plan(run) if devices is None else devices
    prepare_keys(run)  # (CurveZMQ on: the run's keys, before any role starts)
    return plan(run, "local", RestartPolicy(run.run.max_restarts, run.run.restart_delay_s), devices)


class Status:
    """The terminal's progress bar and one-line status, fed by the learner's metrics.jsonl."""

    def __init__(self, run):
        from tqdm import tqdm

        self.metrics_path = Path(run.run.run_dir) / "metrics.jsonl"
        self.total = run.learner.total_steps
        self.bar = tqdm(total=self.total, desc="steps", unit="step", dynamic_ncols=True, file=sys.stderr)
        self.seen = 0  # steps shown as done
        self.rows = 0
        self.t0 = time.monotonic()
        self.last: dict = {}

    def tick(self) -> None:
        rows = read_metrics(self.metrics_path)
        done = max((int(r.get("step", -1)) for r in rows), default=-1) + 1  # a resumed run redoes steps
        if len(rows) != self.rows:
            self.rows = len(rows)
            self.bar.update(done - self.seen)
            self.seen = done
            m = self.last = rows[-1]

            def num(key: str, default: float = float("nan")) -> float:
                v = m.get(key)
                return default if v is None else float(v)

            busy = num("time/train_step", 0.0) + num("time/wait_for_batch", 0.0)
            self.bar.set_postfix_str(
                f"reward {num('reward/mean'):.3f} staleness {num('buffer/staleness_mean', 0.0):.2f}"
                f"/{num('buffer/staleness_max', 0.0):.0f} {num('perf/samples', 0.0) / max(busy, 1e-9):.1f} samples/s")

    def close(self) -> None:
        self.tick()
        self.bar.close()


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return rows


def run_local(run, quiet: bool = False) -> int:
    """Start every role, wait for the learner to finish, stop everything; returns the exit code.
    With `run.auto_resume`, a crash of a core role starts the whole run again from its checkpoint."""
    from collections import Counter

    from common.disk import release_reserve
    from launch.recovery import last_checkpoint, launcher_log, with_auto_resume, write_exit
    from launch.roles import write_status

    run_dir = Path(run.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = launcher_log(run_dir, "launch.local")
    started = time.monotonic()
    restarts: Counter[str] = Counter()
    codes: list[int] = []  # each attempt's exit code

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    def waiting_for_disk(state: dict) -> None:  # (status.json says it, while it lasts)
        try:
            write_status(run_dir, {"launcher": "launch.local", "waiting_for_disk": state})
        except OSError:
            pass

    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code, resumes = with_auto_resume(run, lambda: run_once(run, quiet, say, restarts), say, codes,
                                         on_wait=waiting_for_disk)
    finally:
        signal.signal(signal.SIGTERM, old)
        release_reserve(run_dir / RESERVE_NAME)
        release_reserve(run_dir / LAUNCHER_RESERVE)
    reason = say.last if code else ""
    if code in RESUMABLE:
        say(f"every role was stopped; to go on from checkpoint {last_checkpoint(run_dir)}: "
            f"{'free some disk space, then ' if code == EXIT_CODES['disk'] else ''}the same command "
            f"with --learner.resume true (or run.auto_resume N to do it by itself)")
    write_exit(run_dir, code, time.monotonic() - started, resumes=resumes, restarts=sum(restarts.values()),
               attempts=codes, reason=reason)
    return code


def run_once(run, quiet: bool, say, restarts) -> int:
    """One start of the whole run: every role up, supervised until the learner exits; the exit code."""
    from common.disk import release_reserve, reserve
    from launch.ports import free_port_block
    from launch.recovery import ProgressWatch, Stalled, buffer_diagnosis
    from launch.roles import write_status
    from launch.run_config import assign_ports, write_resolved
    from launch.supervisor import RoleFailed, Supervisor

    r = run.run
    run_dir = Path(r.run_dir)
    assign_ports(run, r.base_port or free_port_block(6))
    config_path = write_resolved(run, run_dir / "config.yaml")
    reserve(run_dir / LAUNCHER_RESERVE, for_roles=False)  # (room for its own last words: common/disk.py)
    reserve(run_dir / RESERVE_NAME)  # (its roles find it in $CONVEYOR_DISK_RESERVE)
    started = time.monotonic()
    status = None
    sup = Supervisor(run_dir / "logs", run_dir / "ready", restarts=restarts, say=say)
    launched = False

    def report(**extra) -> None:
        try:
            write_status(run_dir, {"launcher": "launch.local", "buffer": f"{run.buffer.host}:{run.buffer.port}",
                                   "weight_sync": f"{run.weight_sync.host}:{run.weight_sync.port}",
                                   "resumed": bool(run.learner.resume), "launched": launched,
                                   "roles": sup.status(), **extra})
        except OSError:  # a full disk: the roles that write say it (exit code 9)
            pass

    try:
        try:
            devices = device_plan(run)
            (run_dir / "device_plan.txt").write_text(devices.table())  # (as launch.ray writes it)
            for spec in plan_roles(run, devices):
                learner = sup.start(spec, config_path)
            launched = True
            report()
            print(f"run {run_dir}: {r.mode}, {r.num_generators} generator(s), {r.num_scorers} scorer(s), "
                  f"{r.learner_ranks} learner rank(s){', resumed' if run.learner.resume else ''}; logs in "
                  f"{run_dir / 'logs'}", file=sys.stderr, flush=True)
            status = None if quiet else Status(run)
            watch = ProgressWatch(run_dir / "metrics.jsonl", r.stall_timeout_s,
                                  lambda: buffer_diagnosis(run.buffer.host, run.buffer.port),
                                  first_grace_s=r.ready_timeout_s)

            def tick():
                if status:
                    status.tick()
                report()
                if r.max_wall_s and time.monotonic() - started > r.max_wall_s:
                    raise RoleFailed("learner", None, learner.log_path,
                                     f"run exceeded run.max_wall_s={r.max_wall_s}")
                watch.check()

            sup.wait(learner, on_tick=tick)
        finally:
            sup.stop()
            report(finished=True)
        code = 0
    except Stalled as e:
        say(f"stalled: {e}")
        code = EXIT_CODES["stalled"]
    except RoleFailed as e:
        if e.code == EXIT_CODES["disk"]:  # out of disk space, whichever role met it
            release_reserve(run_dir / LAUNCHER_RESERVE)  # (every role is stopped: room for what is said now)
            code = EXIT_CODES["disk"]
        else:
            code = EXIT_CODES.get(e.role.split("-")[0], 1)
        say(str(e))
    except KeyboardInterrupt:
        say("interrupted, stopping every role")
        code = 130
    finally:
        if status:
            status.close()
    return code


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from launch.config import help_or_usage
    from launch.run_config import run_help

    help_or_usage(argv, lambda: run_help(__doc__))
    from common.config import ConfigError
    from launch.run_config import load_run_config

    config_path = argv.pop(0) if not argv[0].startswith("--") else None
    show_plan = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    try:
        run = load_run_config(config_path, argv, paths=not show_plan)
        if show_plan:
            sys.exit(print_plan(run, "launch.local"))
        if run.stale_state():
            raise ConfigError(run.stale_state())
        device_plan(run)  # (refused here, before anything starts, when it cannot fit)
    except ConfigError as e:
        print(f"launch.local: {e}", file=sys.stderr)
        sys.exit(EXIT_CODES["config"])
    sys.exit(run_local(run))


if __name__ == "__main__":
    main()
