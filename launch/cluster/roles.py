"""The Ray actors of `launch.ray`: one per role process, and the run's controller.

`RoleProcess` holds a role's resources on its node and runs the role's ordinary entry point
(`python -m launch.X CONFIG ...`) through the same process wrapper as `launch.local`
(launch/process.py): its own session, its log, its ready file. The roles do not know about Ray. The
driver asks the actor for the node's address and free ports before the role starts (so addresses
are discovered, not configured), starts the process (with gloo tied to the interface of that
address, `node_env`), polls it, restarts it and stops it.

`RunControl` is the run's named actor: it holds the number of generators the run should have and
the last status the driver reported; `python -m launch.ray scale|status|stop` (launch/cluster/status.py)
finds it by name on the cluster.

Classes here are plain; `launch.ray` turns them into actors with `ray.remote(...)`. Only `ray` itself
is imported lazily, so this module stays importable anywhere.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from launch.process import Process, kill_group, process_start_time  # noqa: F401 (kill_group runs as a Ray task)

CONTROLLER_PREFIX = "conveyor-run:"


class RoleProcess:
    """A Ray actor that runs one role process on its node and watches it."""

    def __init__(self, name: str, log_dir: str, grace_s: float = 10.0):
        self.name = name
        self.grace_s = grace_s
        log_dir = Path(log_dir)
        self.log_path = log_dir / f"{name}.log"
        self.proc = Process(name, self.log_path, log_dir.parent / "ready" / f"{name}.json")

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
              wait_ready: bool = False, ready_timeout_s: float = 600.0, attempt: int = 1) -> dict:
        """Write this role's resolved config, start the process, and (with `wait_ready`) wait until
        it has written its ready file. Returns {"ok", "pid", "start_time", "code", "detail", "log",
        "ready"}; never raises for the role's own failure (the driver decides what it means)."""
        if self.poll() is None:
            self.stop()
        path = Path(config_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config_text)
        pid = self.proc.start(argv, {**node_env(), **env}, cwd, banner=f"launch.ray: start {attempt} of {self.name} on "
                                                     f"{socket.gethostname()}: {' '.join(argv)}")
        out = {"ok": True, "pid": pid, "start_time": self.proc.start_time, "code": None, "detail": "",
               "log": str(self.log_path), "ready": None}
        if wait_ready:
            why = self.proc.wait_ready(ready_timeout_s)
            if why:
                return {**out, "ok": False, "code": self.poll(), "detail": why}
            out["ready"] = self.proc.ready()
        return out

    def poll(self) -> int | None:
        """The role process's exit code, None while it runs (or before it was started)."""
        return self.proc.poll()

    def probe(self) -> tuple[int | None, dict | None]:
        """(exit code or None, what its ready file says or None)."""
        return self.proc.poll(), self.proc.ready()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the role's process, SIGKILL its whole process group after it exited or after the
        grace period. Only the role itself gets SIGTERM, so a generator finishes its batch with its
        engine still there, then closes the engine."""
        return self.proc.stop(self.grace_s if grace_s is None else grace_s)

    def tail(self, n: int = 30) -> str:
        return self.proc.tail(n)

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
            if self.poll() is None and self.proc.pid is not None:
                self.stop(grace_s=2.0)
        except Exception:
            pass


def node_env() -> dict[str, str]:
    """What a role needs from its node: gloo (the weight broadcast, DeepSpeed's CPU groups) binds the
    address the hostname resolves to, which is often 127.0.0.1 (/etc/hosts); peers on other nodes
    would then be told to dial loopback. GLOO_SOCKET_IFNAME names the interface of the node's
    routable IP instead, unless the node already sets it."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    import psutil
    import ray

    node_ip = ray.util.get_node_ip_address()
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == node_ip for a in addrs if a.family == socket.AF_INET):
            return {"GLOO_SOCKET_IFNAME": name}
    return {}


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
