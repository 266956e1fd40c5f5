"""Rehearse a two-machine run on one machine (root, iproute2): `python scripts/two_node.py up|down|run`.

Two network namespaces joined by a veth pair stand for two hosts (scripts/netns.py): node A
(10.213.X.1) holds the Ray head, node B (10.213.X.2) a Ray worker; each has only its loopback and
the link, so anything that binds or advertises 127.0.0.1 where another node must reach it fails
here as it would on a real cluster.

    sudo .venv/bin/python scripts/two_node.py up        # the cluster; prints its address, stays up
    sudo .venv/bin/python scripts/two_node.py exec a -- .venv/bin/ray status --address ADDRESS
    sudo .venv/bin/python scripts/two_node.py down      # kill everything of it, delete the namespaces
    sudo .venv/bin/python scripts/two_node.py run examples/demo.yaml --learner.model_path M ...

`run CONFIG [flags]` brings the cluster up, runs `python -m launch.ray CONFIG` as a driver on node A
with the buffer, the weight-sync service and the learner on node A and the generators and scorers
on node B (`--reverse`: the other way round; the nodes' custom resources `node_a` / `node_b`
decide), tears everything down and exits with the run's exit code. `up` remembers the cluster in
/tmp/conveyor-two-node.json for `exec` and `down`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.netns import TwoNodes, placement_flags, ray_env, unavailable  # noqa: E402

STATE = Path("/tmp/conveyor-two-node.json")


def start(tag: str = "") -> TwoNodes:
    why = unavailable()
    if why:
        sys.exit(f"two_node: {why}")
    cluster = TwoNodes(tag).up()
    try:
        cluster.start_head()
        cluster.wait_ready("a")
        cluster.start_worker()
        cluster.wait_ready("b")
    except BaseException:
        cluster.down(check=False)
        raise
    return cluster


def remembered() -> TwoNodes:
    if not STATE.exists():
        sys.exit(f"two_node: no cluster is up ({STATE} is missing)")
    st = json.loads(STATE.read_text())
    return TwoNodes(st["tag"], temp=st["temp"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/two_node.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    ex = sub.add_parser("exec", help="run a command on node a or b")
    ex.add_argument("node", choices=("a", "b"))
    ex.add_argument("command", nargs=argparse.REMAINDER)
    rn = sub.add_parser("run", help="up, one launch.ray run across the two nodes, down")
    rn.add_argument("config")
    rn.add_argument("--reverse", action="store_true", help="services and learner on node B, helpers on A")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "up":
        if STATE.exists():
            sys.exit(f"two_node: a cluster is up already ({STATE}); `down` it first")
        cluster = start()
        STATE.write_text(json.dumps({"tag": cluster.ns["a"][3:-1], "temp": str(cluster.temp)}))
        print(f"two_node: Ray head on {cluster.address} (namespace {cluster.ns['a']}), worker on "
              f"{cluster.addr['b']} (namespace {cluster.ns['b']})")
        return 0
    if args.cmd == "down":
        cluster = remembered()
        cluster.down(check=False)
        left = cluster.leftovers()
        STATE.unlink(missing_ok=True)
        print("two_node: down" + (f"; still there: {left}" if left else ", nothing left"))
        return 1 if left else 0
    if args.cmd == "exec":
        import subprocess

        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return subprocess.call(remembered().exec_argv(args.node, command), env=ray_env())
    cluster = start()
    t0 = time.monotonic()
    try:
        import subprocess

        flags = placement_flags("b", "a") if args.reverse else placement_flags()
        argv = [sys.executable, "-m", "launch.ray", args.config, "--ray.address", cluster.address, *flags, *rest]
        code = subprocess.call(cluster.exec_argv("a", argv), env=ray_env(), cwd=ROOT)
        print(f"two_node: launch.ray exited with code {code} after {time.monotonic() - t0:.0f}s", flush=True)
        return code
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
