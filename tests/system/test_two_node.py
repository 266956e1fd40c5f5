"""The Ray launcher across two nodes, each a network namespace of this machine (scripts/netns.py).

Node A (10.213.X.1) holds the Ray head, the driver, the buffer, the weight-sync service and the
learner; node B (10.213.X.2) a Ray worker with the generator and the scorer, placed there by the
nodes' custom resources (`--ray.<role>.resources`). Neither node can reach the other's loopback,
so the run only completes if every address a role binds or hands out is its node's own.

One run shows it all, to stay within the time budget: the demo trains across the nodes with
CurveZMQ on (`run.curve auto`: the services bind non-loopback addresses) and the weights
broadcast from A to B over gloo; mid-run every process of node B is SIGKILLed at once (its
raylet, Ray's workers, the generator and its vLLM engine, the scorer), as a machine that loses
power; the driver sees the roles' actors lost and waits; a replacement node B joins, the
generator and the scorer start again there, catch up with the weights, and the run completes
with no prompt group lost or trained twice (the ledger audit). Then `launch.ray scale
--generators 2` places a second generator on the node with room for it (B: the generators'
resources name it), and it catches up with the weights before its first lease. The last test
tears the cluster down and checks that no namespace, link or process of it remains.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from scripts.netns import SMALL_CPUS, TwoNodes, placement_flags, unavailable
from tests.helpers.cluster import metrics, run_status, stop_driver, wait_for
from tests.helpers.procs import ROOT

PY = sys.executable
# node B is lost after KILL_AT learner steps; after the replacement joins, the run is scaled to 2
# generators, and the steps left give the second vLLM engine time to start beside the first. Both
# engines start on B at once; the first ready drives the run at ~0.2 s a step, and the second was
# ready 11 s later (36 s after its start) in one run: 50 steps left were over 0.35 s before it
# was. With 230 left, it has ~45 s.
STEPS = 240
KILL_AT = 8

WHY = unavailable()
needs_namespaces = pytest.mark.skipif(bool(WHY), reason=WHY or "")


def test_custom_resources_pin_roles_and_curve_auto_follows_the_placed_services(monkeypatch):
    """No cluster: `ray.<role>.resources` go into the role's bundle; `run.curve auto` is decided by
    the IPs the services were placed on (on unless all are loopback), `on`/`off` stay."""
    from common.config import ConfigError
    from launch.cluster.config import decide_curve, load

    monkeypatch.chdir(ROOT)
    rcfg, run = load("examples/demo.yaml", ["--learner.model_path", ".", "--buffer.prompts", "examples/demo.yaml",
                                            *placement_flags("a", "b")])
    assert rcfg.learner.bundle() == {"CPU": 1.0, "node_a": 1.0} and rcfg.generator.bundle()["node_b"] == 1.0
    assert run.buffer.curve == "off"  # decided from the configured 127.0.0.1, before placement
    assert decide_curve(run, ["10.213.1.1", "10.213.1.1"]) and run.weight_sync.curve == "on"
    assert not decide_curve(run, ["127.0.0.1", "localhost"]) and run.buffer.curve == "off"
    run.run.curve = "off"
    assert not decide_curve(run, ["10.213.1.1"]) and run.buffer.curve == "off"
    with pytest.raises(ConfigError, match="CPU are set with num_cpus"):
        load("examples/demo.yaml", ["--learner.model_path", ".", "--ray.scorer.resources", "{CPU: 2}"])


@pytest.fixture(scope="module")
def nodes():
    """Two namespaces with a Ray node each, starting in the background while `demo` builds the model."""
    cluster = TwoNodes().up()
    try:
        cluster.start_head()
        cluster.start_worker()
        yield cluster
    finally:
        cluster.down(check=False)  # (test_nothing_is_left_behind checks it)


@pytest.fixture(scope="module")
def demo(nodes, tmp_path_factory):
    """The demo's prompts and warm-started tiny model (as launch.demo builds them), on the cluster."""
    from demo.arithmetic import warm_demo

    demo = warm_demo(tmp_path_factory.mktemp("two_node_demo"))
    nodes.wait_ready("a")
    nodes.wait_ready("b")
    return demo


def launch_argv(nodes: TwoNodes, demo: dict, run_dir: Path, *extra: str) -> list[str]:
    return [PY, "-m", "launch.ray", str(ROOT / "examples" / "demo.yaml"), "--ray.address", nodes.address,
            "--learner.model_path", demo["model"], "--buffer.prompts", demo["prompts"],
            "--generator.stop_token_ids", str(demo["newline"]), "--run.run_dir", str(run_dir),
            # the namespaces share this machine's /dev/shm, which two real machines do not: the
            # weights must cross the link, whatever the default of weight_sync.same_host
            "--weight_sync.same_host", "broadcast", *placement_flags("a", "b"), *SMALL_CPUS, *extra]


