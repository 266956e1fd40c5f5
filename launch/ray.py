"""Every role of a run on a Ray cluster: `python -m launch.ray CONFIG [--section.key VALUE ...]`.

The same roles as `launch.local` (buffer, weight sync, learner ranks, generators, scorers), each an
unchanged `python -m launch.X` process, started by a Ray actor that holds the role's resources on
its node (see launch/ray_roles.py). Section `ray:` of the config (launch/ray_config.py) says what
each process reserves (`--ray.generator.num_gpus 1`) and how a role's processes spread over nodes.

    python -m launch.ray CONFIG [--ray.address HOST:6379] [--section.key VALUE ...]
    ray job submit --address http://HEAD:8265 -- python -m launch.ray CONFIG ...
    python -m launch.ray scale --generators K [--run NAME] [--address A] [--wait]
    python -m launch.ray status [--run NAME] [--address A]

- The cluster: `--ray.address` or RAY_ADDRESS (set inside `ray job submit`); neither: a local
  cluster for this run only.
- Addresses are discovered: the buffer's and the weight-sync service's actors report their node's
  IP and free ports, and every role's resolved config (`<run_dir>/configs/<role>.yaml`) says them.
- Learner ranks: one actor per rank in one placement group; the launcher sets the rendezvous
  (MASTER_ADDR/MASTER_PORT of rank 0's node, RANK, WORLD_SIZE, LOCAL_RANK).
- A generator or scorer that dies is started again (`ray.max_restarts` times each; its leases expire
  and the buffer issues them again). A learner rank, the buffer or the weight-sync service dying
  stops the run; with `run.auto_resume N` the whole run is then started again by itself from the
  last checkpoint (every actor and placement group of the job is freed first, the cluster stays;
  addresses are discovered again), up to N times; without, go on from it with
  `--learner.resume true`. A run past `run.max_wall_s` (counted from its first start) is not resumed.
- A run whose learner finishes no step for `run.stall_timeout_s` (learner rank 0's metrics.jsonl
  stops growing) stops with exit code 8 and the buffer's account of why no batch comes; it is not
  resumed. Ctrl-C, SIGTERM and `launch.ray stop` are never resumed either (130).
- `scale` changes the number of generators of the running run (a new one catches up with the
  current weights before its first lease); `status` prints roles, nodes, restarts, step and reward.

Logs: `<run_dir>/logs/<role>.log` on the role's node; what the driver says (roles placed, restarts,
resumes, a stall) also goes to `<run_dir>/logs/launcher.log` on the driver's node, and
`<run_dir>/exit.json` gets the exit code with the counts of resumes and generator/scorer restarts.
Exit codes as `launch.local`: 0 done, 2 bad config or resources the cluster cannot give, 3 buffer,
4 weight sync, 5 learner, 6 generators, 7 scorers, 8 stalled, 130 interrupted.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launch.ray_config import ResourceError, check_resources, fmt_res, load, resolved_text, tie_addresses
from launch.recovery import EXIT_CODES, RESUMABLE, Stalled, launcher_log

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "{python}"  # replaced by the interpreter of the role's actor on its node
READY = {"buffer": "buffer ready", "weight_sync": "weight-sync service on"}


class RunFailed(RuntimeError):
    """A role the run cannot go on without failed; `kind` gives the exit code (EXIT_CODES). Not
    `resumable`: starting the run again would not help (run.max_wall_s is spent)."""

    def __init__(self, kind: str, message: str, resumable: bool = True):
        super().__init__(message)
        self.kind = kind
        self.resumable = resumable


class FinalExit(Exception):
    """An attempt's exit code that must end the run even where `run.auto_resume` would start it again."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


# --------------------------------------------------------------------------------------------
# placement: each role's processes in a placement group, one bundle per process


@dataclass
class Slot:
    """One bundle of a placement group: where one role process goes."""

    pg: Any
    index: int
    bundle: dict
    group: "Group"


