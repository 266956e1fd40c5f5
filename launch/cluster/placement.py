"""Where `launch.ray` puts each role: a placement group per role, one bundle per process.

Every role's group is placed before any role starts (all or nothing): the learner's ranks together
(`ray.learner.strategy`), the generators likewise; a generator's tensor-parallel workers share its
one bundle. A request no node can hold was refused before (`ray_config.check_resources`); one that
fits but waits fails after `ray.placement_timeout_s`, saying what is free. Generators added by
`scale` beyond the run's first group get a one-bundle group each, removed with its last process.

What a process reserves comes with the run's device plan (launch/cluster/devices.py `RayDevices`). In
a colocated layout the processes the plan gives GPUs sit instead in the run's GPU groups: one per
planned node, a {GPU: 1} bundle per planned GPU (with the CPUs of the processes whose first
device it is), held for the attempt's life; `probe` asks each bundle which GPU id Ray gave it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launch.cluster.config import ResourceError, fmt_res


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
    devices: list[str] = field(default_factory=list)  # a GPU group's: the plan's device of each bundle

    def free_slot(self) -> Slot | None:
        for i, b in enumerate(self.bundles):
            if i not in self.taken:
                return Slot(self.pg, i, b, self)
        return None


class Placement:
    """The placement groups of one attempt of a run."""

    def __init__(self, ray, rcfg, run, run_name: str, attempt: int):
        self.ray, self.rcfg, self.run = ray, rcfg, run
        self.run_name, self.attempt = run_name, attempt
        self.groups: list[Group] = []
        self.placed = 0  # placement groups made so far (their names must differ)
        self.devices = None  # RayDevices: the run's device plan on this cluster, set before anything is placed
        self.gpu_groups: dict[int, Group] = {}  # colocated layouts: plan node -> its GPU group
        self.gpu_ids: dict[tuple[int, str], str] = {}  # (plan node, plan device) -> the id Ray gave its bundle

    def bundle(self, kind: str) -> dict:
        return self.devices.actor_bundle(kind)

    def demands(self) -> list[tuple[str, list[dict], str]]:
        """(role, one bundle per process, strategy) for every role of the run, and the GPU groups."""
        r = self.run.run
        counts = {"buffer": 1, "weight_sync": 1, "scorer": r.num_scorers, "generator": r.num_generators,
                  "learner": r.learner_ranks}
        out = [(k, [self.bundle(k)] * n, getattr(self.rcfg, k).strategy) for k, n in counts.items()
               if not self.devices.seated(k)]
        return out + [(self.gpu_group_name(k), bundles, "STRICT_PACK") for k, _, bundles in self.devices.gpu_bundles()]

    def gpu_group_name(self, k: int) -> str:
        return f"gpus of {self.devices.plan.nodes[k].name}"

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

    def place_all(self) -> dict[str, Group]:
        """Every role's group and the GPU groups, before any role starts; the GPU ids of the latter."""
        seated = {k for k in ("buffer", "weight_sync", "scorer", "generator", "learner") if self.devices.seated(k)}
        groups = {kind: self.place(kind, bundles, strategy, self.rcfg.placement_timeout_s)
                  for kind, bundles, strategy in self.demands()
                  if kind not in seated and not kind.startswith("gpus of")}
        for k, used, bundles in self.devices.gpu_bundles():
            g = self.place(self.gpu_group_name(k), bundles, "STRICT_PACK", self.rcfg.placement_timeout_s)
            g.devices = used
            self.gpu_groups[k] = g
            for d, gpu in zip(used, self.probe(g)):
                self.gpu_ids[(k, d)] = gpu
        return groups

    def probe(self, group: Group) -> list[str]:
        """The GPU id Ray gave each bundle of `group`: a task that reserves the bundle's GPU asks
        `ray.get_gpu_ids()` (a bundle keeps its GPU for its life: launch/cluster/devices.py)."""
        import os

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from launch.roles import ROOT

        def bundle_gpu() -> list[str]:
            import ray

            return [str(g) for g in ray.get_gpu_ids()]

        task = self.ray.remote(bundle_gpu)
        env = {"env_vars": {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}}
        refs = [task.options(num_cpus=0, num_gpus=1, runtime_env=env,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 group.pg, placement_group_bundle_index=i)).remote()
                for i in range(len(group.bundles))]
        ids = self.ray.get(refs, timeout=self.rcfg.placement_timeout_s)
        bad = [(d, i) for d, i in zip(group.devices, ids) if len(i) != 1]
        if bad:
            raise ResourceError(f"{group.role}: a {{GPU: 1}} bundle reported GPU ids {bad[0][1]} (device {bad[0][0]})")
        return [i[0] for i in ids]

    def seat_slot(self, seat) -> Slot:
        """Where a process of a colocated layout goes: the bundle of its first planned device (no GPU
        reserved: its CUDA_VISIBLE_DEVICES comes from `gpu_ids`)."""
        g = self.gpu_groups[seat.node]
        i = g.devices.index(seat.devices[0])
        return Slot(g.pg, i, self.bundle(seat.kind), g)

    def seat_gpus(self, seat) -> list[str]:
        """The GPU ids Ray gave the bundles of `seat`'s planned devices."""
        return [self.gpu_ids[(seat.node, d)] for d in seat.devices]

    def node_ip(self, group: Group, index: int = 0) -> str:
        """The IP of the node that holds bundle `index` of a placed group ("" if none does now)."""
        from ray.util import placement_group_table

        node_id = placement_group_table(group.pg).get("bundles_to_node_id", {}).get(index)
        return next((n["NodeManagerAddress"] for n in self.ray.nodes() if n["NodeID"] == node_id and n.get("Alive")),
                    "")

    def placed_now(self, slot: Slot) -> bool:
        """Whether the slot's bundle is on an alive node: after its node was lost, Ray places the
        group again once a node that can hold the bundle joins (until then an actor there waits)."""
        from ray.util import placement_group_table

        return placement_group_table(slot.pg).get("state") == "CREATED" and bool(self.node_ip(slot.group, slot.index))

    def take(self, group: Group) -> Slot:
        slot = group.free_slot()
        assert slot is not None, f"no free bundle in {group.role}'s placement group"
        group.taken.add(slot.index)
        return slot

    def take_free(self, role: str) -> Slot | None:
        """A free bundle in any of `role`'s groups (one a scaled-down generator left), if there is one."""
        for g in self.groups:
            if g.role == role and g.free_slot() is not None:
                return self.take(g)
        return None

    def release(self, slot: Slot) -> None:
        from ray.util.placement_group import remove_placement_group

        g = slot.group
        g.taken.discard(slot.index)
        if not g.taken and not g.keep:
            remove_placement_group(g.pg)
            self.groups.remove(g)

    def remove_all(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g.pg)
        self.groups = []
        self.gpu_groups, self.gpu_ids = {}, {}
