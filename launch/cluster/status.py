"""How a `launch.ray` run stands, for the terminal, the controller, `<run_dir>/status.json` and
`python -m launch.ray scale|status|stop`.

`StatusFeed.tick` (every `ray.poll_s`, from the driver) copies learner rank 0's metrics.jsonl
(maybe on another node) to `<run_dir>/ray/metrics.jsonl` (its growth is the learner's progress,
which the stall watch reads), feeds the progress bar, and hands the run's report (addresses,
step, reward, each role's state, node, pid, restarts and ready record) to the run's controller and
to `<run_dir>/status.json`. `control_main` is the second process that talks to the controller.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from launch.cluster.roles import CONTROLLER_PREFIX
from launch.roles import write_status

if TYPE_CHECKING:
    from launch.cluster.run import RayRun


class StatusFeed:
    """The driver's view of one attempt: the metrics mirror, the progress bar, the report."""

    def __init__(self, job: "RayRun"):
        self.job = job
        # each attempt copies rank 0's metrics from the start, so an earlier copy goes
        self.mirror = job.run_dir / "ray" / "metrics.jsonl"
        self.mirror.unlink(missing_ok=True)
        self.offset = 0
        self.bar = None

    def tick(self) -> None:
        """Copy new metrics lines, update the progress bar, report to the controller and status.json."""
        job = self.job
        lead = next((p for p in job.procs if p.name == "learner-0"), None)
        if lead is not None and lead.actor is not None:
            try:
                text, self.offset = job.ray.get(lead.actor.read_file.remote(
                    str(job.run_dir / "metrics.jsonl"), self.offset), timeout=10)
            except Exception:
                text = ""
            if text:
                self.mirror.parent.mkdir(parents=True, exist_ok=True)
                with open(self.mirror, "a") as f:
                    f.write(text)
        if self.bar is None and not job.quiet:
            from launch.local import Status

            self.bar = Status(job.run)
            self.bar.metrics_path = self.mirror
        last = {}
        if self.bar is not None:
            self.bar.tick()
            last = self.bar.last
        elif self.mirror.exists():
            from launch.local import read_metrics

            rows = read_metrics(self.mirror)
            last = rows[-1] if rows else {}
        self.publish(self.report(last))

    def publish(self, report: dict, wait: bool = False) -> None:
        write_status(self.job.run_dir, report)
        if self.job.controller is not None:
            ref = self.job.controller.set_report.remote(report)
            if wait:
                self.job.ray.get(ref, timeout=5)

    def report(self, last: dict, **extra) -> dict:
        job = self.job
        run = job.run
        return {
            "launcher": "launch.ray", "run_name": job.run_name, "attempt": job.attempt, "launched": job.launched,
            "buffer": f"{run.buffer.host}:{run.buffer.port}",
            "weight_sync": f"{run.weight_sync.host}:{run.weight_sync.port}",
            "resumed": bool(run.learner.resume),
            "step": last.get("step"), "reward_mean": last.get("reward/mean"),
            "total_steps": run.learner.total_steps, "wall_s": round(time.monotonic() - job.t0, 1),
            "roles": [{"name": p.name, "kind": p.spec.kind, "state": p.state.value, "node": p.node.get("ip"),
                       "host": p.node.get("hostname"), "pid": p.pid, "restarts": p.restarts, "starts": p.starts,
                       "code": p.code, "ready": p.ready, "waiting_for_node": p.waiting, "gpus": p.gpus}
                      for p in job.procs],
            **extra,
        }

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# --------------------------------------------------------------------------------------------
# scale / status / stop: a second process talking to the run's controller


def find_controller(args):
    """The controller of the run named `args.run` (or of the only run going) on the cluster."""
    import ray

    address = args.address or os.environ.get("RAY_ADDRESS", "") or "auto"
    ray.init(address=address, namespace=args.namespace, log_to_driver=False, configure_logging=False)
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == args.namespace and a["name"].startswith(CONTROLLER_PREFIX)]
    if args.run:
        name = CONTROLLER_PREFIX + args.run
        if name not in names:
            sys.exit(f"launch.ray: no run named {args.run!r} on this cluster (runs: "
                     f"{[n[len(CONTROLLER_PREFIX):] for n in names] or 'none'})")
    elif len(names) == 1:
        name = names[0]
    else:
        sys.exit(f"launch.ray: {'no run is going' if not names else 'several runs are going'} on this cluster"
                 + (f"; name one with --run ({', '.join(n[len(CONTROLLER_PREFIX):] for n in names)})" if names else ""))
    return ray.get_actor(name, namespace=args.namespace)


def control_main(argv: list[str]) -> int:
    """`python -m launch.ray scale|status|stop`: talk to a running run through its controller."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m launch.ray", description="Talk to a running launch.ray run.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd in ("scale", "status", "stop"):
        s = sub.add_parser(cmd)
        s.add_argument("--run", default="", help="the run's name (ray.run_name; default: its run_dir's last part)")
        s.add_argument("--address", default="", help="the cluster (default: $RAY_ADDRESS, else auto)")
        s.add_argument("--namespace", default="conveyor")
        if cmd == "scale":
            s.add_argument("--generators", type=int, required=True, help="the number of generators wanted")
            s.add_argument("--wait", action="store_true", help="return once that many generators run")
            s.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    import ray

    ctl = find_controller(args)
    if args.cmd == "stop":
        ray.get(ctl.request_stop.remote("stop requested by `launch.ray stop`"))
        print("launch.ray: asked the run to stop")
        return 0
    if args.cmd == "status":
        st = ray.get(ctl.status.remote())
        print(json.dumps({"run": st, "services": service_status(st)}, indent=2))
        return 0
    try:
        res = ray.get(ctl.scale.remote(args.generators))
    except ray.exceptions.RayTaskError as e:
        sys.exit(f"launch.ray: {e.cause if hasattr(e, 'cause') else e}")
    print(f"launch.ray: run {res['run_dir']}: generators {res['before']} -> {res['wanted']}", flush=True)
    if args.wait:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            st = ray.get(ctl.status.remote())
            running = [r for r in st.get("roles", []) if r["name"].startswith("generator-") and r["state"] == "running"]
            if len(running) == st["wanted_generators"]:
                print(f"launch.ray: {len(running)} generator(s) running", flush=True)
                return 0
            time.sleep(1.0)
        sys.exit(f"launch.ray: the run did not reach {args.generators} generators within {args.timeout:.0f}s")
    return 0


def service_status(st: dict) -> dict:
    """The weight-sync service's view of the generators and the buffer's counters, when reachable."""
    out = {}
    keys = Path(st.get("run_dir", "")) / "keys"
    if st.get("run_dir") and keys.is_dir():  # (CurveZMQ on: the run's admin key; common/curve.py)
        os.environ.setdefault("CONVEYOR_KEYS", str(keys))
    try:
        from weight_sync.client import GeneratorSyncClient

        host, port = st["weight_sync"].rsplit(":", 1)
        with GeneratorSyncClient(host, int(port), "launch.ray-status", timeout_s=3) as ws:
            out["weight_sync"] = ws.status()
    except Exception as e:  # noqa: BLE001 (a status command reports what it can)
        out["weight_sync_error"] = str(e)
    try:
        from buffer.client import BufferClient

        host, port = st["buffer"].rsplit(":", 1)
        with BufferClient(host, int(port), timeout_s=3) as b:
            out["buffer"] = b.metrics()
    except Exception as e:  # noqa: BLE001
        out["buffer_error"] = str(e)
    return out
