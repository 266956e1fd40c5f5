"""A Ray cluster of two nodes on one machine: each node is a network namespace with its own address.

Two namespaces joined by a veth pair are two hosts as far as every socket, Ray and
torch.distributed can tell: each has only its loopback and its end of the link, so a role that
binds or advertises 127.0.0.1 where it must not cannot be reached from the other node.

    ns A (10.213.X.1/24)  <== veth ==>  ns B (10.213.X.2/24)
    ray head, node_a: 100                ray worker, node_b: 100

`TwoNodes.up()` makes the namespaces (loopback up in each), the link and the addresses, then
`start_head` / `start_worker` start `ray start --block` in them with the project's `.venv`, each
node advertising its custom resource (`node_a`, `node_b`) so a run config can pin roles to a node
(`--ray.learner.resources '{node_a: 1}'`). `exec_argv` runs anything inside a namespace (the
driver, `launch.ray status`). `kill_node("b")` SIGKILLs every process of a namespace at once (its
raylet, Ray's workers, the roles and their engines), as a machine that loses power; a new
`start_worker` is its replacement.

`down()` always ends with nothing left: every process of both namespaces (only this helper puts
processes there) is killed, the namespaces are deleted (which deletes the link), their Ray temp
folders removed, and `leftovers()` (what of it still exists) must be empty. Nothing outside the
two namespaces is ever addressed: they have no route but their /24.

`unavailable()` says why the machine cannot do this (not root, no `ip`, namespaces refused); the
tests skip with that reason. `scripts/two_node.py` is the same cluster for people.

`TwoNodes(link="emulated")` joins the namespaces by two TAP devices and a forwarder process
(scripts/link.py) instead of the veth pair, so the link can be made worse while a run goes:
`impair(delay_ms=50, jitter_ms=10, loss=0.01, rate_mbit=20)`, `partition()` (node B unreachable,
both ways) and `heal()`, `clear()` (a clean link again). Changes apply at once. The forwarder
lives in neither namespace (`kill_node` leaves the wire alone); `down()` ends it.
`unavailable("emulated")` adds what the link needs (/dev/net/tun).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.link import MTU, Link, tap_unavailable

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = ROOT / ".venv" / "bin"
GCS_PORT = 6379  # free in a namespace of our own, whatever the machine runs
SUBNET = "10.213"  # 10.213.X.0/24: private, and only ever routed inside the two namespaces


# Ray's health checks for a cluster whose link may be cut for a while: a node is declared dead after
# 60 missed checks of 1 s (at least a minute), where `ray_env`'s 3 would turn a partition of more
# than ~3 s into a node lost. (Ray's own defaults, every 3 s, 10 s to answer, 5 misses, outlast
# 15 s at least.) A node killed outright is then noticed a minute later.
PARTITION_TOLERANT = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                      "RAY_health_check_failure_threshold": "60"}


# logical CPUs of each role on a node of 2 (scheduling tokens; the machine has 2 cores)
SMALL_CPUS = ["--ray.buffer.num_cpus", "0.25", "--ray.weight_sync.num_cpus", "0.25", "--ray.learner.num_cpus", "1",
              "--ray.scorer.num_cpus", "0.5", "--ray.generator.num_cpus", "0.75"]


def placement_flags(services: str = "a", helpers: str = "b", generator: str = "", scorer: str = "") -> list[str]:
    """`launch.ray` flags that put the buffer, the weight-sync service and the learner on node
    `services`, the generators and scorers on node `helpers` (by the nodes' custom resources), or
    where `generator` / `scorer` say (their resources, e.g. "{gen: 1}")."""
    out = []
    for role in ("buffer", "weight_sync", "learner", "generator", "scorer"):
        node = services if role in ("buffer", "weight_sync", "learner") else helpers
        res = {"generator": generator, "scorer": scorer}.get(role) or f"{{node_{node}: 1}}"
        out += [f"--ray.{role}.resources", res]
    return out


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable(link: str = "veth") -> str:
    """Why this machine cannot host the two-node cluster with that `link` ("" when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    name = f"cvyprobe{os.getpid() % 100000}"
    res = ip("netns", "add", name, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    ip("netns", "del", name, check=False)
    return tap_unavailable() if link == "emulated" else ""


def ray_env(**extra: str) -> dict[str, str]:
    """The nodes' and their drivers' environment: the project on the path, no token authentication
    (the cluster is the caller's own), a lost node noticed within a few seconds."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(RAY_AUTH_MODE="disabled", RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
               RAY_health_check_failure_threshold="3")
    env.update(extra)  # (the caller's settings win: a cluster that must outlive a partition, say)
    return env


class TwoNodes:
    """Namespaces `a` and `b`, the link between them, a Ray node in each; see the module docstring."""

    def __init__(self, tag: str = "", cpus: float = 2, object_store_mb: int = 200, temp: str = "",
                 link: str = "veth", seed: int | None = None, env: dict[str, str] | None = None):
        """`link`: "veth" (a veth pair, memory to memory) or "emulated" (taps and a forwarder whose
        delay, jitter, loss, rate and partition `impair` and `partition` set; `seed`: its draws).
        `env`: settings over `ray_env()`'s for the nodes and for what `popen` and `run` start (Ray's
        health checks, say)."""
        if link not in ("veth", "emulated"):
            raise ValueError(f"link={link!r}: 'veth' or 'emulated'")
        tag = tag or str(os.getpid() % 100000)
        self.ns = {"a": f"cvy{tag}a", "b": f"cvy{tag}b"}
        self.link = {"a": f"cvy{tag}va", "b": f"cvy{tag}vb"}  # (interface names: at most 15 characters)
        third = 1 + int(tag) % 250 if tag.isdigit() else 1 + sum(map(ord, tag)) % 250
        self.addr = {"a": f"{SUBNET}.{third}.1", "b": f"{SUBNET}.{third}.2"}
        self.cpus, self.object_store_mb = cpus, object_store_mb
        # (under /tmp: Ray's socket paths must stay short)
        self.temp = Path(temp) if temp else Path(tempfile.mkdtemp(prefix=f"cvy{tag}", dir="/tmp"))
        self.nodes: dict[str, subprocess.Popen] = {}  # node -> its `ray start --block`
        self.started: list[int] = []  # every pid this helper started, for leftovers()
        self.link_kind, self.seed = link, seed
        self.env = dict(env or {})
        self.wire: Link | None = None  # the emulated link's forwarder

    @property
    def address(self) -> str:
        """The head's GCS address, as `--ray.address` takes it."""
        return f"{self.addr['a']}:{GCS_PORT}"

    # ---- the network ---------------------------------------------------------------------------

    def up(self) -> "TwoNodes":
        """Namespaces, loopback up in each, the veth pair and its addresses; undone if any step fails."""
        try:
            for node in ("a", "b"):
                ip("netns", "add", self.ns[node])
            if self.link_kind == "emulated":
                # the taps are made here, in this namespace, by the forwarder, then moved
                self.wire = Link(self.link["a"], self.link["b"], self.temp / "link.log", self.seed).start()
                self.started.append(self.wire.pid)
                for node in ("a", "b"):
                    ip("link", "set", self.link[node], "netns", self.ns[node])
                    ip("-n", self.ns[node], "link", "set", self.link[node], "mtu", str(MTU))
            else:
                ip("link", "add", self.link["a"], "netns", self.ns["a"], "type", "veth",
                   "peer", "name", self.link["b"], "netns", self.ns["b"])
            for node in ("a", "b"):
                ip("-n", self.ns[node], "link", "set", "lo", "up")
                ip("-n", self.ns[node], "addr", "add", f"{self.addr[node]}/24", "dev", self.link[node])
                ip("-n", self.ns[node], "link", "set", self.link[node], "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, RuntimeError):
            self.down(check=False)
            raise
        return self

    def exec_argv(self, node: str, argv: list[str]) -> list[str]:
        """`argv` run inside node's namespace."""
        return ["ip", "netns", "exec", self.ns[node], *argv]

    def popen(self, node: str, argv: list[str], log: Path, env: dict | None = None, **kw) -> subprocess.Popen:
        """Start `argv` in node's namespace, in its own session, output to `log`."""
        with open(log, "ab") as f:
            p = subprocess.Popen(self.exec_argv(node, argv), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env or ray_env(**self.env), start_new_session=True, **kw)
        self.started.append(p.pid)
        return p

    def run(self, node: str, argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run `argv` to its end in node's namespace (a `launch.ray status`, say)."""
        return subprocess.run(self.exec_argv(node, argv), capture_output=True, text=True, env=ray_env(**self.env),
                              timeout=timeout, **kw)

    # ---- the emulated link's faults ------------------------------------------------------------

    def impair(self, delay_ms: float = 0, jitter_ms: float = 0, loss: float = 0.0, rate_mbit: float = 0) -> dict:
        """The link from now on (both ways): `delay_ms` +- `jitter_ms` (uniform, order kept), each
        frame lost with probability `loss`, at most `rate_mbit` (0: no cap). No argument: a clean
        link; a partition stays until `heal`. The forwarder's answer: {"link": ..., "stats": ...}."""
        return self._wire(delay_ms=delay_ms, jitter_ms=jitter_ms, loss=loss, rate_mbit=rate_mbit)

    def partition(self) -> dict:
        """Node B unreachable from now on: every frame dropped, both ways, until `heal`."""
        return self._wire(partition=True)

    def heal(self) -> dict:
        """The end of a partition (the impairments set before it stay)."""
        return self._wire(partition=False)

    def clear(self) -> dict:
        """A clean link: no partition, no delay, loss or cap."""
        return self._wire(clear=True)

    def link_stats(self) -> dict:
        """Frames sent, lost, cut (partition) and dropped (queue full) per direction, and the settings."""
        return self._wire(stats=True)

    def _wire(self, **cmd) -> dict:
        if self.wire is None:
            raise RuntimeError("the link cannot be impaired: it is a veth pair (TwoNodes(link='emulated')), "
                               "or the cluster is not up")
        return self.wire.ask(**cmd)

    # ---- Ray -----------------------------------------------------------------------------------

    def start_head(self, resources: dict | None = None) -> None:
        self._start_ray("a", ["--head", "--port", str(GCS_PORT), "--include-dashboard", "false"],
                        resources or {"node_a": 100})

    def start_worker(self, resources: dict | None = None) -> None:
        """A worker node in namespace b (again, after `kill_node("b")`: a replacement)."""
        self._start_ray("b", ["--address", self.address], resources or {"node_b": 100})

    def _start_ray(self, node: str, args: list[str], resources: dict) -> None:
        starts = sum(1 for p in self.temp.glob(f"{node}-*.log"))
        log = self.temp / f"{node}-{starts}.log"
        temp = self.temp / f"{node}{starts}"
        self.nodes[node] = self.popen(node, [
            str(VENV_BIN / "ray"), "start", "--block", *args, "--node-ip-address", self.addr[node],
            "--num-cpus", str(self.cpus), "--num-gpus", "0", "--resources", json.dumps(resources),
            "--object-store-memory", str(self.object_store_mb << 20), "--temp-dir", str(temp),
            "--disable-usage-stats"], log)
        self.nodes[node].log = log

    def wait_ready(self, node: str, timeout_s: float = 120) -> None:
        """Until node's `ray start` blocks (it has joined the cluster)."""
        p = self.nodes[node]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = re.sub(r"\x1b\[[0-9;]*m", "", p.log.read_text(errors="replace"))
            if "block forever" in text:
                return
            if p.poll() is not None:
                raise RuntimeError(f"ray start on node {node} exited with code {p.returncode}:\n{text[-3000:]}")
            time.sleep(0.3)
        raise RuntimeError(f"ray start on node {node} not up after {timeout_s:.0f}s: see {p.log}")

    def alive_nodes(self) -> list[str]:
        """The node IPs the head counts as alive (asked from inside namespace a)."""
        code = ("import ray; ray.init(address=%r, log_to_driver=False, configure_logging=False); "
                "print(' '.join(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))" % self.address)
        res = self.run("a", [sys.executable, "-c", code], timeout=60)
        return res.stdout.split() if res.returncode == 0 else []

    # ---- losing a node, and tearing down --------------------------------------------------------

    def pids(self, node: str) -> list[int]:
        """Every process in node's namespace (whoever started it, it lives on that node)."""
        res = ip("netns", "pids", self.ns[node], check=False)
        return [int(x) for x in res.stdout.split()] if res.returncode == 0 else []

    def kill_node(self, node: str, timeout_s: float = 30) -> int:
        """SIGKILL every process of the node at once (its raylet, Ray's workers, the roles and
        their engines) and wait until none is left; how many were killed."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.pids(node)
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node}: processes {left} survived SIGKILL for {timeout_s:.0f}s")
            time.sleep(0.2)
        p = self.nodes.pop(node, None)
        if p is not None:
            p.wait(timeout=10)  # (reaped: our child)
        return len(killed)

    def down(self, check: bool = True) -> None:
        """Stop both nodes (the head gets SIGTERM first to shut down its Ray cleanly), kill what is
        left in the namespaces, delete them and the link, remove the temp folder; with `check`,
        raise if anything of it remains."""
        for node in ("b", "a"):
            p = self.nodes.get(node)
            if p is not None and p.poll() is None:
                p.terminate()  # (`ip netns exec` passes it on: it execs `ray start`)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
        for node in ("b", "a"):
            if self.ns[node] in self.namespaces():
                self.kill_node(node)
        self.nodes.clear()
        if self.wire is not None:
            self.wire.stop()  # (EOF: it ends, and its taps with it)
            self.wire = None
        for node in ("a", "b"):
            ip("netns", "del", self.ns[node], check=False)
        for pid in self.started:
            try:
                os.waitpid(pid, os.WNOHANG)  # (our children: no zombies left)
            except ChildProcessError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)
        left = self.leftovers()
        if check and left:
            raise RuntimeError(f"two-node cluster not fully torn down: {left}")

    @staticmethod
    def namespaces() -> list[str]:
        res = ip("netns", "list", check=False)
        return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]

    def leftovers(self) -> list[str]:
        """What of the cluster still exists: namespaces, links (seen from here), processes it started."""
        out = [f"namespace {n}" for n in self.ns.values() if n in self.namespaces()]
        links = ip("-o", "link", "show", check=False).stdout
        out += [f"link {n}" for n in self.link.values() if re.search(rf"\d+: {n}[@:]", links)]
        out += [f"process {pid}" for pid in self.started if _alive(pid)]
        if self.temp.exists():
            out.append(f"folder {self.temp}")
        return out

    def __enter__(self) -> "TwoNodes":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down(check=exc[0] is None)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped, does not count)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status.lower()
