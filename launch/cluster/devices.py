"""How `launch.ray` gives every role process the GPUs of the run's device plan (launch/devices/).

The plan is made once per attempt, before anything is placed, on the cluster's alive nodes
(`cluster_nodes`: each node's Ray `GPU` count; Ray does not report GPU memory, so it is
run.gpu_memory_gb, else DEFAULT_GPU_GB with a note), and a run that does not fit is refused with
the plan's numbers (exit code 2), as launch.local refuses it. `--plan` prints it without joining
any cluster (`offline_nodes`: $CONVEYOR_FAKE_GPUS, "2x8" = 2 nodes of 8, else this machine).
Then, by the plan's layout:

  separate   each process reserves the GPUs the plan gives it as Ray's `num_gpus` (a learner rank
             1, a generator generator.tensor_parallel_size, a GPU scorer 1), unless
             ray.<role>.num_gpus says otherwise; Ray's assignment is then disjoint by
             construction. Ray sets CUDA_VISIBLE_DEVICES in the role's actor to the ids it gave
             it (`ray.get_gpu_ids()`), and the launcher passes those ids on to the role process.
  colocate, colocate_scorers
             shares of one GPU, and engines spanning GPUs beside other processes, are no Ray
             reservation (a fractional request stays within one GPU; above 1 it must be whole).
             The run holds, for its life, one placement group per planned node (STRICT_PACK) with
             a bundle {GPU: 1} per GPU the plan uses there; a probe task per bundle (num_gpus 1)
             reports the id Ray gave that bundle. The role actors reserve no GPU: each sits in the
             bundle of its first device (which also holds its CPUs) and starts its process with
             CUDA_VISIBLE_DEVICES built from its planned devices mapped to those ids.
  cpu        the cluster has no GPU: nothing is reserved (an explicit ray.<role>.num_gpus still is).

On a GPU cluster a process without devices (buffer, weight sync, a CPU scorer) gets
CUDA_VISIBLE_DEVICES="": Ray 2.60 leaves the variable alone for an actor that reserved no GPU,
which would show it every GPU of its node. Learner ranks see their node's learner GPUs in
local-rank order (LOCAL_RANK picks theirs; NCCL sees its peers). A vLLM generator left without
a GPU on a GPU cluster is refused. The Ray facts, from Ray 2.60's sources:

- an actor's CUDA_VISIBLE_DEVICES is set from the ids of its own GPU resources, and left alone
  when it has none (python/ray/_private/utils.py `set_visible_accelerator_ids`, unless
  RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO);
- `ray.get_gpu_ids()` gives those ids, counted in the raylet's own CUDA_VISIBLE_DEVICES where it
  has one (python/ray/_private/worker.py `get_accelerator_ids_for_accelerator_resource`);
- a placement group bundle keeps the GPU instances it was given when it was committed: its
  `GPU_group_<i>_<pg>` resources are made from the instances allocated when it was prepared
  (src/ray/raylet/placement_group_resource_manager.cc `CommitBundle`), so every task placed in
  bundle i gets the same GPU id.

Pure: nothing here imports Ray; `launch.cluster.placement` places the groups and runs the probes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from launch.cluster.config import ResourceError
from launch.devices.gpus import FAKE_ENV, Gpu, Node, PlanError, local_gpus, parse_fake
from launch.devices.memory import demand_of
from launch.devices.plan import DevicePlan, make_plan
from launch.devices.plan import Placement as Seat
from launch.roles import RoleSpec, place
from weight_sync.groups import nccl_env

DEFAULT_GPU_GB = 80.0  # a cluster GPU's memory for the plan when run.gpu_memory_gb does not say
SHARED = ("colocate", "colocate_scorers")
KINDS = ("buffer", "weight_sync", "scorer", "generator", "learner")


def cluster_nodes(ray_nodes: list[dict], gpus: str = "auto", memory_gb: float = 0.0) -> tuple[list[Node], list[str]]:
    """The plan's nodes from `ray.nodes()`: every alive node with at least one GPU, the largest
    first (the plan packs learner ranks on the first nodes); and notes for the plan."""
    notes = []
    if gpus.strip() == "none":
        return [Node("cluster", [])], ["run.gpus none: every role on the CPU"]
    if gpus.strip() not in ("", "auto"):
        notes.append(f"run.gpus={gpus}: launch.ray uses the GPUs Ray gives (the list is for launch.local)")
    found = []
    for n in ray_nodes:
        res = n.get("Resources") or {}
        count = int(res.get("GPU", 0.0) + 1e-9)
        if not n.get("Alive") or count < 1:
            continue
        kind = next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), "")
        name = n.get("NodeManagerAddress") or str(n.get("NodeID", ""))[:12]
        found.append(Node(name, [Gpu(str(i), memory_gb or DEFAULT_GPU_GB, kind) for i in range(count)]))
    found.sort(key=lambda node: -len(node.gpus))  # (stable: Ray's order among equals)
    if found and not memory_gb:
        notes.append(f"Ray does not report GPU memory: the plan assumes {DEFAULT_GPU_GB:.0f} GiB per GPU "
                     "(give run.gpu_memory_gb)")
    return found or [Node("cluster", [])], notes


def offline_nodes(run, environ=None) -> tuple[list[Node], list[str]]:
    """`--plan`'s nodes, no cluster joined: $CONVEYOR_FAKE_GPUS (every node it names), else this
    machine's GPUs; and a note that says which."""
    environ = os.environ if environ is None else environ
    r = run.run
    fake = environ.get(FAKE_ENV, "").strip()
    if fake and r.gpus.strip() != "none":
        nodes = parse_fake(fake)
        if r.gpu_memory_gb:
            nodes = [Node(n.name, [replace(g, memory_gb=r.gpu_memory_gb) for g in n.gpus]) for n in nodes]
        return nodes, [f"planned on {FAKE_ENV}={fake}; a run plans on the Ray cluster's alive nodes"]
    return local_gpus(r.gpus, r.gpu_memory_gb, environ), ["planned on this machine's GPUs; a run plans on the "
                                                          "Ray cluster's alive nodes"]


