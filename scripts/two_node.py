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

A bad network between the two (an emulated link, scripts/link.py; docs/ray.md "Network faults"):

    sudo .venv/bin/python scripts/two_node.py run examples/demo.yaml --link emulated --delay-ms 40 \
        --jitter-ms 20 --loss 0.01 --rate-mbit 20 ...                 # the whole run on that link
    sudo .venv/bin/python scripts/two_node.py run examples/demo.yaml --link emulated \
        --partition-at 90 --partition-s 20 ...                        # node B cut off 90 s in, for 20 s
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.netns import PARTITION_TOLERANT, TwoNodes, placement_flags, ray_env, unavailable  # noqa: E402

STATE = Path("/tmp/conveyor-two-node.json")


def start(tag: str = "", link: str = "veth") -> TwoNodes:
    why = unavailable(link)
    if why:
        sys.exit(f"two_node: {why}")
    # (on an emulated link, a partition must not turn into a node lost)
    cluster = TwoNodes(tag, link=link, env=PARTITION_TOLERANT if link == "emulated" else None).up()
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
    rn.add_argument("--link", choices=("veth", "emulated"), default="veth",
                    help="the link between the nodes: a veth pair, or the emulated link the options below impair")
    for flag, what in (("--delay-ms", "added one-way delay"), ("--jitter-ms", "+- this, uniform (order kept)"),
                       ("--loss", "probability each frame is dropped"), ("--rate-mbit", "bandwidth cap (0: none)"),
                       ("--partition-at", "seconds after the start: node B cut off (0: never)"),
                       ("--partition-s", "how long it stays cut off")):
        rn.add_argument(flag, type=float, default=20.0 if flag == "--partition-s" else 0.0, help=what)
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
    impair = {"delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms, "loss": args.loss, "rate_mbit": args.rate_mbit}
    if args.link == "veth" and (any(impair.values()) or args.partition_at):
        sys.exit("two_node: --delay-ms, --jitter-ms, --loss, --rate-mbit and --partition-at need --link emulated")
    cluster = start(link=args.link)
    t0 = time.monotonic()
    try:
        import subprocess

        if args.link == "emulated":
            cluster.impair(**impair)
        flags = placement_flags("b", "a") if args.reverse else placement_flags()
        argv = [sys.executable, "-m", "launch.ray", args.config, "--ray.address", cluster.address, *flags, *rest]
        driver = subprocess.Popen(cluster.exec_argv("a", argv), env=ray_env(**cluster.env), cwd=ROOT)
        if args.partition_at:
            try:
                driver.wait(timeout=args.partition_at)
            except subprocess.TimeoutExpired:
                cluster.partition()
                print(f"two_node: node B cut off for {args.partition_s:g}s", flush=True)
                try:
                    driver.wait(timeout=args.partition_s)
                except subprocess.TimeoutExpired:
                    pass
                cluster.heal()
                print("two_node: node B reachable again", flush=True)
        code = driver.wait()
        print(f"two_node: launch.ray exited with code {code} after {time.monotonic() - t0:.0f}s", flush=True)
        return code
    finally:
        cluster.down()


if __name__ == "__main__":
    sys.exit(main())
