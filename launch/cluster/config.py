"""Section `ray:` of the run config: where the roles go on a Ray cluster (read by `launch.ray` only).

The other sections are the same as for `launch.local`; this one adds, per role, the resources one
process reserves, how a role's processes are spread over nodes, and how often a generator or a
scorer is started again after it died:

    ray:
      address: ""                 # RAY_ADDRESS, `auto`, `ray://head:10001`; empty: RAY_ADDRESS or a new local cluster
      generator: {num_cpus: 4, strategy: SPREAD}
      learner:   {num_cpus: 8, strategy: PACK}
      max_restarts: 3

GPUs come from the run's device plan on a GPU cluster (launch/cluster/devices.py): in the separate
layout each process reserves the GPUs the plan gives it, unless `num_gpus` here says otherwise;
in a colocated one the run holds its GPUs in one placement group per node. OpenRLHF's placement
flags (`--actor.num_nodes`, `--actor_num_gpus_per_node`, `--vllm.num_engines`, ...) become the
process counts (`ray_placement`).

Also here, without Ray: `load` (the run config with `ray:` taken apart, paths made absolute),
`tie_addresses` (the discovered buffer and weight-sync addresses into every section that dials
them), `decide_curve` (`run.curve auto` decided from the nodes the services were placed on) \
and `check_resources` (a request no node can hold is refused at once, naming the role and the
resource, instead of waiting forever for a placement group).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import ClassVar, Literal, Sequence

from pydantic import Field

from common.config import ConfigError, Section, apply_flags, build, parse_overrides, read_yaml, render_help
from launch.config import tie_addresses as _tie
from launch.openrlhf.flags import LEGACY

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ResourceError(RuntimeError):
    """The cluster cannot give what the config asks for; the message names the role and the resource."""


class RoleResources(Section):
    """What one process of a role reserves on its node (Ray's logical resources)."""

    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per process (a generator: per engine; a learner: per rank)."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs per process; a generator reserves num_gpus x generator.tensor_parallel_size, on one node.
    Unset: what the device plan gives it on a GPU cluster (separate layout: a learner rank 1, a
    generator tensor_parallel_size, a GPU scorer 1; the services 0), nothing on a CPU cluster.
    Set with run.placement colocate or colocate_scorers: refused (the plan places those)."""
    memory_gb: float = Field(0.0, ge=0)
    """Host memory reserved per process in GiB (0: none; Ray's memory resource)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Ray custom resources per process (`{node_a: 1}`): a node started with `ray start
    --resources '{"node_a": 100}'` is the only kind that can hold the process, which pins a role to
    a set of nodes (the buffer and learner on one, generators on others)."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the role's placement group lays out its bundles (learner ranks; the generators started
    with the run): PACK (as few nodes as fit), SPREAD (different nodes where possible),
    STRICT_PACK (one node), STRICT_SPREAD (one node each)."""

    def bundle(self, gpus: float = 0.0) -> dict[str, float]:
        """One process's reservation, with `gpus` GPUs (decided with the device plan:
        launch/cluster/devices.py `RayDevices.gpus`)."""
        b = {"CPU": float(self.num_cpus)}
        if gpus:
            b["GPU"] = float(gpus)
        if self.memory_gb:
            b["memory"] = float(self.memory_gb) * (1 << 30)
        b.update({k: float(v) for k, v in self.resources.items()})
        return b


def _small() -> RoleResources:
    return RoleResources(num_cpus=0.5)


class RayConfig(Section):
    """Section `ray:` of the run config (only `launch.ray` reads it)."""

    section: ClassVar[str] = "ray"

    address: str = ""
    """Cluster to join (`auto`, `HOST:6379`, `ray://HOST:10001`); empty: $RAY_ADDRESS, else a new
    local cluster for this run (stopped with it)."""
    local_num_cpus: int = 0
    """CPUs of the local cluster started when there is no address (0: every core)."""
    namespace: str = "conveyor"
    """Ray namespace of the run's actors (the controller is found there by `launch.ray scale`)."""
    run_name: str = ""
    """Name of the run's controller actor (`launch.ray scale --run NAME`); empty: run.run_dir's last part."""
    buffer: RoleResources = Field(default_factory=_small)
    """The replay buffer (one process; ZeroMQ and msgpack, no accelerator)."""
    weight_sync: RoleResources = Field(default_factory=_small)
    """The weight-sync control service (one small process)."""
    generator: RoleResources = Field(default_factory=RoleResources)
    """Each generator (one vLLM engine; its tensor-parallel workers share its bundle, so one node)."""
    scorer: RoleResources = Field(default_factory=RoleResources)
    """Each scorer (a reward model or a reference model wants num_gpus: 1 on GPU clusters)."""
    learner: RoleResources = Field(default_factory=RoleResources)
    """Each learner rank (one DeepSpeed process; num_gpus: 1 per rank on GPU clusters)."""
    max_restarts: int = Field(3, ge=0)
    """Times a generator or a scorer is started again after it died (each, over the run)."""
    restart_delay_s: float = 2.0
    """Pause before such a restart (its leases expire meanwhile and are issued again)."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long placement groups may wait for resources (e.g. an autoscaler adding nodes) before
    the run fails; a request no node of the cluster can ever hold fails at once."""
    check_resources: bool = True
    """Refuse at once a request that no alive node (or the cluster as a whole) can hold; off for
    autoscaling clusters whose nodes appear on demand."""
    poll_s: float = Field(1.0, gt=0)
    """How often the driver checks the roles and the controller (scale requests)."""

    def roles(self) -> dict[str, RoleResources]:
        return {"buffer": self.buffer, "weight_sync": self.weight_sync, "generator": self.generator,
                "scorer": self.scorer, "learner": self.learner}

    def problems(self) -> list[str]:
        errs = []
        for name, r in self.roles().items():
            if r.num_gpus > 1 and r.num_gpus != int(r.num_gpus):
                errs.append(f"ray.{name}.num_gpus={r.num_gpus}: above 1 it must be a whole number")
            if not (r.num_cpus or r.num_gpus or r.memory_gb):
                errs.append(f"ray.{name}: reserves nothing (num_cpus, num_gpus and memory_gb all 0); "
                            "give it at least a fraction of a CPU")
            clash = sorted(set(r.resources) & {"CPU", "GPU", "memory"})
            if clash:
                errs.append(f"ray.{name}.resources={r.resources}: {', '.join(clash)} are set with num_cpus, "
                            "num_gpus and memory_gb; resources is for custom ones")
        return errs


def split_ray_section(config_path: str | Path | None, argv: Sequence[str]) -> tuple[RayConfig, dict, list[str]]:
    """(RayConfig, the YAML tree without `ray:`, the overrides that are not `--ray.*`).

    `launch.run_config` does not know section `ray:`, so it is taken out here before the rest of
    the file and the flags go to `load_run_config`.
    """
    tree = read_yaml(config_path)
    ray_tree = tree.pop("ray", None) or {}
    if not isinstance(ray_tree, dict):
        raise ConfigError(f"{config_path}: section 'ray' must be a mapping")
    mine, rest = _split(list(argv), lambda flag: flag.startswith("--ray."))
    placed, used = ray_placement(parse_overrides(rest))  # the flags' shape is checked now, their keys later
    # OpenRLHF's placement flags become process counts and ray.<role> resources here
    rest = _split(rest, lambda flag: flag[2:].split("=")[0].replace("-", "_") in used)[1]
    mine += [f"--{k}={v}" for k, v in placed.items() if k.startswith("ray.")]
    rest += [f"--{k}={v}" for k, v in placed.items() if not k.startswith("ray.")]
    sub = {"ray": ray_tree}
    apply_flags(sub, mine, {"ray": RayConfig})
    cfg = build(RayConfig, sub["ray"], "ray", complete=True)
    return cfg, tree, rest


def _split(argv: list[str], picked) -> tuple[list[str], list[str]]:
    """(the flags `picked(flag)` chooses, with their values; the others), in their order."""
    yes: list[str] = []
    no: list[str] = []
    i = 0
    while i < len(argv):
        n = 1
        while "=" not in argv[i] and i + n < len(argv) and not argv[i + n].startswith("--"):
            n += 1  # several values (nargs)
        (yes if picked(argv[i]) else no).extend(argv[i:i + n])
        i += n
    return yes, no


# --------------------------------------------------------------------------------------------
# OpenRLHF's placement flags as the Ray launcher's resources

ROLE_OF = {"actor": "learner", "ref": "scorer", "reward": "scorer", "critic": "learner"}


def ray_placement(flags: dict[str, str]) -> tuple[dict[str, str], set[str]]:
    """OpenRLHF's placement flags among `flags` (parsed overrides) as `launch.ray` keys.

    (overrides, the flags they replace): learner ranks = actor nodes x GPUs per node; scorers = the
    larger of ref's and reward's nodes x GPUs (each scorer serves both models); generators = vLLM
    engines. On a GPU cluster the device plan then gives each process its GPUs (launch/cluster/devices.py).
    Several nodes are fine here; PACK spreads a role over as few as hold it. Explicit `--run.*`
    counts win."""
    per_role: dict[str, dict[str, int]] = {}
    used: set[str] = set()
    for key, value in flags.items():
        dotted = LEGACY.get(key, key)
        head, _, what = dotted.partition(".")
        if head in ROLE_OF and what in ("num_nodes", "num_gpus_per_node"):
            try:
                per_role.setdefault(head, {})[what] = int(value)
            except ValueError:
                raise ConfigError(f"--{key}: expected a whole number, got {value!r}") from None
            used.add(key)
    out: dict[str, str] = {}
    counts = {r: v.get("num_nodes", 1) * v.get("num_gpus_per_node", 1) for r, v in per_role.items()}
    if "actor" in counts and "run.learner_ranks" not in flags:
        out["run.learner_ranks"] = str(counts["actor"])
    scorers = [counts[r] for r in ("ref", "reward") if r in counts]
    if scorers and "run.num_scorers" not in flags:
        out["run.num_scorers"] = str(max(scorers))
    return out, used


# --------------------------------------------------------------------------------------------
# the run config as launch.ray reads it: section `ray:` apart, paths absolute, addresses discovered


def load(config_path: str | None, argv: list[str], paths: bool = True):
    """(RayConfig, Run) from the YAML file and the flags; `ray:` is read here, the rest as usual
    (`paths` False: the model and prompt paths need not exist, as for `--plan`)."""
    import yaml

    from launch.run_config import load_run_config

    rcfg, tree, rest = split_ray_section(config_path, argv)
    with tempfile.TemporaryDirectory() as tmp:
        # the same file name, so load_run_config's messages quote the user's file
        path = Path(tmp) / (Path(config_path).name if config_path else "config.yaml")
        path.write_text(yaml.safe_dump(tree, sort_keys=False))
        run = load_run_config(path, rest, paths=paths)
    absolute_paths(run)
    return rcfg, run


def absolute_paths(run) -> None:
    """Roles run in other processes, maybe on other nodes, from another folder: make the run's
    folders and every path that exists from here absolute (the same path must hold on each node)."""
    for cfg in run.sections().values():
        for name in type(cfg).model_fields:
            v = getattr(cfg, name)
            if not isinstance(v, str) or not v or os.path.isabs(v) or "://" in v:
                continue
            if name.endswith("_dir") or Path(v).exists():
                setattr(cfg, name, str(Path(v).resolve()))


def tie_addresses(run) -> None:
    """Every role that dials the buffer or the weight-sync service gets their discovered addresses
    (what run_config.finish does for these fields, without re-deriving the others)."""
    _tie((run.generator, run.scorer, run.learner), run.buffer, run.weight_sync)


def decide_curve(run, hosts: list[str]) -> bool:
    """`run.curve auto` decided with the addresses the buffer and the weight-sync service will bind
    (their nodes' IPs, known once they are placed): CurveZMQ on unless all are loopback. `on` and
    `off` stay as they are. Sets buffer.curve and weight_sync.curve (one decision for the run);
    whether it is on."""
    from common.curve import is_loopback

    mode = run.run.curve
    on = mode == "on" or (mode == "auto" and not all(is_loopback(h) for h in hosts))
    run.buffer.curve = run.weight_sync.curve = "on" if on else "off"
    return on


def ray_help(doc: str) -> str:
    """`launch.ray --help`: every section of the run config, `ray:` included, and the aliases."""
    from launch.run_config import ALIASES, section_classes

    return render_help(doc, {**section_classes(), "ray": RayConfig}, ALIASES)


def resolved_text(run, rcfg) -> str:
    import yaml

    return ("# resolved by launch.ray: every role reads its section of this file\n"
            + yaml.safe_dump({**run.to_dict(), "ray": rcfg.to_dict()}, sort_keys=False))


# --------------------------------------------------------------------------------------------
# what the run asks of the cluster, checked before anything is placed


def fmt_res(name: str, amount: float) -> str:
    if name == "memory":
        return f"memory {amount / (1 << 30):.1f} GiB"
    return f"{name} {amount:g}"


def check_resources(demands: list[tuple[str, list[dict], str]], nodes: list[dict]) -> None:
    """Refuse a request no alive node (or the cluster as a whole) can hold, naming role and resource.

    `demands`: (role, bundles, strategy); `nodes`: the total resources of each alive node.
    """
    errors = []
    cluster: dict[str, float] = {}
    for n in nodes:
        for k, v in n.items():
            cluster[k] = cluster.get(k, 0.0) + v
    have = ", ".join(fmt_res(k, cluster.get(k, 0.0)) for k in ("CPU", "GPU", "memory"))
    for role, bundles, strategy in demands:
        if not bundles:
            continue
        for res, amount in bundles[0].items():
            best = max((n.get(res, 0.0) for n in nodes), default=0.0)
            if amount > best + 1e-9:
                errors.append(f"role {role!r} asks for {fmt_res(res, amount)} per process, but no node of the "
                              f"cluster has {fmt_res(res, amount)} (largest node: {fmt_res(res, best)}; "
                              f"cluster: {have})")
        if errors:
            continue
        if strategy == "STRICT_PACK":
            need = {k: sum(b.get(k, 0.0) for b in bundles) for k in bundles[0]}
            if not any(all(n.get(k, 0.0) >= v - 1e-9 for k, v in need.items()) for n in nodes):
                errors.append(f"role {role!r}: {len(bundles)} processes with strategy STRICT_PACK need "
                              + ", ".join(fmt_res(k, v) for k, v in need.items()) + " on one node; no node has it")
        if strategy == "STRICT_SPREAD":
            fit = sum(all(n.get(k, 0.0) >= v - 1e-9 for k, v in bundles[0].items()) for n in nodes)
            if fit < len(bundles):
                errors.append(f"role {role!r}: {len(bundles)} processes with strategy STRICT_SPREAD need as many "
                              f"nodes, but only {fit} node(s) can hold one")
    if not errors:
        total: dict[str, float] = {}
        by_role: dict[str, list[str]] = {}
        for role, bundles, _ in demands:
            for b in bundles:
                for k, v in b.items():
                    total[k] = total.get(k, 0.0) + v
            for k in (bundles[0] if bundles else {}):
                by_role.setdefault(k, []).append(f"{role} {len(bundles)} x {fmt_res(k, bundles[0][k])}")
        for k, v in total.items():
            if v > cluster.get(k, 0.0) + 1e-9:
                errors.append(f"the run asks for {fmt_res(k, v)} in all ({'; '.join(by_role[k])}), but the "
                              f"cluster has {fmt_res(k, cluster.get(k, 0.0))}")
    if errors:
        raise ResourceError("; ".join(errors))
