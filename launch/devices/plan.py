"""The plan itself: each role process's devices, its share of each, and whether it fits.

    roles  learner ranks (1 device each), generators (generator.tensor_parallel_size adjacent
           devices each, on one node; vLLM engines only), scorers (1 device when scorer.device
           is cuda); the buffer and the weight-sync service get no device (CUDA_VISIBLE_DEVICES="")
    layout run.placement:
             separate   every process on devices of its own (vLLM takes generator.gpu_memory_utilization
                        of each, 0.9 by default)
             colocate   the engines and the scorers share the learner's devices (OpenRLHF's
                        --colocate_all_models); each engine's gpu_memory_utilization is what the
                        learner and the scorers leave (or the one given, checked)
             colocate_scorers   engines on devices of their own, scorers on the learner's
                        (OpenRLHF's --colocate_actor_ref / --colocate_critic_reward)
             auto       separate when the devices suffice, else colocate_scorers, else colocate
    memory each process's need per device (launch/devices/memory.py); a device whose processes need
           more than USABLE of it is refused with the numbers and the knob to turn (launch exits 2,
           the config error code).

Each role process gets its devices as CUDA_VISIBLE_DEVICES (the plan's indices mapped through the
launcher's own CUDA_VISIBLE_DEVICES), an engine its gpu_memory_utilization as a config override,
the learner and a shared-device scorer `CONVEYOR_CUDA_MEMORY_FRACTION` (applied with
`torch.cuda.set_per_process_memory_fraction`, so a role over its budget fails itself rather than
its neighbour). Roles that share a device start one after another, each once the previous is
ready: vLLM measures its own use of the device at start-up from the device's free memory, which
another process allocating or freeing meanwhile would falsify.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from launch.devices.gpus import Gpu, Node, PlanError, local_gpus
from launch.devices.memory import Demand, demand_of

FRACTION_ENV = "CONVEYOR_CUDA_MEMORY_FRACTION"
USABLE = 0.95  # of a device's memory, what the plan hands out (the rest: fragmentation, NCCL's buffers)
ENGINE_DEFAULT = 0.9  # vLLM's own default gpu_memory_utilization, for an engine with a device to itself
PLACEMENTS = ("auto", "separate", "colocate", "colocate_scorers")


@dataclass
class Placement:
    """One role process's devices, its share of each and its estimated use of each (GiB)."""

    role: str  # generator-0, scorer-1, learner-3 (launch.local runs every rank in one process, `learner`)
    kind: str  # generator | scorer | learner
    node: int = 0
    devices: list[str] = field(default_factory=list)  # node-local device ids; [] = CPU
    share: float = 0.0  # of each device's memory: vLLM's gpu_memory_utilization; the learner's cap
    need_gb: float = 0.0  # estimated use per device
    parts: str = ""  # what need_gb is made of, for the table
    after: str = ""  # a role on one of the same devices that must be ready before this one starts


