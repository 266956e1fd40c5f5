"""What a bad network costs a run: the demo across two nodes on an emulated link, once per fault, timed.

    sudo .venv/bin/python bench/network_faults.py [--steps 20] [--partition-steps 60] [--partition-s 20]
    sudo .venv/bin/python bench/network_faults.py --faults clean,latency --delay-ms 100 --jitter-ms 20

Two network namespaces joined by an emulated link (scripts/netns.py `TwoNodes(link="emulated")`,
scripts/link.py), a Ray node in each; `launch.ray` runs the demo with the buffer, the weight-sync
service and the learner on node A. Each run is timed from the driver's start to its exit:

- `clean`: the generator and the scorer on node B, the link untouched;
- `latency`, `loss`, `bandwidth`: the same, the link impaired for the whole run
  (`--delay-ms`/`--jitter-ms`, `--loss`, `--rate-mbit`): every lease, rollout, score and weight
  broadcast crosses it;
- `clean2`: one generator on each node and the scorer on A, `--partition-steps` steps, untouched
  (`weight_sync.timeout_s` `--weight-sync-timeout-s`: a cut during a round holds a publish that long);
- `partition`: the same, node B cut off for `--partition-s` seconds once both generators serve
  and the learner has made 3 steps, then healed.

Prints, last, one JSON line: for each fault its wall seconds, `steps_s` (from the learner's first
step to its last: the run without the engines' start), exit code, the ledger audit's verdict and
the link's frame counters; `ratio` and `steps_ratio`: each over its clean run's (`clean` for the
first three, `clean2` for the partition): what the fault costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo.arithmetic import warm_demo  # noqa: E402
from scripts.netns import PARTITION_TOLERANT, SMALL_CPUS, TwoNodes, placement_flags, unavailable  # noqa: E402

FAULTS = ("clean", "latency", "loss", "bandwidth", "clean2", "partition")


def say(msg: str) -> None:
    print(f"[network_faults] {msg}", file=sys.stderr, flush=True)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def steps_done(run_dir: Path) -> int:
    try:
        return sum(1 for _ in open(run_dir / "metrics.jsonl"))
    except OSError:
        return 0


def steps_s(run_dir: Path) -> float | None:
    """Seconds from the learner's first step to its last (the run without its start and its end)."""
    try:
        times = [json.loads(line)["time"] for line in open(run_dir / "metrics.jsonl") if line.strip()]
    except (OSError, ValueError, KeyError):
        return None
    return round(times[-1] - times[0], 1) if len(times) > 1 else None


def both_serving(run_dir: Path) -> bool:
    roles = {r["name"]: r for r in read_json(run_dir / "status.json").get("roles", [])}
    gens = [roles.get(f"generator-{i}", {}).get("ready", {}) for i in (0, 1)]
    return steps_done(run_dir) >= 3 and all(g.get("samples") for g in gens)