def scorer_note(run, plan: DevicePlan) -> list[str]:
    """A note when the plan has GPUs but the scorers' models run on the CPU (scorer.device cpu)."""
    models = [k for k in ("reward_model", "reference") if k in run.scorer.kinds]
    if plan.layout == "cpu" or not models or str(run.scorer.device).startswith("cuda"):
        return []
    return [f"scorer.device {run.scorer.device}: the {run.run.num_scorers} scorer(s) run their "
            f"{' and '.join(models)} on the CPU; --scorer.device cuda puts them on GPUs"]


@dataclass
class RayDevices:
    """The run's device plan as Ray reservations (module docstring): what each process reserves,
    where a process of a colocated layout sits, what its environment gets."""

    plan: DevicePlan
    rcfg: object  # RayConfig
    tp: int = 1  # generator.tensor_parallel_size
    vllm: bool = True
    notes: list[str] = field(default_factory=list)
    gpu_cluster: bool = False  # the cluster has GPUs (whether or not the plan uses them: run.gpus none)
    round_timeout_s: float = 120.0  # weight_sync.timeout_s: the bound of a weight-sync NCCL group's waits

    @classmethod
    def make(cls, run, rcfg, nodes: list[Node], notes: list[str] = (), gpu_cluster: bool | None = None) -> "RayDevices":
        """The run's plan on `nodes`; ResourceError (exit code 2) with the numbers when it does not fit
        or the ray: section asks for something the plan cannot honour. `gpu_cluster`: whether the
        cluster has GPUs (default: whether `nodes` have)."""
        try:
            plan = make_plan(demand_of(run), nodes, run.run.placement)
        except PlanError as e:
            raise ResourceError(str(e)) from None
        out = cls.of(plan, run, rcfg, notes, gpu_cluster)
        errs = out.problems()
        if errs:
            raise ResourceError("; ".join(errs))
        return out

    @classmethod
    def of(cls, plan: DevicePlan, run, rcfg, notes: list[str] = (), gpu_cluster: bool | None = None) -> "RayDevices":
        """The run's `plan` as Ray reservations (not checked: `problems`)."""
        vllm = run.generator.engine == "vllm"
        gpu_cluster = any(n.gpus for n in plan.nodes) if gpu_cluster is None else gpu_cluster
        return cls(plan, rcfg, run.generator.tensor_parallel_size if vllm else 1, vllm,
                   [*notes, *scorer_note(run, plan)], gpu_cluster, run.weight_sync.timeout_s)

    @property
    def shared(self) -> bool:
        return self.plan.layout in SHARED

    def seated(self, kind: str) -> bool:
        """Whether the processes of `kind` sit on the run's GPU groups (a colocated layout, and the
        plan gives them devices)."""
        return self.shared and any(p.kind == kind and p.devices for p in self.plan.placements)

    def explicit(self, kind: str) -> bool:
        return "num_gpus" in getattr(self.rcfg, kind).model_fields_set

    def gpus(self, kind: str) -> float:
        """GPUs one process of `kind` reserves from Ray: ray.<kind>.num_gpus where given (x the
        engine's tensor-parallel size), else what the plan gives it in the separate layout, else 0."""
        if self.explicit(kind):
            return getattr(self.rcfg, kind).num_gpus * (self.tp if kind == "generator" else 1)
        if self.shared:
            return 0.0
        seat = next((p for p in self.plan.placements if p.kind == kind), None)
        return float(len(seat.devices)) if seat else 0.0

    def problems(self) -> list[str]:
        """What the ray: section asks that the plan cannot honour (on a GPU cluster)."""
        errs = []
        if not self.gpu_cluster:
            return errs
        for kind in KINDS:
            n = getattr(self.rcfg, kind).num_gpus
            if self.shared and self.explicit(kind) and n:
                errs.append(f"ray.{kind}.num_gpus={n:g} with run.placement {self.plan.layout}: colocated processes "
                            "get their GPUs from the device plan (the run's GPU groups), not as Ray reservations; "
                            f"leave ray.{kind}.num_gpus unset, or choose run.placement separate")
        g = self.rcfg.generator
        if self.vllm and not self.seated("generator"):
            if self.gpus("generator") <= 0:
                errs.append(
                    f"a vLLM generator on a GPU cluster with no GPU of its own (ray.generator.num_gpus="
                    f"{g.num_gpus:g}{', run.gpus none' if self.plan.layout == 'cpu' else ''}): Ray 2.60 leaves "
                    "CUDA_VISIBLE_DEVICES alone for an actor that reserved no GPU, so it would see every GPU of "
                    "its node and pile onto GPU 0 with the others; leave ray.generator.num_gpus unset (the plan "
                    "gives each engine generator.tensor_parallel_size GPUs) or choose run.placement colocate")
            elif self.explicit("generator") and self.tp > 1 and g.num_gpus != int(g.num_gpus):
                errs.append(f"ray.generator.num_gpus={g.num_gpus:g} with generator.tensor_parallel_size {self.tp}: "
                            f"an engine's {self.tp} workers need whole GPUs; give 1 (or leave it unset)")
        return errs

    # ---- where each process goes, what it gets ---------------------------------------------

    def seat(self, role: str) -> Seat | None:
        """Role process `role`'s entry in the plan (None: not planned, or no plan on a CPU cluster)."""
        return self.plan.of(role) if self.plan.layout != "cpu" else None

    def gpu_bundles(self) -> list[tuple[int, list[str], list[dict]]]:
        """A colocated layout's GPU groups: (plan node, the devices used there, one bundle per device:
        GPU 1 and the resources of every process whose first device it is)."""
        if not self.shared:
            return []
        load = self.plan.device_load()
        out = []
        for k, node in enumerate(self.plan.nodes):
            used = [g.index for g in node.gpus if (k, g.index) in load]
            bundles = []
            for d in used:
                b = {"GPU": 1.0}
                for p in self.plan.placements:
                    if p.node == k and p.devices and p.devices[0] == d and self.seated(p.kind):
                        for key, v in self.actor_bundle(p.kind).items():
                            b[key] = b.get(key, 0.0) + v
                bundles.append(b)
            if used:
                out.append((k, used, bundles))
        return out

    def actor_bundle(self, kind: str) -> dict:
        """What one process of `kind` reserves (its GPUs decided here)."""
        return getattr(self.rcfg, kind).bundle(self.gpus(kind))

    def fit(self, spec: RoleSpec, seat: Seat | None) -> RoleSpec:
        """`spec` with its seat's share: an engine's gpu_memory_utilization on its command line, a
        learner's or scorer's memory cap in its environment, a wait for the role that starts before
        it on a shared GPU (launch/roles.py `place`, as launch.local); CUDA_VISIBLE_DEVICES is set
        once the process is placed (`visible`)."""
        if seat is None:
            return spec
        if spec.name == seat.role:
            place(spec, self.plan, self.round_timeout_s)
        else:  # a generator added by `scale`, in a planned generator's seat (or like one)
            spec.argv = [*spec.argv, *self.plan.overrides(seat.role)]
            if self.plan.layout != "cpu":
                spec.env.update(nccl_env(self.round_timeout_s))
        spec.env = {k: v for k, v in spec.env.items() if k != "CUDA_VISIBLE_DEVICES"}
        return spec

    def scale_seat(self, taken: list[str]) -> Seat | None:
        """The seat of a generator added by `scale`: in a colocated layout a planned generator's
        whose process is gone (`taken`: the seats in use), None when every one is in use (the plan
        shared each GPU's memory out among the generators it planned); separate: like generator-0's
        (the same share), on GPUs Ray gives it."""
        gens = [p for p in self.plan.placements if p.kind == "generator"] if self.plan.layout != "cpu" else []
        if not self.seated("generator"):
            return gens[0] if gens else None
        return next((p for p in gens if p.role not in taken), None)

    def refuse_scale(self, now: int) -> str:
        gens = [p for p in self.plan.placements if p.kind == "generator"]
        where = "; ".join(f"{p.role} on {self.plan.nodes[p.node].name} gpu {','.join(p.devices)} at "
                          f"gpu_memory_utilization {p.share:.2f}" for p in gens)
        return (f"run.placement {self.plan.layout} shares the GPUs' memory out among the {len(gens)} generator(s) "
                f"it planned ({where}); a colocated run adds a generator only in the seat of one that has "
                f"stopped (run.num_generators and a new run for more); staying at {now}")

    def describe(self, specs: list[RoleSpec]) -> list[str]:
        """`--plan`'s lines for launch.ray: what each process reserves from Ray and what its
        environment gets."""
        lines = ["  on Ray (" + ("each process reserves its GPUs: Ray's ids become its CUDA_VISIBLE_DEVICES"
                                 if not self.shared else
                                 "one placement group per node, a {GPU: 1} bundle per planned GPU; processes "
                                 "reserve none and get the ids Ray gave their devices' bundles") + "):"]
        for spec in specs:
            seat = self.seat(spec.name)
            extra = " ".join(f"{k}={v}" for k, v in spec.env.items() if k.startswith("CONVEYOR_CUDA"))
            flags = " ".join(self.plan.overrides(spec.name))
            if seat is not None and seat.devices and self.seated(spec.kind):
                what = (f"num_gpus 0, in {self.plan.nodes[seat.node].name}'s GPU group: "
                        f"CUDA_VISIBLE_DEVICES=<the ids Ray gave the bundles of gpu {','.join(seat.devices)}>")
            else:
                n = self.gpus(spec.kind)
                what = (f"num_gpus {n:g}: CUDA_VISIBLE_DEVICES=<the {'id' if n == 1 else f'{n:g} ids'} Ray gives it>"
                        if n else 'num_gpus 0: CUDA_VISIBLE_DEVICES=""')
            lines.append(f"    {spec.name:<13} " + " ".join(x for x in (what, extra, flags) if x))
        if any(s.kind == "learner" for s in specs):
            lines.append("    (learner ranks: CUDA_VISIBLE_DEVICES lists their node's learner GPUs in local-rank "
                         "order; LOCAL_RANK picks)")
        lines += [f"  note: {n}" for n in self.notes]
        return lines