@dataclass
class DevicePlan:
    layout: str  # cpu | separate | colocate | colocate_scorers
    nodes: list[Node]
    placements: list[Placement]
    notes: list[str] = field(default_factory=list)
    memory_checked: bool = True
    engine_extra_gb: float = 0.0  # what an engine uses beyond its share (receive area, CUDA context)

    def of(self, role: str) -> Placement | None:
        """Role process `role`'s placement; `learner` (launch.local's one process of every rank)
        is the ranks' devices in rank order, with the smallest of their caps."""
        if role == "learner":
            ranks = [p for p in self.placements if p.kind == "learner"]
            if not ranks:
                return None
            caps = [p.share for p in ranks if p.share]
            return Placement("learner", "learner", ranks[0].node, [dv for p in ranks for dv in p.devices],
                             min(caps) if caps else 0.0, max(p.need_gb for p in ranks), ranks[0].parts,
                             next((p.after for p in ranks if p.after), ""))
        return next((p for p in self.placements if p.role == role), None)

    def device_load(self) -> dict[tuple[int, str], list[Placement]]:
        out: dict[tuple[int, str], list[Placement]] = {}
        for p in self.placements:
            for d in p.devices:
                out.setdefault((p.node, d), []).append(p)
        return out

    def env(self, role: str) -> dict[str, str]:
        """What role process `role` gets in its environment (CUDA_VISIBLE_DEVICES and its share)."""
        if self.layout == "cpu":
            return {}
        p = self.of(role)
        if p is None or not p.devices:
            return {"CUDA_VISIBLE_DEVICES": ""}  # the services, a CPU scorer: no device at all
        # (PCI bus order: CUDA's own default, fastest first, need not be nvidia-smi's on a mixed node)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(p.devices), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if p.kind in ("learner", "scorer") and p.share and p.share < 1.0:
            env[FRACTION_ENV] = f"{p.share:.3f}"
        return env

    def waited(self) -> set[str]:
        """Roles the next role must wait for: each is followed by one that shares a device with it."""
        return {p.after for p in self.placements if p.after}

    def overrides(self, role: str) -> list[str]:
        """Config flags for the role's command line (an engine's gpu_memory_utilization)."""
        p = self.of(role)
        if self.layout == "cpu" or p is None or p.kind != "generator" or not p.share:
            return []
        return ["--generator.gpu_memory_utilization", f"{p.share:.3f}"]

    def table(self) -> str:
        """The plan as text: one line per device (who is on it, shares, estimated GiB), then notes."""
        if self.layout == "cpu":
            return "device plan: no GPU (every role on the CPU)\n" + "".join(f"  note: {n}\n" for n in self.notes)
        n_gpus = sum(len(n.gpus) for n in self.nodes)
        used = self.device_load()
        lines = [f"device plan: {self.layout}, {len(used)} of {n_gpus} GPU(s) on {len(self.nodes)} node(s)"
                 + ("" if self.memory_checked else " (memory not checked: see notes)")]
        lines.append(f"  {'node':<8} {'gpu':<4} {'GiB':>6}  {'use GiB':>8}  "
                     "processes (share of the device, estimated GiB)")
        for k, node in enumerate(self.nodes):
            for g in node.gpus:
                on = used.get((k, g.index), [])
                if not on:
                    continue
                use = sum(p.share * g.memory_gb + self.engine_extra_gb if p.kind == "generator" else p.need_gb
                          for p in on)
                who = ", ".join(f"{p.role} ({p.share:.2f}, {p.need_gb:.1f})" if p.share
                                else f"{p.role} ({p.need_gb:.1f})" for p in on)
                lines.append(f"  {node.name:<8} {g.index:<4} {g.memory_gb:>6.1f}  {use:>8.1f}  {who}")
        lines.append("  roles:")
        for p in self.placements:
            where = f"node {self.nodes[p.node].name} gpu {','.join(p.devices)}" if p.devices else "cpu"
            extra = f"; starts after {p.after} is ready" if p.after else ""
            lines.append(f"    {p.role:<13} {where:<24} {p.parts}{extra}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def _devices(nodes: list[Node]) -> list[tuple[int, Gpu]]:
    return [(k, g) for k, n in enumerate(nodes) for g in n.gpus]


def _tp_block(nodes: list[Node], taken: set, tp: int) -> tuple[int, list[Gpu]] | None:
    """The first `tp` adjacent free devices on one node, starting at a multiple of `tp` (NVLink
    pairs and quads are aligned that way)."""
    for k, n in enumerate(nodes):
        for start in range(0, len(n.gpus) - tp + 1, tp):
            block = n.gpus[start:start + tp]
            if all((k, g.index) not in taken for g in block):
                return k, block
    return None


def _need_count(d: Demand, layout: str) -> int:
    if layout == "separate":
        return d.learner_ranks + d.generators * d.tp + d.gpu_scorers
    if layout == "colocate_scorers":
        return d.learner_ranks + d.generators * d.tp
    return max(d.learner_ranks, d.tp)


def make_plan(d: Demand, nodes: list[Node], placement: str = "auto") -> DevicePlan:
    """Lay the demand `d` out on `nodes` (see the module docstring); raises `PlanError` when it
    cannot fit, with the numbers and the knob."""
    if placement not in PLACEMENTS:
        raise PlanError(f"run.placement={placement!r} must be one of {', '.join(PLACEMENTS)}")
    n_gpus = sum(len(n.gpus) for n in nodes)
    if n_gpus == 0:
        return DevicePlan("cpu", nodes, [], notes=[] if not d.gpu_scorers else
                          ["scorer.device is cuda but no GPU was found: the scorers will fail to start"])
    if d.vllm is False and d.generators and d.tp > 1:
        raise PlanError("generator.tensor_parallel_size > 1 needs generator.engine=vllm")
    layout = placement
    if layout == "auto":
        layout = next((lay for lay in ("separate", "colocate_scorers", "colocate")
                       if _need_count(d, lay) <= n_gpus and (lay != "colocate_scorers" or d.gpu_scorers)),
                      "colocate")
    need = _need_count(d, layout)
    if need > n_gpus and layout == "colocate":
        raise PlanError(f"run.placement=colocate: {d.learner_ranks} learner rank(s) need a GPU each, an engine "
                        f"{d.tp} (generator.tensor_parallel_size); {n_gpus} found. Turn: fewer run.learner_ranks "
                        f"or a smaller generator.tensor_parallel_size")
    if need > n_gpus:
        raise PlanError(
            f"run.placement={layout}: {d.learner_ranks} learner rank(s) + {d.generators} generator(s) x "
            f"tensor_parallel_size {d.tp} + {d.gpu_scorers} GPU scorer(s) need {need} GPU(s); "
            f"{n_gpus} found. Turn: run.placement colocate (engines and scorers share the learner's GPUs), "
            f"fewer run.num_generators or run.learner_ranks, or scorer.device cpu")
    if max(len(n.gpus) for n in nodes) < d.tp:
        raise PlanError(f"generator.tensor_parallel_size={d.tp}: no node has that many GPUs "
                        f"({', '.join(f'{n.name}: {len(n.gpus)}' for n in nodes)})")
    taken: set = set()
    placements: list[Placement] = []
    devs = _devices(nodes)
    # learner ranks first, packed (a rank per device, the first nodes first): NCCL's fastest links
    learner_devs = devs[:d.learner_ranks]
    for rank, (k, g) in enumerate(learner_devs):
        placements.append(Placement(f"learner-{rank}", "learner", k, [g.index],
                                    need_gb=d.learner_gb[rank] if d.learner_gb else 0.0, parts=d.learner_parts))
    taken |= {(k, g.index) for k, g in learner_devs}
    learner0 = placements[0]
    if d.generators and d.send_gb:  # (ranks > 0 share the figure: rank 0's is the largest)
        learner0.need_gb += d.send_gb
        learner0.parts += f" + weight-sync send buckets {d.send_gb:.1f} on rank 0"
    # engines: blocks of their own, or cycling over the learner's devices
    gens: list[Placement] = []
    for i in range(d.generators):
        if not d.vllm:
            gens.append(Placement(f"generator-{i}", "generator"))
            continue
        if layout in ("separate", "colocate_scorers"):
            found = _tp_block(nodes, taken, d.tp)
            if found is None:
                raise PlanError(f"generator-{i}: no {d.tp} adjacent free GPUs left on one node for its engine "
                                f"(generator.tensor_parallel_size={d.tp}); turn: run.placement colocate, or fewer "
                                f"run.num_generators")
            k, block = found
        else:
            pool = _pool(nodes, learner_devs, d.tp)
            k, block = pool[i % len(pool)]
        taken |= {(k, g.index) for g in block}
        gens.append(Placement(f"generator-{i}", "generator", k, [g.index for g in block], need_gb=d.engine_need_gb,
                              parts=d.engine_parts))
    if d.slot_gb and any(g.node == learner0.node and set(g.devices) & set(learner0.devices) for g in gens):
        # the slot an engine on rank 0's own GPU maps by CUDA IPC (made once one asks: weight_sync/shm.py;
        # an engine on another GPU does not see rank 0's, and reads the host slot in /dev/shm)
        learner0.need_gb += d.slot_gb
        learner0.parts += f" + weight-sync slot {d.slot_gb:.1f} on rank 0 (weight_sync.same_host broadcast: none)"
    scorers: list[Placement] = []
    for i in range(d.gpu_scorers):
        if layout == "separate":
            k, g = next((k, g) for k, g in devs if (k, g.index) not in taken)
            taken.add((k, g.index))
        else:  # the learner's devices from the last: rank 0's holds the weight-sync slot too
            k, g = learner_devs[-1 - i % len(learner_devs)]
        scorers.append(Placement(f"scorer-{i}", "scorer", k, [g.index], need_gb=d.scorer_gb, parts=d.scorer_parts))
    # start order on a shared device: scorers (they load and keep their models), engines, the learner
    placements = scorers + gens + placements
    plan = DevicePlan(layout, nodes, placements, memory_checked=d.checked, engine_extra_gb=d.engine_extra_gb)
    _shares(plan, d)
    _order(plan)
    if not d.checked:
        plan.notes.append("a model folder is not on this machine: devices assigned, memory not checked "
                          "(give run.model_params_b to check it)")
    return plan


def _pool(nodes: list[Node], learner_devs: list, tp: int) -> list[tuple[int, list[Gpu]]]:
    """Colocated engines' blocks: tp-aligned blocks of the learner's devices (at least one block)."""
    by_node: dict[int, list[Gpu]] = {}
    for k, g in learner_devs:
        by_node.setdefault(k, []).append(g)
    blocks = []
    for k, gs in by_node.items():
        node_gpus = nodes[k].gpus
        first = node_gpus.index(gs[0])
        span = max(len(gs), tp)
        span = (span + tp - 1) // tp * tp
        use = node_gpus[first:first + span]
        if len(use) < span:  # (the learner's last devices at the end of a node)
            use = node_gpus[max(0, len(node_gpus) - span):]
        blocks += [(k, use[j:j + tp]) for j in range(0, len(use) - tp + 1, tp)]
    return blocks


def _memory(plan: DevicePlan, k: int, index: str) -> float:
    return next(g.memory_gb for g in plan.nodes[k].gpus if g.index == index)


def _shares(plan: DevicePlan, d: Demand) -> None:
    """Each engine's gpu_memory_utilization, the learner's and scorers' caps; refuse what cannot fit."""
    load = plan.device_load()
    problems = []
    engine_shares: dict[str, float] = {}
    for (k, index), on in sorted(load.items()):
        mem = _memory(plan, k, index)
        engines = [p for p in on if p.kind == "generator"]
        others = [p for p in on if p.kind != "generator"]
        fixed = sum(p.need_gb for p in others) + len(engines) * d.engine_extra_gb
        if engines:
            if d.engine_share:
                share = d.engine_share
            elif not others and len(engines) == 1:
                share = ENGINE_DEFAULT
            elif not plan.memory_checked:  # sizes unknown: an even split of the device
                share = math.floor(USABLE / len(on) * 100) / 100
            else:  # each engine what it needs, and half of what is left over (the KV cache grows into
                # it; the learner's and scorers' half makes room for bigger micro-batches)
                spare = mem * USABLE - fixed - len(engines) * d.engine_need_gb
                spare = spare / 2 if others else spare
                share = math.floor((d.engine_need_gb + max(0.0, spare) / len(engines)) / mem * 100) / 100
            for p in engines:
                engine_shares[p.role] = min(engine_shares.get(p.role, 1.0), share)
            if plan.memory_checked and share * mem < d.engine_need_gb:
                problems.append(
                    f"gpu {index} of {plan.nodes[k].name} ({mem:.0f} GiB): {len(engines)} engine(s) at "
                    f"gpu_memory_utilization {share:.2f} get {share * mem:.1f} GiB each, an engine needs "
                    f"{d.engine_need_gb:.1f} ({d.engine_parts}) beside {fixed:.1f} GiB of "
                    f"{', '.join(p.role for p in others) or 'receive areas'}")
            fixed += len(engines) * share * mem
        if plan.memory_checked and fixed > mem * USABLE + 1e-6:
            problems.append(
                f"gpu {index} of {plan.nodes[k].name} ({mem:.0f} GiB): needs {fixed:.1f} GiB "
                f"({'; '.join(f'{p.role}: {p.need_gb:.1f}' for p in others)}"
                f"{'; engines: ' + ', '.join(p.role for p in engines) if engines else ''}), "
                f"over the {USABLE:.0%} the plan hands out")
    for p in plan.placements:
        if p.kind == "generator" and p.role in engine_shares:
            p.share = engine_shares[p.role]
    # the learner and shared scorers: a cap, what the engines on their devices leave
    for p in plan.placements:
        if p.kind == "generator" or not p.devices:
            continue
        caps = []
        for index in p.devices:
            on = load[(p.node, index)]
            if len(on) == 1:
                continue
            mem = _memory(plan, p.node, index)
            engines = sum(q.share * mem + d.engine_extra_gb for q in on if q.kind == "generator")
            needs = sum(q.need_gb for q in on if q.kind != "generator")
            spare = max(0.0, mem * USABLE - engines - needs)
            # its need and its part of what is left, in proportion (an even split when sizes are unknown)
            part = p.need_gb / needs if needs else 1 / sum(q.kind != "generator" for q in on)
            caps.append((p.need_gb + spare * part) / mem)
        p.share = math.floor(min(caps) * 1000) / 1000 if caps else 0.0
    if problems:
        raise PlanError("the run does not fit its GPUs: " + "; ".join(problems) + ". Turn: run.placement separate "
                        "(more GPUs), generator.gpu_memory_utilization, learner.zero_stage 3 with more "
                        "learner ranks, learner.lora_rank, generator.max_model_len, or smaller models")


def _order(plan: DevicePlan) -> None:
    """A process that shares a device starts after the previous one there is ready (see the module
    docstring): `after` names it."""
    last_on: dict[tuple[int, str], str] = {}
    for p in plan.placements:
        before = [last_on[(p.node, dv)] for dv in p.devices if (p.node, dv) in last_on]
        if before:
            p.after = before[-1]
        for dv in p.devices:
            last_on[(p.node, dv)] = p.role


def plan_run(run, nodes: list[Node] | None = None, environ=None) -> DevicePlan:
    """The run's device plan on `nodes` (default: this machine's, from run.gpus / $CONVEYOR_FAKE_GPUS /
    nvidia-smi). `PlanError` when it does not fit."""
    if nodes is None:
        nodes = local_gpus(run.run.gpus, run.run.gpu_memory_gb, environ)
    plan = make_plan(demand_of(run), nodes, run.run.placement)
    if plan.layout != "cpu":
        for key, device in (("scorer.device", run.scorer.device), ("generator.device", run.generator.device)):
            if str(device).startswith("cuda:"):
                raise PlanError(f"{key}={device!r}: the plan gives each process its own GPU(s), which it sees as "
                                f"cuda:0 on; set {key} cuda")
    return plan
