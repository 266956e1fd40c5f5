"""Chaos: a long run with faults injected at random moments, auto-resume on, audited afterwards.

    .venv/bin/python bench/chaos.py [--steps 150] [--kills 10] [--faults kill,stop,disk] [--seed 0]
    .venv/bin/python bench/chaos.py --steps 300 --kills 20                       # every kind here
    .venv/bin/python bench/chaos.py --steps 120 --kills 6 --two-node --faults kill,stop,partition
    .venv/bin/python bench/chaos.py --steps 2000 --kills 8 --warm-steps 375 --sample-s 10 --no-clean  # soak

The same run is made twice from the same tiny model and prompts (the demo's config): once untouched
(`clean_wall_s`), once with `--kills` faults, one per slice of the steps at a random step and moment
in it, each of a kind drawn from `--faults`:

- `kill`: kill -9 of a role drawn at random (generator, scorer, learner, buffer, weight-sync
  service). Generators and scorers are restarted by the launcher; a learner, buffer or weight-sync
  kill restarts the whole run from its last checkpoint (`run.auto_resume`).
- `stop`: SIGSTOP of a random role (its whole process group: a generator with its engine) for
  `--stop-s` seconds, then SIGCONT: a process that hangs and comes back.
- `disk`: the run folder is a filesystem of its own (a tmpfs of `--disk-mb`; root), filled up by a
  ballast file for `--disk-s` seconds, then freed. The role that cannot write stops (exit code 9,
  naming the path); the launcher waits for space (`run.disk_wait_s`) and resumes.
- `partition` (`--two-node` only): the run goes across two network namespaces (`launch.ray`,
  scripts/netns.py, an emulated link); node B, with the generators and scorers, is cut off for
  `--partition-s` seconds, then back.

Afterwards the ledger is audited (`launch.ledger`): every step once, no group trained twice, none
lost, no rollout newer than the step it trained (negative staleness). Stalls are measured: the
longest time without a new learner step, and for each fault the time from its end to the next new
step; every stall must end within `run.stall_timeout_s` (no attempt ended 8, "stalled").

`--sample-s S` samples every role every S seconds (resident memory with its children, open file
descriptors) and the buffer's state folder, and reports them early (after warm-up) against late:
a soak shows whether anything grows with the run.

Prints progress to stderr and, last, one JSON line on stdout: faults (counts per kind), kills,
restarts, resumes, attempt_codes, reached_total_steps, groups_lost, groups_trained_twice,
negative_staleness_steps, longest_stall_s, recovery_s (per kind, the longest), wall_s,
clean_wall_s, overhead (wall_s / clean_wall_s), and with --sample-s the soak's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos_faults import FaultRunner, RunFolder, Sampler, role_pids  # noqa: E402

KINDS = ("kill", "stop", "disk", "partition")
ROLE_KINDS = ("generator", "scorer", "learner", "buffer", "weight_sync")
STALL_TIMEOUT_S = 600.0
DISK_FLAGS: list[str] = []  # with disk faults: how long the launcher waits for space before it resumes


def say(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


def steps_done(run_dir: Path) -> int:
    """Distinct learner steps in the ledger (a resumed run redoes some)."""
    from learner.ledger import read_ledger

    try:
        return len(read_ledger(run_dir / "ledger.jsonl"))
    except OSError:
        return 0


def run_flags(run_dir: Path, model: Path, prompts: Path, steps: int) -> list[str]:
    return [str(ROOT / "examples" / "demo.yaml"), "--run.run_dir", str(run_dir), "--learner.model_path", str(model),
            "--buffer.prompts", str(prompts), "--learner.total_steps", str(steps), "--learner.save_every", "10",
            "--buffer.prompts_per_step", "4", "--buffer.n_samples_per_prompt", "4",
            "--generator.groups_per_lease", "2", "--buffer.lease_ttl_s", "15", "--run.auto_resume", "100",
            "--run.max_restarts", "100", "--run.restart_delay_s", "1", "--run.stall_timeout_s", str(STALL_TIMEOUT_S),
            *DISK_FLAGS]


def start_local(run_dir: Path, model: Path, prompts: Path, steps: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "launch.local", *run_flags(run_dir, model, prompts, steps)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_two_node(nodes, run_dir: Path, model: Path, prompts: Path, steps: int, newline: int) -> subprocess.Popen:
    from scripts.netns import SMALL_CPUS, placement_flags

    argv = [sys.executable, "-m", "launch.ray", *run_flags(run_dir, model, prompts, steps),
            "--ray.address", nodes.address, "--generator.stop_token_ids", str(newline),
            "--weight_sync.same_host", "broadcast", "--ray.restart_delay_s", "1", *placement_flags("a", "b"),
            *SMALL_CPUS]
    return nodes.popen("a", argv, run_dir.parent / f"{run_dir.name}.out", cwd=ROOT)


def plan_faults(steps: int, n: int, kinds: list[str], rng: random.Random) -> list[tuple[int, str, str]]:
    """(learner step, kind, role kind) per fault: one per slice of the steps, at a random step in it."""
    width = (steps - 10) / max(n, 1)
    plan = []
    for i in range(n):
        kind = rng.choice(kinds)
        role = rng.choice(ROLE_KINDS) if kind in ("kill", "stop") else ""
        plan.append((5 + int(i * width + rng.random() * width), kind, role))
    return sorted(plan)


def chaos_run(name: str, out: Path, start, plan: list, faults: FaultRunner, sampler: Sampler | None,
              timeout_s: float, rng: random.Random) -> dict:
    """Start the run, inject `plan` as its steps pass, sample, wait for its end; what happened."""
    run_dir = out / name
    folder = RunFolder(run_dir, faults.disk_mb)  # (the clean run on the same kind of filesystem)
    folder.make()
    t0 = time.monotonic()
    proc = start(run_dir)
    done, active = [], None  # the faults injected; the one under way (kind, undo time)
    last_step, last_step_t, longest_stall = 0, t0, 0.0
    recovery: dict[str, float] = {}
    waiting: list[tuple[str, float]] = []  # (kind, when it ended) of faults not yet followed by a step
    todo = list(plan)
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeoutError(f"{name}: not finished within {timeout_s:.0f}s")
            step = steps_done(run_dir)
            if step > last_step:
                last_step, last_step_t = step, now
                for kind, ended in waiting:
                    recovery[kind] = max(recovery.get(kind, 0.0), now - ended)
                waiting = []
            if last_step:  # (from the first step on: the start-up is not a stall)
                longest_stall = max(longest_stall, now - last_step_t)
            if sampler is not None:
                sampler.maybe(run_dir, step)
            if active is not None and now >= active[1]:
                faults.undo(active[0], run_dir)
                waiting.append((active[0], time.monotonic()))
                active = None
            if active is None and todo and step >= todo[0][0]:
                at, kind, role = todo.pop(0)
                time.sleep(rng.random() * 2.0)  # a random moment within the step, not just at its end
                took = faults.inject(kind, role, run_dir)
                if took is None:
                    say(f"step {at}: no {kind} fault to inject ({role or 'no role'} not running)")
                else:
                    done.append({"step": steps_done(run_dir), "kind": kind, "what": took["what"]})
                    say(f"{kind} {took['what']} at step {done[-1]['step']}")
                    if took["for_s"]:
                        active = (kind, time.monotonic() + took["for_s"])
                    else:
                        waiting.append((kind, time.monotonic()))
            time.sleep(0.5)
        code = proc.returncode
    except BaseException:  # (past its bound, or the benchmark stopped): nothing left stopped, full or running
        if active is not None:
            faults.undo(active[0], run_dir)
        if proc.poll() is None:
            faults.kill_run(proc)
            proc.wait(timeout=60)
        folder.release(keep=out / f"{name}.kept")
        raise
    if active is not None:  # (the run ended while a fault was on)
        faults.undo(active[0], run_dir)
    wall = time.monotonic() - t0
    return {"code": code, "wall_s": wall, "faults": done, "longest_stall_s": longest_stall, "recovery_s": recovery,
            "folder": folder}


def negative_staleness_steps(run_dir: Path) -> int:
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        rows[r["step"]] = r  # the final lineage's row of each step
    return sum(1 for r in rows.values() if r["buffer/staleness_min"] < 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--kills", type=int, default=10, help="how many faults to inject (of every kind)")
    ap.add_argument("--faults", default="", help="kinds, comma-separated, of kill,stop,disk,partition "
                    "(default: kill,stop,disk as root, kill,stop otherwise; partition with --two-node)")
    ap.add_argument("--stop-s", type=float, default=30.0, help="how long a SIGSTOP lasts before SIGCONT")
    ap.add_argument("--disk-s", type=float, default=20.0, help="how long the disk stays full")
    ap.add_argument("--disk-mb", type=int, default=512, help="the run folder's filesystem size (disk faults)")
    ap.add_argument("--partition-s", type=float, default=20.0, help="how long node B is cut off")
    ap.add_argument("--two-node", action="store_true", help="run across two network namespaces (launch.ray)")
    ap.add_argument("--sample-s", type=float, default=0.0, help="sample every role's memory and descriptors")
    ap.add_argument("--warm-steps", type=int, default=0,
                    help="warm-start the tiny model first, as the demo does (default: 375 with --two-node, else 0)")
    ap.add_argument("--no-clean", action="store_true", help="skip the untouched run (no overhead figure)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_chaos"))
    args = ap.parse_args()
    # SIGTERM ends the benchmark through its `finally`s: faults undone, the run and the nodes stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    root = os.geteuid() == 0
    kinds = [k for k in args.faults.split(",") if k] or (["kill", "stop"] + (["disk"] if root else [])
                                                          + (["partition"] if args.two_node else []))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown fault kind(s) {bad}: choose from {', '.join(KINDS)}")
    if "disk" in kinds and not root:
        ap.error("disk faults mount a filesystem for the run folder: run as root, or leave `disk` out")
    if "partition" in kinds and not args.two_node:
        ap.error("a partition needs the two-node cluster: add --two-node")

    from demo.arithmetic import make_problems, warm_start, write_jsonl
    from demo.tiny_model import build_tiny_model, build_tokenizer
    from launch.ledger import audit

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    train = make_problems(3000, seed=0)
    prompts = write_jsonl(train, out / "train.jsonl")
    model = build_tiny_model(out / "model", seed=0)
    warm = args.warm_steps or (375 if args.two_node else 0)
    if warm:  # (the demo's warm start: the policy has rewards to learn from)
        model = warm_start(model, out / "warm", train, warm, seed=0, log_every=0)
    nodes = None
    if args.two_node:
        from scripts.netns import PARTITION_TOLERANT, TwoNodes, unavailable

        why = unavailable("emulated")
        if why:
            sys.exit(f"chaos: --two-node: {why}")
        nodes = TwoNodes(link="emulated", env=PARTITION_TOLERANT).up()  # (a partition is not a lost node)
        nodes.start_head()
        nodes.start_worker()
        nodes.wait_ready("a")
        nodes.wait_ready("b")
        newline = build_tokenizer().convert_tokens_to_ids("\n")

        def start(run_dir):
            return start_two_node(nodes, run_dir, model, prompts, args.steps, newline)
    else:
        def start(run_dir):
            return start_local(run_dir, model, prompts, args.steps)

    disk_mb = args.disk_mb if "disk" in kinds else 0
    if disk_mb:
        DISK_FLAGS[:] = ["--run.disk_wait_s", "600", "--run.disk_min_free_mb", str(min(64, disk_mb // 4))]
    faults = FaultRunner(ROLE_KINDS, stop_s=args.stop_s, disk_s=args.disk_s, disk_mb=disk_mb,
                         partition_s=args.partition_s, nodes=nodes, group=nodes is None, say=say,
                         rng=random.Random(args.seed + 1))
    try:
        clean = None
        if not args.no_clean:
            say(f"clean run: {args.steps} steps")
            clean = chaos_run("clean", out, start, [], faults, None, args.timeout_s, random.Random(args.seed))
            say(f"clean run: exit {clean['code']} in {clean['wall_s']:.0f}s")
            clean["folder"].release(keep=out / "clean.kept")
        rng = random.Random(args.seed)
        plan = plan_faults(args.steps, args.kills, kinds, rng)
        say(f"chaos run: {args.steps} steps, {len(plan)} faults of kinds {kinds}")
        sampler = Sampler(args.sample_s, role_pids) if args.sample_s > 0 else None
        chaos = chaos_run("chaos", out, start, plan, faults, sampler, args.timeout_s, rng)
        run_dir = out / "chaos"
        report = audit(run_dir)
        exit_info = json.loads((run_dir / "exit.json").read_text())
        negative = negative_staleness_steps(run_dir)
        chaos["folder"].release(keep=out / "chaos.kept")
    finally:
        if nodes is not None:
            nodes.down(check=False)
    counts = {k: sum(1 for f in chaos["faults"] if f["kind"] == k) for k in kinds}
    attempts = exit_info.get("attempts") or []
    result = {
        "steps": args.steps,
        "faults": counts,
        "kills": counts.get("kill", 0),
        "injected": [f"{f['kind']}:{f['what']}@{f['step']}" for f in chaos["faults"]],
        "restarts": exit_info.get("restarts"),
        "resumes": exit_info.get("resumes"),
        "attempt_codes": attempts,
        "exit_code": chaos["code"],
        "reached_total_steps": chaos["code"] == 0 and report["steps"] == args.steps and not report["missing_steps"],
        "groups_lost": report.get("groups_lost"),
        "groups_trained_twice": report["groups_trained_twice"],
        "groups_dropped": report.get("groups_dropped"),
        "negative_staleness_steps": negative,
        "longest_stall_s": round(chaos["longest_stall_s"], 1),
        "stall_bound_s": STALL_TIMEOUT_S,
        "stalls_within_bound": chaos["longest_stall_s"] < STALL_TIMEOUT_S and 8 not in attempts,
        "recovery_s": {k: round(v, 1) for k, v in chaos["recovery_s"].items()},
        "wall_s": round(chaos["wall_s"], 1),
        "clean_wall_s": round(clean["wall_s"], 1) if clean else None,
        "overhead": round(chaos["wall_s"] / clean["wall_s"], 2) if clean else None,
        "command": "python bench/chaos.py " + " ".join(sys.argv[1:]),
    }
    if sampler is not None:
        result["soak"] = sampler.summary(args.steps)
        sampler.write(out / "samples.jsonl")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
