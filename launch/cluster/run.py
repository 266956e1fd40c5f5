"""One attempt of a `launch.ray` run: start the planned roles on their bundles, supervise, stop all.

1. `launch`: the run's device plan on the cluster's alive nodes (launch/cluster/devices.py: a run
   that does not fit is refused with the numbers), the controller actor (its name refuses a
   second run of the same name), every role's placement group and, in a colocated layout, the
   GPU groups (launch/cluster/placement.py), then the roles of `launch.roles.plan` in
   order: buffer and weight-sync service (each on its node's IP and free ports, discovered, then
   tied into every section that dials them; `run.curve auto` is decided from those IPs), scorers,
   generators, learner ranks (the rendezvous in their env), each with the GPUs the plan gives it
   (CUDA_VISIBLE_DEVICES: the ids Ray gave it or its devices' bundles; "" for none on a GPU
   cluster). The services and learner rank 0 must write their ready files.
2. `supervise`, every `ray.poll_s`: restart what is due, poll each process (exit code, ready
   record), decide what an exit means (`launch.roles.after_exit`: a generator or scorer is
   restarted while it has `ray.max_restarts` left; a learner rank, the buffer or the weight-sync
   service stops the attempt with `RunFailed`; a generator or scorer whose node was lost waits,
   uncounted, until its bundle is placed again on a node that joined), follow the controller's
   `scale` and `stop`, report (launch/cluster/status.py), watch the wall clock and the stall bound.
3. `shutdown`: learner first, the buffer last; then every actor and placement group is freed and
   the cluster has forgotten the actors' names, so a next attempt (`run.auto_resume`) can start.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launch.cluster.config import ResourceError, check_resources, decide_curve, resolved_text, tie_addresses
from launch.cluster.devices import RayDevices, cluster_nodes
from launch.cluster.placement import Placement, Slot
from launch.cluster.roles import CONTROLLER_PREFIX, RoleProcess, RunControl
from launch.cluster.scale import scale_to
from launch.cluster.status import StatusFeed
from launch.recovery import EXIT_CODES
from launch.roles import (
    ROOT,
    RestartPolicy,
    RoleSpec,
    State,
    after_exit,
    generator_spec,
    gone_for_good,
    plan,
    prepare_keys,
)


class RunFailed(RuntimeError):
    """A role the run cannot go on without failed; `kind` gives the exit code (EXIT_CODES). Not
    `resumable`: starting the run again would not help (run.max_wall_s is spent)."""

    def __init__(self, kind: str, message: str, resumable: bool = True):
        super().__init__(message)
        self.kind = kind
        self.resumable = resumable


@dataclass
class Proc:
    """One role process and the actor that holds it."""

    spec: RoleSpec
    slot: Slot | None = None
    seat: Any = None  # its entry in the device plan (launch/devices/plan.py Placement): devices, share
    gpus: list = field(default_factory=list)  # the GPU ids it was given on its node
    env: dict = field(default_factory=dict)  # on top of the spec's (a learner rank's rendezvous)
    actor: Any = None
    node: dict = field(default_factory=dict)
    pid: int | None = None
    start_time: str = ""
    restarts: int = 0
    starts: int = 0
    actors: int = 0  # actors made for it so far (a lost actor is replaced)
    state: State = State.NEW
    restart_at: float = 0.0
    code: int | None = None
    ready: dict | None = None  # what its ready file said
    waiting: bool = False  # to restart, for a node that can hold its bundle (its own was lost)

    @property
    def name(self) -> str:
        return self.spec.name


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
        self.run_name = rcfg.run_name or self.run_dir.name
        self.restart_policy = RestartPolicy(rcfg.max_restarts, rcfg.restart_delay_s)
        self.procs: list[Proc] = []
        self.placement = Placement(ray, rcfg, run, self.run_name, attempt)
        self.devices = None  # RayDevices: the device plan on this cluster, made by `launch`
        self.controller = None
        self.actor_names: list[str] = []  # every named actor of this attempt, the controller included
        self.next_generator = 0
        self.launched = False
        self.t0 = time.monotonic() if t0 is None else t0  # run.max_wall_s counts from the run's first start
        self.RoleActor = ray.remote(RoleProcess)
        self.Control = ray.remote(RunControl)
        self.feed = StatusFeed(self)
        self.mirror = self.feed.mirror

    # ---- actors ----------------------------------------------------------------------------

    def new_actor(self, proc: Proc) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        b = proc.slot.bundle  # (no GPU in a colocated layout's seat: the GPU group holds them)
        opts: dict[str, Any] = {
            "num_cpus": b.get("CPU", 0.0), "num_gpus": b.get("GPU", 0.0), "max_concurrency": 8, "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(proc.slot.pg,
                                                                    placement_group_bundle_index=proc.slot.index),
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
        proc.gpus = (self.placement.seat_gpus(proc.seat)
                     if proc.seat is not None and self.devices.seated(proc.spec.kind)
                     else list(proc.node["gpu_ids"]))
        if self.devices.gpu_cluster:  # ("": an actor that reserved none would otherwise see every GPU)
            proc.env["CUDA_VISIBLE_DEVICES"] = ",".join(proc.gpus)

    def add(self, spec: RoleSpec, slot: Slot, seat=None) -> Proc:
        """A role process on `slot`, in its `seat` of the device plan (its share; its GPUs in a
        colocated layout), with its actor."""
        p = Proc(self.devices.fit(spec, seat), slot=slot, seat=seat)
        self.new_actor(p)
        self.procs.append(p)
        return p

    def slot_for(self, spec: RoleSpec, groups: dict) -> tuple[Slot, Any]:
        """(where a planned role process goes, its seat in the device plan)."""
        seat = self.devices.seat(spec.name)
        if seat is not None and self.devices.seated(spec.kind):
            return self.placement.seat_slot(seat), seat
        return self.placement.take(groups[spec.kind]), seat

    def add_generator(self, slot: Slot, seat=None) -> Proc:
        i = self.next_generator
        self.next_generator += 1
        return self.add(generator_spec(self.run, i, "ray", self.restart_policy), slot,
                        seat if seat is not None else self.devices.seat(f"generator-{i}"))

    # ---- starting --------------------------------------------------------------------------

    def start(self, proc: Proc, wait: bool = True):
        """Start (or start again) the role's process in its actor; returns the actor's answer (or its
        future when `wait` is false). The actor waits for the ready file where the spec says so."""
        cfg_path = str(self.run_dir / "configs" / f"{proc.name}.yaml")
        ready = proc.spec.ready
        ref = proc.actor.start.remote(proc.spec.command(cfg_path), {**proc.spec.env, **proc.env},
                                      resolved_text(self.run, self.rcfg), cfg_path, os.getcwd(),
                                      ready.wait and ready.probe != "none", ready.timeout_s, proc.starts + 1)
        if not wait:
            return ref
        return self.started(proc, self.ray.get(ref))

    def started(self, proc: Proc, res: dict) -> dict:
        proc.pid, proc.start_time, proc.ready = res["pid"], res["start_time"], res["ready"]
        proc.starts += 1
        proc.state = State.RUNNING if res["ok"] else State.FAILED
        if not res["ok"]:
            proc.code = res["code"]
        return res

    def failed_to_start(self, p: Proc, res: dict) -> RunFailed:
        return RunFailed(p.spec.kind, f"role {p.name!r} exited with code {res['code']} (log: {res['log']} on "
                                      f"{p.node['ip']}): {res['detail']}")

    def start_service(self, proc: Proc, nports: int) -> None:
        """Give the service its node's IP and free ports there, then start it (again, with other
        ports, if it exited before it was ready: another process may have taken one meanwhile)."""
        section = getattr(self.run, proc.spec.kind)
        for attempt in range(3):
            section.host = proc.node["ip"]
            section.port = self.ray.get(proc.actor.free_ports.remote(nports))
            tie_addresses(self.run)
            res = self.start(proc)
            if res["ok"]:
                self.say(f"{proc.spec.kind} on {section.host}:{section.port} (node {proc.node['hostname']})")
                return
            if res["code"] is None or attempt == 2:
                raise self.failed_to_start(proc, res)

    def rendezvous(self, ranks: list[Proc]) -> None:
        """Rank 0's node and a free port there; local ranks counted per node; each rank sees its
        node's learner GPUs, in local-rank order, and takes its own (LOCAL_RANK)."""
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
            gpus = [g for q in local for g in q.gpus]
            if gpus:
                p.env["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(gpus))  # (colocated ranks: no repeats)

    def launch(self) -> None:
        """Place every role (all or nothing, before any starts), then start them in order: buffer,
        weight sync, scorers, generators, learner ranks."""

        r = self.run.run
        self.devices = self.placement.devices = self.plan_devices()
        if self.rcfg.check_resources:
            check_resources(self.placement.demands(), self.placement.alive_nodes())
        name = CONTROLLER_PREFIX + self.run_name
        try:
            self.ray.get_actor(name, namespace=self.rcfg.namespace)
            raise ResourceError(f"a run named {self.run_name!r} is already going on this cluster "
                                f"(namespace {self.rcfg.namespace!r}); set ray.run_name or run.run_dir")
        except ValueError:
            pass
        self.actor_names.append(name)
        # on the driver's node (Ray's `node:<ip>` resource; checked: a soft node affinity did not
        # keep it there): anywhere else, losing that node would take `scale` and `stop` with it
        ip = self.ray.util.get_node_ip_address()
        here = {f"node:{ip}": 0.001} if any(n["NodeManagerAddress"] == ip for n in self.ray.nodes()) else {}
        self.controller = self.Control.options(name=name, namespace=self.rcfg.namespace, num_cpus=0,
                                               max_concurrency=4, resources=here,
                                               ).remote(str(self.run_dir), r.num_generators)
        groups = self.placement.place_all()
        # `run.curve auto` is decided by where the services bind: their nodes' IPs, known now
        hosts = [self.placement.node_ip(groups[kind]) for kind in ("buffer", "weight_sync")]
        if decide_curve(self.run, hosts) and self.run.run.curve == "auto":
            self.say(f"CurveZMQ on: the services bind {', '.join(sorted(set(hosts)))} (run.curve auto)")
        prepare_keys(self.run)  # (CurveZMQ on: the run's keys, before any role starts)
        specs = plan(self.run, "ray", self.restart_policy)
        for spec in specs:
            if spec.kind in ("buffer", "weight_sync"):
                self.start_service(self.add(spec, *self.slot_for(spec, groups)), 4 if spec.kind == "buffer" else 1)
            elif spec.kind == "scorer":
                self.start(self.add(spec, *self.slot_for(spec, groups)))
            elif spec.kind == "generator":
                self.next_generator += 1
                self.start(self.add(spec, *self.slot_for(spec, groups)))
        ranks = [self.add(spec, *self.slot_for(spec, groups)) for spec in specs if spec.kind == "learner"]
        self.rendezvous(ranks)
        refs = [self.start(p, wait=False) for p in ranks]
        for p, ref in zip(ranks, refs):
            res = self.started(p, self.ray.get(ref))
            if not res["ok"]:
                raise self.failed_to_start(p, res)
        self.launched = True
        self.feed.publish(self.feed.report({}))
        resumed = f", resumed (attempt {self.attempt})" if self.run.learner.resume else ""
        self.say(f"run {self.run_dir}: {r.mode}, {r.num_generators} generator(s), {r.num_scorers} scorer(s), "
                 f"{r.learner_ranks} learner rank(s) on {len(self.placement.alive_nodes())} node(s){resumed}; "
                 f"logs in {self.run_dir / 'logs'} on each role's node; controller {name!r}")

    def plan_devices(self):
        """The run's device plan on the cluster's alive nodes (ResourceError with the numbers when
        it does not fit); its table goes to <run_dir>/device_plan.txt."""

        r = self.run.run
        listed = self.ray.nodes()
        nodes, notes = cluster_nodes(listed, r.gpus, r.gpu_memory_gb)
        devices = RayDevices.make(self.run, self.rcfg, nodes, notes,
                                  any(n.get("Alive") and n["Resources"].get("GPU", 0) for n in listed))
        text = devices.plan.table() + "".join(f"  note: {n}\n" for n in notes)
        (self.run_dir / "device_plan.txt").write_text(text)
        if devices.gpu_cluster:
            self.say(text.splitlines()[0] + f" (table: {self.run_dir / 'device_plan.txt'})")
        return devices

    def go(self) -> int:
        """One attempt: place and start every role, write the resolved config, supervise."""
        self.launch()
        (self.run_dir / "config.yaml").write_text(resolved_text(self.run, self.rcfg))
        return self.supervise()

    # ---- supervision -----------------------------------------------------------------------

    def poll(self) -> dict[str, tuple[int | None, bool]]:
        """{name: (exit code or None, actor lost)} for every process still supposed to run; notes
        each one's ready record as it appears."""
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        live = [p for p in self.procs if p.state in (State.RUNNING, State.STOPPING)]
        refs = [p.actor.probe.remote() for p in live]
        out = {}
        for p, ref in zip(live, refs):
            try:
                code, ready = self.ray.get(ref, timeout=30)
                p.ready = ready or p.ready
                out[p.name] = (code, False)
            except (GetTimeoutError, ActorUnavailableError):
                # no answer now (its node unreachable for a while: a partition): not lost, which
                # only Ray's verdict on the actor or its node (ActorDiedError) says
                pass
            except RayActorError:
                out[p.name] = (None, True)
        return out

    def supervise(self) -> int:
        """Until every learner rank is done (0); raises RunFailed for a role the run cannot lose,
        Stalled when no learner step came for run.stall_timeout_s, KeyboardInterrupt on `stop`."""
        from launch.recovery import ProgressWatch, buffer_diagnosis

        rcfg, r = self.rcfg, self.run.run
        learners = [p for p in self.procs if p.spec.kind == "learner"]
        watch = ProgressWatch(self.mirror, r.stall_timeout_s,
                              lambda: buffer_diagnosis(self.run.buffer.host, self.run.buffer.port),
                              first_grace_s=r.ready_timeout_s)  # as launch.local: engines start first
        while True:
            now = time.monotonic()
            for p in self.procs:
                if p.state == State.RESTARTING and now >= p.restart_at:
                    self.restart(p)
            for name, (code, lost) in self.poll().items():
                if code is not None or lost:
                    self.exited(next(q for q in self.procs if q.name == name), code, lost)
            if all(p.state == State.DONE for p in learners):
                return 0
            for kind in ("generator", "scorer"):
                mine = [p for p in self.procs if p.spec.kind == kind]
                if gone_for_good([p.state for p in mine]):
                    last = mine[-1]
                    raise RunFailed(kind, f"every {kind} has exited (last: {last.name!r} with code {last.code}, "
                                          f"log {self.run_dir / 'logs' / last.spec.log_name} on {last.node.get('ip')})")
            try:
                wanted, why = self.ray.get([self.controller.wanted_generators.remote(),
                                            self.controller.stop_reason.remote()], timeout=30)
            except Exception as e:  # noqa: BLE001 (the run goes on without `scale`)
                wanted, why = None, ""
                self.say(f"controller not answering ({type(e).__name__}); scaling is off for now")
            if wanted is not None:
                scale_to(self, wanted)
            if why:
                raise KeyboardInterrupt(why)
            self.feed.tick()
            if r.max_wall_s and time.monotonic() - self.t0 > r.max_wall_s:
                raise RunFailed("learner", f"run exceeded run.max_wall_s={r.max_wall_s}", resumable=False)
            watch.check()
            time.sleep(rcfg.poll_s)

    def exited(self, p: Proc, code: int | None, lost: bool) -> None:
        p.code = code
        where = f"log {self.run_dir / 'logs' / p.spec.log_name} on {p.node.get('ip')}"
        what = ("lost its actor (its node is gone, or the actor was killed)" if lost
                else f"exited with code {code}")
        if p.state == State.STOPPING:
            p.state = State.STOPPED
            self.retire(p)
            return
        p.state = after_exit(p.spec, p.restarts, code, lost)
        if p.state == State.DONE:
            if p.spec.kind == "generator":
                self.say(f"{p.name} finished")  # the buffer said done, or it was asked to stop
            return
        if p.spec.required:
            tail = "" if lost else "\n" + self.tail(p)
            kind = "disk" if code == EXIT_CODES["disk"] else p.spec.kind  # (out of disk space, whichever role)
            raise RunFailed(kind, f"role {p.name!r} {what} ({where}); the run cannot go on without it{tail}")
        if p.state == State.RESTARTING:
            p.restarts += 1
            p.restart_at = time.monotonic() + p.spec.restart.delay_s
            if lost:
                self.reap(p)
                p.actor = None
            self.say(f"{p.name} {what} ({where}); restart {p.restarts}/{p.spec.restart.max_restarts} "
                     f"in {p.spec.restart.delay_s:g}s")
        else:
            self.say(f"{p.name} {what} ({where}); no restarts left (ray.max_restarts={p.spec.restart.max_restarts})")

    def restart(self, p: Proc) -> None:
        from ray.exceptions import RayActorError

        if p.slot is not None and not self.placement.placed_now(p.slot):
            # its node is gone: wait (not counted as a restart) until Ray has placed the bundle on
            # a node that joined since; run.stall_timeout_s bounds the wait for the whole run
            if not p.waiting:
                need = ", ".join(f"{k} {v:g}" for k, v in p.slot.bundle.items())
                self.say(f"{p.name} waits for a node that can hold {{{need}}} (its node was lost)")
            p.waiting = True
            p.restart_at = time.monotonic() + max(p.spec.restart.delay_s, 1.0)
            return
        p.waiting = False
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

        from launch.process import kill_group

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
            self.placement.release(p.slot)
            p.slot = None

    def tail(self, p: Proc) -> str:
        try:
            return self.ray.get(p.actor.tail.remote(20), timeout=10)
        except Exception:
            return ""

    def helper_restarts(self) -> int:
        """Generator and scorer restarts of this attempt."""
        return sum(p.restarts for p in self.procs if p.spec.kind in ("generator", "scorer"))

    # ---- stopping --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every role (learner first, the buffer last), then free actors and placement groups;
        returns once the cluster has forgotten the actors' names (a next attempt takes them again)."""
        from ray.exceptions import RayActorError

        for kinds in (("learner",), ("generator", "scorer"), ("weight_sync", "buffer")):
            mine = [p for p in self.procs if p.spec.kind in kinds and p.actor is not None]
            for p, ref in [(p, p.actor.stop.remote()) for p in mine]:
                try:
                    self.ray.get(ref, timeout=60)
                    p.ready = self.ray.get(p.actor.probe.remote(), timeout=30)[1] or p.ready  # its last word
                except RayActorError:
                    self.reap(p)  # its actor died: end what it had started
                except Exception:  # noqa: BLE001 (stop everything else regardless)
                    pass
                if p.state in (State.RUNNING, State.RESTARTING, State.STOPPING):
                    p.state = State.STOPPED
        for p in self.procs:
            if p.actor is not None:
                self.ray.kill(p.actor)
                p.actor = None
        self.placement.remove_all()
        try:
            self.feed.publish(self.feed.report({}, finished=True), wait=True)
        except Exception:
            pass
        if self.controller is not None:
            self.ray.kill(self.controller)
            self.controller = None
        self.feed.close()
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