@needs_namespaces
@pytest.mark.slow
def test_a_run_across_two_nodes_survives_losing_one(nodes, demo, tmp_path):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "launch_ray.log"
    t0 = time.monotonic()
    driver = nodes.popen("a", launch_argv(nodes, demo, run_dir, "--learner.total_steps", str(STEPS),
                                          "--learner.save_every", "0", "--buffer.lease_ttl_s", "15",
                                          "--ray.restart_delay_s", "1", "--run.stall_timeout_s", "300"),
                         log_path, cwd=ROOT)
    a, b = nodes.addr["a"], nodes.addr["b"]
    try:
        def progressed():
            assert driver.poll() is None, log_path.read_text(errors="replace")[-4000:]
            return len(metrics(run_dir)) >= KILL_AT

        wait_for(progressed, 400, f"the learner's step {KILL_AT}", poll_s=0.2)
        before = {r["name"]: r for r in run_status(run_dir)["roles"]}
        killed = nodes.kill_node("b")
        lost_at = len(metrics(run_dir))
        # the driver notices (the roles' actors lost) and waits for a node that can hold them
        wait_for(lambda: any(r.get("waiting_for_node") for r in run_status(run_dir).get("roles", [])), 120,
                 "the driver to notice node B is gone (a role waiting for a node)")
        nodes.start_worker()  # the replacement
        nodes.wait_ready("b")
        sc = nodes.run("a", [PY, "-m", "launch.ray", "scale", "--run", "run", "--generators", "2",
                             "--address", nodes.address], cwd=ROOT)
        assert sc.returncode == 0 and "generators 1 -> 2" in sc.stdout, sc.stdout + sc.stderr[-3000:]
        driver.wait(timeout=600)
    finally:
        stop_driver(driver)
    wall = time.monotonic() - t0
    out = log_path.read_text(errors="replace")
    assert driver.returncode == 0, out[-4000:]
    assert lost_at < STEPS and killed >= 3, (lost_at, killed)  # a raylet, the roles, their engines...

    # the run completed every step
    from launch.ledger import audit

    assert [r["step"] for r in metrics(run_dir)] == list(range(STEPS)), out[-2000:]

    # each role ran on the node its resources named, and every address it was given is that node's
    final = run_status(run_dir)
    roles = {r["name"]: r for r in final["roles"]}
    for name in ("buffer", "weight_sync", "learner-0"):
        assert before[name]["node"] == roles[name]["node"] == a, roles[name]
    for name in ("generator-0", "scorer-0"):
        assert before[name]["node"] == roles[name]["node"] == b, roles[name]
    host, port = final["buffer"].rsplit(":", 1)
    assert host == a and final["weight_sync"].startswith(f"{a}:"), final
    assert roles["buffer"]["ready"]["control"] == f"tcp://{a}:{port}"
    gen_cfg = yaml.safe_load((run_dir / "configs" / "generator-0.yaml").read_text())
    assert (gen_cfg["generator"]["buffer_host"], gen_cfg["generator"]["weight_sync_host"]) == (a, a)

    # CurveZMQ was on (run.curve auto, services on non-loopback addresses): the run's keys, every
    # role's config says so, and the generator on B made its own key to dial the buffer on A
    assert gen_cfg["buffer"]["curve"] == gen_cfg["weight_sync"]["curve"] == "on"
    assert (run_dir / "keys" / "server.pub").is_file() and (run_dir / "keys" / "gen-0.pub").is_file()
    assert "CurveZMQ on" in (run_dir / "logs" / "launcher.log").read_text()

    # node B's roles were lost with it, waited for the replacement node, and started again there
    # (one restart each); the new generator took the learner's weights across the nodes (gloo,
    # from rank 0 on A) before it generated, and served until the end
    for name in ("generator-0", "scorer-0"):
        assert (roles[name]["restarts"], roles[name]["starts"]) == (1, 2), roles[name]
        assert roles[name]["pid"] != before[name]["pid"]
    gen = roles["generator-0"]["ready"]
    assert gen["final"] and gen["version"] >= lost_at - 1 and gen["samples"] > 0, gen
    assert json.loads((run_dir / "exit.json").read_text())["restarts"] == 2

    # the generator added by `scale` went to node B (generator 0.75 + scorer 0.5 + generator 0.75
    # of its 2 CPUs) and had the learner's weights of then when it became ready
    added = roles["generator-1"]
    assert added["node"] == b and added["ready"]["worker_id"] == "gen-1", added
    assert added["ready"]["version"] >= lost_at - 1 and added["ready"]["samples"] > 0, added

    # no prompt group was lost with node B, and none was trained twice
    acc = audit(run_dir)
    assert acc["groups_lost"] == 0 and acc["groups_trained_twice"] == 0 and acc["missing_steps"] == [], acc
    print(f"two-node run: {STEPS} steps, node B lost after {lost_at}, scaled to 2 generators; wall {wall:.0f}s")


@needs_namespaces
def test_nothing_is_left_behind(nodes):
    """Teardown: every process of the cluster ends, its namespaces and link are gone."""
    started = list(nodes.started)
    assert nodes.pids("a"), "the head's namespace should hold the head's processes"
    nodes.down()
    assert nodes.leftovers() == []
    assert not set(nodes.ns.values()) & set(TwoNodes.namespaces())
    for pid in started:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