def one_run(nodes: TwoNodes, demo: dict, work: Path, fault: str, args) -> dict:
    run_dir = work / fault
    two = fault in ("clean2", "partition")
    steps = args.partition_steps if two else args.steps
    flags = (["--run.num_generators", "2", "--buffer.lease_ttl_s", str(args.lease_ttl_s),
              "--weight_sync.timeout_s", str(args.weight_sync_timeout_s),
              *placement_flags("a", "b", generator="{gen: 1}", scorer="{node_a: 1}")]
             if two else placement_flags("a", "b"))
    argv = [sys.executable, "-m", "launch.ray", str(ROOT / "examples" / "demo.yaml"), "--ray.address", nodes.address,
            "--learner.model_path", demo["model"], "--buffer.prompts", demo["prompts"],
            "--generator.stop_token_ids", str(demo["newline"]), "--run.run_dir", str(run_dir),
            "--learner.total_steps", str(steps), "--learner.save_every", "0", "--ray.restart_delay_s", "1",
            "--run.stall_timeout_s", "300", "--weight_sync.same_host", "broadcast", *SMALL_CPUS, *flags]
    nodes.clear()
    before = nodes.link_stats()["stats"]
    impair = {"latency": {"delay_ms": args.delay_ms, "jitter_ms": args.jitter_ms}, "loss": {"loss": args.loss},
              "bandwidth": {"rate_mbit": args.rate_mbit}}.get(fault)
    if impair:
        nodes.impair(**impair)
    say(f"{fault}: {steps} steps" + (f", link {impair}" if impair else ""))
    t0 = time.monotonic()
    driver = nodes.popen("a", argv, work / f"{fault}.log", cwd=ROOT)
    out: dict = {"steps": steps}
    try:
        if fault == "partition":
            deadline = time.monotonic() + 600
            while not both_serving(run_dir) and driver.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
            cut_at = steps_done(run_dir)
            nodes.partition()
            time.sleep(args.partition_s)  # (the fault's length)
            nodes.heal()
            out.update(partition_from_step=cut_at, steps_during_partition=steps_done(run_dir) - cut_at)
        code = driver.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        driver.terminate()
        code = driver.wait(timeout=120)
    finally:
        nodes.clear()
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["steps_s"] = steps_s(run_dir)
    out["code"] = code
    from launch.ledger import audit

    try:
        acc = audit(run_dir)
        out["audit_ok"] = acc["groups_lost"] == 0 and acc["groups_trained_twice"] == 0 and not acc["missing_steps"]
    except Exception as e:  # noqa: BLE001 (reported, not raised: the other runs still count)
        out["audit_ok"], out["audit_error"] = False, str(e)
    after = nodes.link_stats()["stats"]  # (the forwarder's counters run on: this run's share)
    out["link"] = {way: {k: after[way][k] - before[way][k] for k in ("sent", "lost", "overflow", "cut", "unsent")}
                   for way in after}
    say(f"{fault}: exit {code} after {out['wall_s']}s, audit {'ok' if out['audit_ok'] else 'FAILED'}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"which runs, of {','.join(FAULTS)}")
    ap.add_argument("--steps", type=int, default=20, help="learner steps of clean, latency, loss, bandwidth")
    ap.add_argument("--partition-steps", type=int, default=60, help="learner steps of clean2 and partition")
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--jitter-ms", type=float, default=20.0)
    ap.add_argument("--loss", type=float, default=0.02)
    ap.add_argument("--rate-mbit", type=float, default=20.0)
    ap.add_argument("--partition-s", type=float, default=20.0)
    ap.add_argument("--lease-ttl-s", type=float, default=10.0, help="buffer.lease_ttl_s of the two-generator runs")
    ap.add_argument("--weight-sync-timeout-s", type=float, default=10.0,
                    help="weight_sync.timeout_s of the two-generator runs: what a cut during a round costs at most")
    ap.add_argument("--warm-steps", type=int, default=375)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="the most one run may take")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders (in /tmp/network_faults_*)")
    args = ap.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        sys.exit(f"network_faults: unknown fault(s) {unknown}; of {FAULTS}")
    why = unavailable("emulated")
    if why:
        sys.exit(f"network_faults: {why}")
    work = Path(tempfile.mkdtemp(prefix="network_faults_"))
    nodes = TwoNodes(cpus=4, link="emulated", seed=0, env=PARTITION_TOLERANT).up()
    results: dict = {}
    try:
        nodes.start_head({"node_a": 100, "gen": 1})
        nodes.start_worker({"node_b": 100, "gen": 1})
        t0 = time.monotonic()
        demo = warm_demo(work, args.warm_steps)
        say(f"model ready in {time.monotonic() - t0:.0f}s; runs in {work}")
        nodes.wait_ready("a")
        nodes.wait_ready("b")
        for fault in faults:
            results[fault] = one_run(nodes, demo, work, fault, args)
    finally:
        nodes.down(check=False)
    ratio, steps_ratio = {}, {}
    for fault, r in results.items():
        base = results.get("clean2" if fault in ("clean2", "partition") else "clean")
        if base and base["code"] == 0 and fault not in ("clean", "clean2"):
            ratio[fault] = round(r["wall_s"] / base["wall_s"], 2)
            if r["steps_s"] and base["steps_s"]:
                steps_ratio[fault] = round(r["steps_s"] / base["steps_s"], 2)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"faults": results, "ratio": ratio, "steps_ratio": steps_ratio,
                      "settings": {k: getattr(args, k) for k in ("steps", "partition_steps", "delay_ms", "jitter_ms",
                                                                 "loss", "rate_mbit", "partition_s", "lease_ttl_s",
                                                                 "weight_sync_timeout_s")},
                      "leftovers": nodes.leftovers()}))
    return 0 if all(r["code"] == 0 and r["audit_ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