@dataclass
class Group:
    """A placement group and which of its bundles are taken."""

    role: str
    pg: Any
    bundles: list[dict]
    keep: bool = True  # removed when its last slot is freed (generators added by `scale`) unless kept
    taken: set = field(default_factory=set)

    def free_slot(self) -> Slot | None:
        for i, b in enumerate(self.bundles):
            if i not in self.taken:
                return Slot(self.pg, i, b, self)
        return None


# --------------------------------------------------------------------------------------------
# the run


@dataclass
class Proc:
    """One role process and the actor that holds it."""

    name: str  # buffer, weight_sync, learner-0, generator-1, scorer-0 (also its log's name)
    kind: str  # buffer | weight_sync | learner | generator | scorer
    argv: list[str]
    slot: Slot | None = None
    env: dict = field(default_factory=dict)
    ready_line: str | None = None
    actor: Any = None
    node: dict = field(default_factory=dict)
    pid: int | None = None
    start_time: str = ""
    restarts: int = 0
    actors: int = 0  # actors made for it so far (a lost actor is replaced)
    state: str = "new"  # new | running | restarting | stopping | done | stopped | failed
    restart_at: float = 0.0
    code: int | None = None


class RayRun:
    """Places the roles, starts them in order, supervises them, scales the generators, stops all."""

    def __init__(self, rcfg, run, quiet: bool = False, say: Callable[[str], None] | None = None, attempt: int = 1,
                 t0: float | None = None):
        import ray

        self.ray = ray
        self.rcfg, self.run, self.quiet = rcfg, run, quiet
        self.say = say or (lambda msg: print(f"launch.ray: {msg}", file=sys.stderr, flush=True))
        self.attempt = attempt  # 1 + the resumes before it (run.auto_resume)
        self.run_dir = Path(run.run.run_dir)
        self.procs: list[Proc] = []
        self.groups: list[Group] = []
        self.controller = None
        self.actor_names: list[str] = []  # every named actor of this attempt, the controller included
        self.next_generator = 0
        self.placed = 0  # placement groups made so far (their names must differ)
        self.status = None
        # learner rank 0's metrics.jsonl (maybe on another node) copied here: its growth is the
        # learner's progress. Each attempt copies it from the start, so an earlier copy goes.
        self.mirror = self.run_dir / "ray" / "metrics.jsonl"
        self.mirror.unlink(missing_ok=True)
        self.metrics_offset = 0
        self.t0 = time.monotonic() if t0 is None else t0  # run.max_wall_s counts from the run's first start
        from launch.local import role_env
        from launch.ray_roles import RoleProcess, RunControl

        self.env = role_env(run.run.threads_per_role)
        self.RoleActor = ray.remote(RoleProcess)
        self.Control = ray.remote(RunControl)
        self.run_name = rcfg.run_name or self.run_dir.name

    # ---- placement -------------------------------------------------------------------------

    def bundle(self, kind: str) -> dict:
        r = getattr(self.rcfg, kind)
        return r.bundle(self.run.generator.tensor_parallel_size if kind == "generator" else 1)

    def demands(self) -> list[tuple[str, list[dict], str]]:
        r = self.run.run
        counts = {"buffer": 1, "weight_sync": 1, "scorer": r.num_scorers, "generator": r.num_generators,
                  "learner": r.learner_ranks}
        return [(k, [self.bundle(k)] * n, getattr(self.rcfg, k).strategy) for k, n in counts.items()]

    def alive_nodes(self) -> list[dict]:
        return [dict(n["Resources"]) for n in self.ray.nodes() if n.get("Alive")]

    def place(self, role: str, bundles: list[dict], strategy: str, timeout_s: float, keep: bool = True) -> Group:
        from ray.util.placement_group import placement_group, remove_placement_group

        # the attempt in the name: the last attempt's groups may still be going away
        pg = placement_group(bundles, strategy=strategy, name=f"{self.run_name}/{role}-{self.attempt}.{self.placed}")
        self.placed += 1
        if not pg.wait(timeout_s):
            remove_placement_group(pg)
            avail = self.ray.available_resources()
            raise ResourceError(
                f"role {role!r}: {len(bundles)} x {{" + ", ".join(fmt_res(k, v) for k, v in bundles[0].items())
                + f"}} ({strategy}) could not be placed within {timeout_s:.0f}s (ray.placement_timeout_s); "
                "free now: " + ", ".join(fmt_res(k, avail.get(k, 0.0)) for k in ("CPU", "GPU", "memory")))
        g = Group(role, pg, bundles, keep)
        self.groups.append(g)
        return g

    def take(self, group: Group) -> Slot:
        slot = group.free_slot()
        assert slot is not None, f"no free bundle in {group.role}'s placement group"
        group.taken.add(slot.index)
        return slot

    def release(self, slot: Slot) -> None:
        from ray.util.placement_group import remove_placement_group

        g = slot.group
        g.taken.discard(slot.index)
        if not g.taken and not g.keep:
            remove_placement_group(g.pg)
            self.groups.remove(g)

    def new_actor(self, proc: Proc) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = proc.slot.bundle
        opts: dict[str, Any] = {
            "num_cpus": b.get("CPU", 0.0), "num_gpus": b.get("GPU", 0.0), "max_concurrency": 8, "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(proc.slot.pg, placement_group_bundle_index=proc.slot.index),
            "runtime_env": {"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}},
        }
        if b.get("memory"):
            opts["memory"] = b["memory"]
        # named, so `ray.get_actor("<run>:<role>:<n>", namespace=...)` finds it (n: actors it had before)
        opts["name"] = f"{self.run_name}:{proc.name}:{proc.actors}"
        opts["namespace"] = self.rcfg.namespace
        self.actor_names.append(opts["name"])
        proc.actors += 1
        proc.actor = self.RoleActor.options(**opts).remote(proc.name, str(self.run_dir / "logs"))
        proc.node = self.ray.get(proc.actor.node.remote(), timeout=self.rcfg.placement_timeout_s)
        # the address the node registered with the cluster (`ray start --node-ip-address`, or the one
        # Ray found): what every other node reaches it by
        for n in self.ray.nodes():
            if n["NodeID"] == proc.node["node_id"] and n.get("NodeManagerAddress"):
                proc.node["ip"] = n["NodeManagerAddress"]

    # ---- starting --------------------------------------------------------------------------

    def start(self, proc: Proc, wait_ready: bool = True):
        """Start (or start again) the role's process in its actor; returns the actor's answer (or its
        future when `wait_ready` is false)."""
        text = resolved_text(self.run, self.rcfg)
        cfg_path = str(self.run_dir / "configs" / f"{proc.name}.yaml")
        argv = [a.replace("{config}", cfg_path) for a in proc.argv]
        env = {**self.env, **proc.env}
        ref = proc.actor.start.remote(argv, env, text, cfg_path, os.getcwd(), proc.ready_line,
                                      self.run.run.ready_timeout_s, proc.restarts + 1)
        if not wait_ready:
            return ref
        return self.started(proc, self.ray.get(ref))

    def started(self, proc: Proc, res: dict) -> dict:
        proc.pid, proc.start_time = res["pid"], res["start_time"]
        proc.state = "running" if res["ok"] else "failed"
        if not res["ok"]:
            proc.code = res["code"]
        return res

    def start_service(self, proc: Proc, nports: int) -> None:
        """Give the service its node's IP and free ports there, then start it (again with other
        ports if another process took them meanwhile)."""
        section = getattr(self.run, proc.kind)
        for attempt in range(3):
            section.host = proc.node["ip"]
            section.port = self.ray.get(proc.actor.free_ports.remote(nports))
            tie_addresses(self.run)
            res = self.start(proc)
            if res["ok"]:
                self.say(f"{proc.kind} on {section.host}:{section.port} (node {proc.node['hostname']})")
                return
            if "Address already in use" not in res["detail"] or attempt == 2:
                raise RunFailed(proc.kind, f"role {proc.name!r} exited with code {res['code']} (log: {res['log']} "
                                           f"on {proc.node['ip']}): {res['detail']}")

    def plan_learners(self, group: Group) -> list[Proc]:
        """One actor per rank in the learner's placement group, with the rendezvous in their env."""
        r = self.run.run
        ranks = []
        for rank in range(r.learner_ranks):
            p = Proc(f"learner-{rank}", "learner", [PYTHON, "-m", "launch.learner", "{config}"],
                     ready_line="learner ready" if rank == 0 else None)
            p.slot = self.take(group)
            self.new_actor(p)
            ranks.append(p)
        # the rendezvous: rank 0's node and a free port there; local ranks counted per node
        master = ranks[0]
        port = self.ray.get(master.actor.free_ports.remote(1))
        by_node: dict[str, list[Proc]] = {}
        for p in ranks:
            by_node.setdefault(p.node["node_id"], []).append(p)
        for rank, p in enumerate(ranks):
            local = by_node[p.node["node_id"]]
            p.env = {"MASTER_ADDR": master.node["ip"], "MASTER_PORT": str(port), "RANK": str(rank),
                     "WORLD_SIZE": str(len(ranks)), "LOCAL_RANK": str(local.index(p)),
                     "LOCAL_WORLD_SIZE": str(len(local))}
            gpus = [g for q in local for g in q.node["gpu_ids"]]
            if gpus:  # each rank sees its node's learner GPUs, in local-rank order, and takes its own
                p.env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        self.procs += ranks
        return ranks

    def generator_proc(self, slot: Slot) -> Proc:
        i = self.next_generator
        self.next_generator += 1
        p = Proc(f"generator-{i}", "generator",
                 [PYTHON, "-m", "launch.generator", "{config}", "--generator.worker_id", f"gen-{i}",
                  "--generator.seed", str(self.run.generator.seed + i)], slot=slot)
        self.new_actor(p)
        self.procs.append(p)
        return p

    def launch(self) -> None:
        """Place every role (all or nothing, before any starts), then start them in order: buffer,
        weight sync, scorers, generators, learner ranks."""
        from launch.ray_roles import CONTROLLER_PREFIX

        r = self.run.run
        if self.rcfg.check_resources:
            check_resources(self.demands(), self.alive_nodes())
        name = CONTROLLER_PREFIX + self.run_name
        try:
            self.ray.get_actor(name, namespace=self.rcfg.namespace)
            raise ResourceError(f"a run named {self.run_name!r} is already going on this cluster "
                                f"(namespace {self.rcfg.namespace!r}); set ray.run_name or run.run_dir")
        except ValueError:
            pass
        self.actor_names.append(name)
        self.controller = self.Control.options(name=name, namespace=self.rcfg.namespace, num_cpus=0,
                                               max_concurrency=4).remote(str(self.run_dir), r.num_generators)
        groups = {kind: self.place(kind, bundles, strategy, self.rcfg.placement_timeout_s)
                  for kind, bundles, strategy in self.demands()}

        for kind, nports in (("buffer", 4), ("weight_sync", 1)):
            p = Proc(kind, kind, [PYTHON, "-m", f"launch.{kind}", "{config}"], ready_line=READY[kind],
                     slot=self.take(groups[kind]))
            self.new_actor(p)
            self.procs.append(p)
            self.start_service(p, nports)
        for i in range(r.num_scorers):
            p = Proc(f"scorer-{i}", "scorer", [PYTHON, "-m", "launch.scorer", "{config}", "--scorer.worker_id",
                                              f"scorer-{i}"], slot=self.take(groups["scorer"]))
            self.new_actor(p)
            self.procs.append(p)
            self.start(p)
        for _ in range(r.num_generators):
            self.start(self.generator_proc(self.take(groups["generator"])))
        ranks = self.plan_learners(groups["learner"])
        refs = [self.start(p, wait_ready=False) for p in ranks]
        for p, ref in zip(ranks, refs):
            res = self.started(p, self.ray.get(ref))
            if not res["ok"]:
                raise RunFailed("learner", f"role {p.name!r} exited with code {res['code']} (log: {res['log']} "
                                           f"on {p.node['ip']}): {res['detail']}")
        self.controller.set_report.remote(self.report({}))
        resumed = f", resumed (attempt {self.attempt})" if self.run.learner.resume else ""
        self.say(f"run {self.run_dir}: {r.mode}, {r.num_generators} generator(s), {r.num_scorers} scorer(s), "
                 f"{r.learner_ranks} learner rank(s) on {len(self.alive_nodes())} node(s){resumed}; logs in "
                 f"{self.run_dir / 'logs'} on each role's node; controller {name!r}")

    def go(self) -> int:
        """One attempt: place and start every role, write the resolved config, supervise."""
        self.launch()
        (self.run_dir / "config.yaml").write_text(resolved_text(self.run, self.rcfg))
        return self.supervise()

    # ---- supervision -----------------------------------------------------------------------

    def poll(self) -> dict[str, tuple[int | None, bool]]:
        """{name: (exit code or None, actor lost)} for every process still supposed to run."""
        from ray.exceptions import GetTimeoutError, RayActorError

        live = [p for p in self.procs if p.state in ("running", "stopping")]
        refs = [p.actor.poll.remote() for p in live]
        out = {}
        for p, ref in zip(live, refs):
            try:
                out[p.name] = (self.ray.get(ref, timeout=30), False)
            except RayActorError:
                out[p.name] = (None, True)
            except GetTimeoutError:
                pass
        return out

    def supervise(self) -> int:
        """Until every learner rank is done (0); raises RunFailed for a role the run cannot lose,
        Stalled when no learner step came for run.stall_timeout_s, KeyboardInterrupt on `stop`."""
        from launch.recovery import ProgressWatch, buffer_diagnosis

        rcfg, r = self.rcfg, self.run.run
        learners = [p for p in self.procs if p.kind == "learner"]
        watch = ProgressWatch(self.mirror, r.stall_timeout_s,
                              lambda: buffer_diagnosis(self.run.buffer.host, self.run.buffer.port),
                              first_grace_s=r.ready_timeout_s)  # as launch.local: engines start first
        while True:
            now = time.monotonic()
            for p in self.procs:
                if p.state == "restarting" and now >= p.restart_at:
                    self.restart(p)
            for name, (code, lost) in self.poll().items():
                p = next(q for q in self.procs if q.name == name)
                if code is None and not lost:
                    continue
                self.exited(p, code, lost)
            if all(p.state == "done" for p in learners):
                return 0
            for kind in ("generator", "scorer"):
                mine = [p for p in self.procs if p.kind == kind]
                if mine and all(p.state in ("failed", "stopped") for p in mine):
                    last = mine[-1]
                    raise RunFailed(kind, f"every {kind} has exited (last: {last.name!r} with code {last.code}, "
                                          f"log {self.run_dir / 'logs' / (last.name + '.log')} on {last.node.get('ip')})")
            try:
                wanted, why = self.ray.get([self.controller.wanted_generators.remote(),
                                            self.controller.stop_reason.remote()], timeout=30)
            except Exception as e:  # noqa: BLE001 (the run goes on without `scale`)
                wanted, why = None, ""
                self.say(f"controller not answering ({type(e).__name__}); scaling is off for now")
            if wanted is not None:
                self.scale_to(wanted)
            if why:
                raise KeyboardInterrupt(why)
            self.tick()
            if r.max_wall_s and time.monotonic() - self.t0 > r.max_wall_s:
                raise RunFailed("learner", f"run exceeded run.max_wall_s={r.max_wall_s}", resumable=False)
            watch.check()
            time.sleep(rcfg.poll_s)

    def exited(self, p: Proc, code: int | None, lost: bool) -> None:
        p.code = code
        where = f"log {self.run_dir / 'logs' / (p.name + '.log')} on {p.node.get('ip')}"
        what = ("lost its actor (its node is gone, or the actor was killed)" if lost
                else f"exited with code {code}")
        if p.state == "stopping":
            p.state = "stopped"
            self.retire(p)
            return
        if p.kind == "learner" and code == 0 and not lost:
            p.state = "done"
            return
        if p.kind in ("learner", "buffer", "weight_sync"):
            p.state = "failed"
            tail = "" if lost else "\n" + self.tail(p)
            raise RunFailed(p.kind, f"role {p.name!r} {what} ({where}); the run cannot go on without it{tail}")
        if p.kind == "generator" and code == 0 and not lost:
            p.state = "done"  # the buffer said done, or it was asked to stop
            self.say(f"{p.name} finished")
            return
        if p.restarts < self.rcfg.max_restarts:
            p.restarts += 1
            p.state = "restarting"
            p.restart_at = time.monotonic() + self.rcfg.restart_delay_s
            if lost:
                self.reap(p)
                p.actor = None
            self.say(f"{p.name} {what} ({where}); restart {p.restarts}/{self.rcfg.max_restarts} "
                     f"in {self.rcfg.restart_delay_s:g}s")
        else:
            p.state = "failed"
            self.say(f"{p.name} {what} ({where}); no restarts left (ray.max_restarts={self.rcfg.max_restarts})")

    def restart(self, p: Proc) -> None:
        from ray.exceptions import RayActorError

        try:
            if p.actor is None:
                self.new_actor(p)
            res = self.start(p)
        except RayActorError:
            res = {"ok": False, "code": None}
        if not res["ok"]:
            self.exited(p, res.get("code"), lost=res.get("code") is None)
            return
        self.say(f"{p.name} started again (pid {p.pid} on {p.node['ip']})")

    def reap(self, p: Proc) -> None:
        """A role's actor is gone: kill what it had started, if its node is still there."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from launch.ray_roles import kill_group

        if not p.pid or not p.node.get("node_id"):
            return
        task = self.ray.remote(kill_group).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(p.node["node_id"], soft=False))
        try:
            self.ray.get(task.remote(p.pid, p.start_time), timeout=15)
        except Exception:
            pass  # the node itself is gone, and its processes with it

    def retire(self, p: Proc) -> None:
        if p.actor is not None:
            self.ray.kill(p.actor)
            p.actor = None
        if p.slot is not None:
            self.release(p.slot)
            p.slot = None

    def scale_to(self, wanted: int) -> None:
        active = [p for p in self.procs if p.kind == "generator" and p.state in ("running", "restarting")]
        if wanted == len(active):
            return
        if wanted < len(active):
            for p in active[wanted:]:  # the newest go first
                self.say(f"scale: stopping {p.name} (it finishes its batch; its leases go back to the buffer)")
                if p.actor is None:  # waiting for a new actor after its old one was lost
                    p.state = "stopped"
                    self.retire(p)
                    continue
                p.state = "stopping"
                p.actor.stop.remote()
            return
        for _ in range(wanted - len(active)):
            slot = None
            for g in self.groups:
                if g.role == "generator" and (slot := g.free_slot()) is not None:
                    g.taken.add(slot.index)
                    break
            try:
                if slot is None:
                    b = self.bundle("generator")
                    if self.rcfg.check_resources:
                        check_resources([("generator", [b], "PACK")], self.alive_nodes())
                    # a short wait: the supervision loop is blocked meanwhile
                    slot = self.take(self.place("generator", [b], "PACK", min(30.0, self.rcfg.placement_timeout_s),
                                                keep=False))
                p = self.generator_proc(slot)
                self.start(p)
            except ResourceError as e:
                if slot is not None:
                    self.release(slot)
                now = len([p for p in self.procs if p.kind == "generator" and p.state in ("running", "restarting")])
                self.ray.get(self.controller.scale.remote(now))
                self.say(f"scale: cannot add a generator: {e}; staying at {now}")
                return
            self.say(f"scale: {p.name} started on {p.node['ip']} (pid {p.pid}); it catches up with the current "
                     "weights before its first lease")

    # ---- status ----------------------------------------------------------------------------

    def tick(self) -> None:
        """Mirror learner rank 0's metrics.jsonl (it may be on another node), feed the progress bar,
        and tell the controller how the run stands."""
        lead = next((p for p in self.procs if p.name == "learner-0"), None)
        mirror = self.mirror
        if lead is not None and lead.actor is not None:
            try:
                text, self.metrics_offset = self.ray.get(lead.actor.read_file.remote(
                    str(self.run_dir / "metrics.jsonl"), self.metrics_offset), timeout=10)
            except Exception:
                text = ""
            if text:
                mirror.parent.mkdir(parents=True, exist_ok=True)
                with open(mirror, "a") as f:
                    f.write(text)
        if self.status is None and not self.quiet:
            from launch.local import Status

            self.status = Status(self.run)
            self.status.metrics_path = mirror
        last = {}
        if self.status is not None:
            self.status.tick()
            last = self.status.last
        elif mirror.exists():
            from launch.local import read_metrics

            rows = read_metrics(mirror)
            last = rows[-1] if rows else {}
        self.controller.set_report.remote(self.report(last))

    def report(self, last: dict) -> dict:
        return {
            "run_name": self.run_name,
            "buffer": f"{self.run.buffer.host}:{self.run.buffer.port}",
            "weight_sync": f"{self.run.weight_sync.host}:{self.run.weight_sync.port}",
            "step": last.get("step"), "reward_mean": last.get("reward/mean"),
            "total_steps": self.run.learner.total_steps, "wall_s": round(time.monotonic() - self.t0, 1),
            "roles": [{"name": p.name, "state": p.state, "node": p.node.get("ip"), "host": p.node.get("hostname"),
                       "pid": p.pid, "restarts": p.restarts, "code": p.code} for p in self.procs],
        }

    def tail(self, p: Proc) -> str:
        try:
            return self.ray.get(p.actor.tail.remote(20), timeout=10)
        except Exception:
            return ""

    def helper_restarts(self) -> int:
        """Generator and scorer restarts of this attempt."""
        return sum(p.restarts for p in self.procs if p.kind in ("generator", "scorer"))

    # ---- stopping --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every role (learner first, the buffer last), then free actors and placement groups;
        returns once the cluster has forgotten the actors' names (a next attempt takes them again)."""
        from ray.util.placement_group import remove_placement_group

        from ray.exceptions import RayActorError

        for kinds in (("learner",), ("generator", "scorer"), ("weight_sync", "buffer")):
            mine = [p for p in self.procs if p.kind in kinds and p.actor is not None]
            for p, ref in [(p, p.actor.stop.remote()) for p in mine]:
                try:
                    self.ray.get(ref, timeout=60)
                except RayActorError:
                    self.reap(p)  # its actor died: end what it had started
                except Exception:  # noqa: BLE001 (stop everything else regardless)
                    pass
        for p in self.procs:
            if p.actor is not None:
                self.ray.kill(p.actor)
                p.actor = None
        for g in self.groups:
            remove_placement_group(g.pg)
        self.groups = []
        if self.controller is not None:
            try:
                self.ray.get(self.controller.set_report.remote({**self.report({}), "finished": True}), timeout=5)
            except Exception:
                pass
            self.ray.kill(self.controller)
            self.controller = None
        if self.status is not None:
            self.status.close()
            self.status = None
        self.await_names_free()

    def await_names_free(self, timeout_s: float = 30.0) -> None:
        """`ray.kill` returns before the cluster marks the actor dead and frees its name."""
        deadline = time.monotonic() + timeout_s
        for name in self.actor_names:
            while time.monotonic() < deadline:
                try:
                    self.ray.get_actor(name, namespace=self.rcfg.namespace)
                except ValueError:
                    break
                time.sleep(0.2)


def resume_hint(run_dir: Path, config_name: str) -> str:
    ckpts = sorted((int(p.name.split("_")[1]), p) for p in (run_dir / "checkpoints").glob("step_*")
                   if p.name.split("_")[1].isdigit())
    seen = f"the last one seen from here: {ckpts[-1][1]}" if ckpts else "none seen from here yet"
    return (f"to go on from learner rank 0's latest checkpoint in {run_dir / 'checkpoints'} ({seen}): "
            f"python -m launch.ray {config_name} [the same flags] --learner.resume true "
            "(the buffer picks up its saved state by itself), or with --run.auto_resume N to do it by itself")


def connect(rcfg) -> bool:
    """Join the cluster (or start a local one); True when this process started it."""
    import ray

    address = rcfg.address or os.environ.get("RAY_ADDRESS", "")
    kwargs = {"namespace": rcfg.namespace, "log_to_driver": False, "configure_logging": False}
    if address:
        ray.init(address=address, **kwargs)
        return False
    # "local": a new cluster; a bare ray.init() would join any Ray instance found on this machine.
    # Token authentication stays off unless RAY_AUTH_MODE asks for it: Ray 2.60 would otherwise
    # write ~/.ray/auth_token, which turns it on for every later `ray start` on the machine (and
    # breaks their clients that do not expect it). The roles' own sockets are unauthenticated anyway.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=rcfg.local_num_cpus or None, include_dashboard=False, **kwargs)
    return True


def attempt_code(go: Callable[[], int], say: Callable[[str], None]) -> int:
    """The exit code of one attempt `go` (launch and supervise), its reason said. Raises FinalExit for
    a failure that must end the run even with resumes left."""
    try:
        return go()
    except ResourceError as e:
        say(str(e))
        return EXIT_CODES["config"]
    except Stalled as e:  # a restart would stall the same way: the diagnosis says what to change
        say(f"stalled: {e}")
        return EXIT_CODES["stalled"]
    except RunFailed as e:
        say(str(e))
        code = EXIT_CODES.get(e.kind, 1)
        if not e.resumable:
            raise FinalExit(code) from None
        return code
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, `launch.ray stop`: never resumed
        say(f"{str(e) or 'interrupted'}, stopping every role")
        return 130


def run_ray(rcfg, run, config_name: str = "CONFIG", quiet: bool = False) -> int:
    """Place and start every role on the cluster, wait for the learner, stop everything; the exit code.
    With `run.auto_resume`, a learner, buffer or weight-sync failure frees the job's actors and
    placement groups and starts it again from the last checkpoint, on the same cluster."""
    import ray

    from launch.recovery import with_auto_resume, write_exit

    run_dir = Path(run.run.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    say = launcher_log(run_dir, "launch.ray")
    started = time.monotonic()
    try:
        own_cluster = connect(rcfg)
    except ConnectionError as e:
        print(f"launch.ray: cannot join the Ray cluster: {e}", file=sys.stderr, flush=True)
        return 1

    def on_sigterm(signum, frame):  # `ray job stop` and `kill` stop every role, as Ctrl-C does
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    attempts, restarts = 0, 0  # restarts: of generators and scorers, over every attempt

    def attempt() -> int:
        """One start of the whole job; its actors and placement groups are always freed after it."""
        nonlocal attempts, restarts
        attempts += 1
        job = RayRun(rcfg, run, quiet, say, attempt=attempts, t0=started)
        try:
            # each attempt writes the resolved configs again: learner.resume, the discovered ports
            return attempt_code(job.go, say)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the shutdown short
            try:
                job.shutdown()
            finally:
                restarts += job.helper_restarts()
                signal.signal(signal.SIGTERM, on_sigterm)

    # after ray.init, which installs its own SIGTERM handler (a bare sys.exit)
    old = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code, resumes = with_auto_resume(run, attempt, say)
    except FinalExit as e:
        code, resumes = e.code, attempts - 1
    except KeyboardInterrupt as e:  # during a shutdown, or between two attempts
        say(f"{str(e) or 'interrupted'}, stopping")
        code, resumes = 130, max(attempts - 1, 0)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if own_cluster:
                ray.shutdown()
        finally:
            signal.signal(signal.SIGTERM, old)
    if code in RESUMABLE:
        say("every role was stopped; " + resume_hint(run_dir, config_name))
    write_exit(run_dir, code, time.monotonic() - started, resumes=resumes, restarts=restarts)
    return code


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    if argv[0] in ("scale", "status", "stop"):
        from launch.ray_roles import control_main

        sys.exit(control_main(argv))
    from launch.config import ConfigError

    config_path = argv.pop(0) if not argv[0].startswith("--") else None
    try:
        rcfg, run = load(config_path, argv)
    except ConfigError as e:
        print(f"launch.ray: {e}", file=sys.stderr)
        sys.exit(EXIT_CODES["config"])
    sys.exit(run_ray(rcfg, run, config_path or "CONFIG"))


if __name__ == "__main__":
    main()
