"""The Ray actors of `launch.ray`: one per role process, and the run's controller.

`RoleProcess` holds a role's resources on its node and runs the role's ordinary entry point
(`python -m launch.X CONFIG ...`) as a subprocess in its own session, exactly as `launch.local`
would: the roles do not know about Ray. The driver asks it for the node's address and free ports
before the role starts (so addresses are discovered, not configured), starts the process, polls
it, restarts it and stops it.

`RunControl` is the run's named actor: it holds the number of generators the run should have and
the last status the driver reported. `control_main` is `python -m launch.ray scale|status|stop`,
a second process that finds it by name on the cluster.

Classes here are plain; `launch.ray` turns them into actors with `ray.remote(...)`. Only `ray` itself
is imported lazily, so this module stays importable anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CONTROLLER_PREFIX = "conveyor-run:"


def process_start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks): tells a process from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def kill_group(pid: int, start_time: str, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group led by `pid` if that process is still the one that was started."""
    if not start_time or process_start_time(pid) != start_time:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class RoleProcess:
    """A Ray actor that runs one role process on its node and watches it."""

    def __init__(self, name: str, log_dir: str, grace_s: float = 10.0):
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.grace_s = grace_s
        self.proc: subprocess.Popen | None = None
        self.start_time = ""

    def node(self) -> dict:
        """Where this actor runs: routable IP, node id, hostname, the GPUs Ray gave it."""
        import ray

        ctx = ray.get_runtime_context()
        return {"ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "hostname": socket.gethostname(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "actor_pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def free_ports(self, n: int) -> int:
        from launch.ports import free_port_block

        # every interface (""): roles on other nodes dial this node's routable address
        return free_port_block(n, host="")

    def start(self, argv: list[str], env: dict[str, str], config_text: str, config_path: str, cwd: str,
              ready_line: str | None = None, ready_timeout_s: float = 600.0, attempt: int = 1) -> dict:
        """Write this role's resolved config, start the process, and (with `ready_line`) wait until
        its log shows that line. Returns {"ok", "pid", "code", "detail", "log"}; never raises for the
        role's own failure (the driver decides what it means)."""
        if self.poll() is None:
            self.stop()
        path = Path(config_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config_text)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        log.write(f"=== launch.ray: start {attempt} of {self.name} on {socket.gethostname()}: "
                  f"{' '.join(argv)}\n".encode())
        offset = log.tell()  # the ready line is looked for in what this start writes
        argv = [sys.executable if a == "{python}" else a for a in argv]
        full_env = {**os.environ, **env}
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, cwd=cwd if Path(cwd).is_dir() else None, start_new_session=True)
        log.close()
        self.start_time = process_start_time(self.proc.pid)
        out = {"ok": True, "pid": self.proc.pid, "start_time": self.start_time, "code": None, "detail": "",
               "log": str(self.log_path)}
        if ready_line:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                text = self._read_from(offset)
                if ready_line in text:
                    break
                code = self.proc.poll()
                if code is not None:
                    return {**out, "ok": False, "code": code, "detail": "exited before it was ready\n" + self.tail()}
                if time.monotonic() > deadline:
                    return {**out, "ok": False, "detail": f"not ready after {ready_timeout_s:.0f}s\n" + self.tail()}
                time.sleep(0.1)
        return out

    def _read_from(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def poll(self) -> int | None:
        """The role process's exit code, None while it runs (or before it was started)."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the role's process, SIGKILL its whole process group after it exited or after the
        grace period. Only the role itself gets SIGTERM, so a generator finishes its batch with its
        engine still there, then closes the engine."""
        if self.proc is None:
            return None
        grace = self.grace_s if grace_s is None else grace_s
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._signal(signal.SIGKILL)  # the leader may be gone while what it spawned (vLLM's engine) is not
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.poll()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self, n: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def read_file(self, path: str, offset: int = 0, limit: int = 1 << 20) -> tuple[str, int]:
        """(text, next offset) of a file on this node from `offset`, whole lines only (metrics.jsonl)."""
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(limit)
        except OSError:
            return "", offset
        end = data.rfind(b"\n") + 1
        return data[:end].decode(errors="replace"), offset + end

    def __del__(self):  # the actor going away gracefully stops its role too
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop(grace_s=2.0)
        except Exception:
            pass


class RunControl:
    """The run's named controller: the wanted number of generators, and the driver's last report."""

    def __init__(self, run_dir: str, num_generators: int):
        self.run_dir = run_dir
        self.wanted = num_generators
        self.report: dict = {}
        self.stop_requested = ""

    def scale(self, generators: int) -> dict:
        if generators < 1:
            raise ValueError(f"--generators {generators}: a run needs at least one generator")
        before, self.wanted = self.wanted, int(generators)
        return {"run_dir": self.run_dir, "before": before, "wanted": self.wanted}

    def wanted_generators(self) -> int:
        return self.wanted

    def set_report(self, report: dict) -> None:
        self.report = report

    def status(self) -> dict:
        return {"run_dir": self.run_dir, "wanted_generators": self.wanted, **self.report}

    def request_stop(self, why: str = "stop requested") -> None:
        self.stop_requested = why or "stop requested"

    def stop_reason(self) -> str:
        return self.stop_requested


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
