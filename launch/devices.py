"""The device plan: which GPUs each role process gets, what share of their memory, and whether it fits.

Decided once per run, before any role starts, by both launchers (`launch.local`, `launch.ray`),
and printed by `--plan`. Everything here is plain arithmetic on the run config and the list of
GPUs (no CUDA call), so every layout is tested on a CPU machine:

    GPUs   run.gpus (a list of device indices), else $CONVEYOR_FAKE_GPUS ("8", "2x8", "8:141": N GPUs
           of G GiB on each of K nodes, for planning on a machine without them), else nvidia-smi
           (no CUDA initialisation); none found: every role runs on the CPU, nothing is planned
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
    memory per device, estimated from each model folder (parameter count from its safetensors
           headers, else config.json; run.model_params_b when the folder is not on this machine):
             learner rank   ZeRO/Adam: weights (dtype) + gradients (dtype) + Adam (fp32 master when
                            not fp32, m, v), each divided by the ranks from the ZeRO stage that
                            shards it; LoRA: the frozen weights only; a critic the same again;
                            rank 0 also two weight-sync buckets while it sends, and the device slot
                            when an engine shares its GPU (weight_sync.same_host=broadcast drops
                            it); plus ACTIVATION_GB + CONTEXT_GB
             engine         its share of the device (vLLM pre-allocates it), which must hold the
                            weights / TP, one max_model_len sequence of KV cache and ACTIVATION_GB;
                            the weight round's receive area (2 x weight_sync.bucket_mb) and a CUDA
                            context come on top of the share
             scorer         reward model + reference model (scorer.dtype) + ACTIVATION_GB + CONTEXT_GB
           A device whose processes need more than USABLE of it is refused with the numbers and the
           knob to turn (launch exits 2, the config error code).

Each role process gets its devices as CUDA_VISIBLE_DEVICES (the plan's indices mapped through the
launcher's own CUDA_VISIBLE_DEVICES), an engine its gpu_memory_utilization as a config override,
the learner and a shared-device scorer `CONVEYOR_CUDA_MEMORY_FRACTION` (applied with
`torch.cuda.set_per_process_memory_fraction`, so a role over its budget fails itself rather than
its neighbour). Roles that share a device start one after another, each once the previous is
ready: vLLM measures its own use of the device at start-up from the device's free memory, which
another process allocating or freeing meanwhile would falsify.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

FAKE_ENV = "CONVEYOR_FAKE_GPUS"
FRACTION_ENV = "CONVEYOR_CUDA_MEMORY_FRACTION"
FAKE_GPU_GB = 80.0  # a fake GPU's memory unless "N:GiB" says otherwise
GIB = float(1 << 30)
CONTEXT_GB = 0.75  # a CUDA context and the libraries' workspaces, per process and device (outside torch's allocator)
ACTIVATION_GB = 2.0  # activations and temporaries of a forward/backward (gradient checkpointing on for big models)
USABLE = 0.95  # of a device's memory, what the plan hands out (the rest: fragmentation, NCCL's buffers)
ENGINE_DEFAULT = 0.9  # vLLM's own default gpu_memory_utilization, for an engine with a device to itself
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PLACEMENTS = ("auto", "separate", "colocate", "colocate_scorers")


class PlanError(ValueError):
    """The layout cannot work (too few devices, or a device over its memory); the message has the
    numbers and the knob to turn."""


@dataclass(frozen=True)
class Gpu:
    index: str  # the id CUDA_VISIBLE_DEVICES takes on its node (nvidia-smi's index)
    memory_gb: float
    name: str = ""
    uuid: str = ""


@dataclass
class Node:
    name: str
    gpus: list[Gpu]


# ---- model sizes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    params: int  # parameter count
    largest: int = 0  # elements of the largest tensor (a weight round's bucket holds it whole)
    layers: int = 0
    kv_bytes_per_token: int = 0  # K and V of every layer for one token, at 2 bytes an element
    source: str = ""  # where the numbers came from


def _safetensors_params(folder: Path) -> tuple[int, int] | None:
    """(parameters, elements of the largest tensor) in a folder's safetensors files, from their
    headers alone (no tensor is read)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = largest = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                numel = math.prod(meta.get("shape") or [1])
                total += numel
                largest = max(largest, numel)
    return total, largest


def params_from_config(cfg: dict) -> int:
    """A decoder's parameter count from its config.json (Llama, Qwen, Mistral and their MoE kin):
    embeddings, attention, (gated) MLP or routed experts, norms, the LM head unless tied."""
    cfg = cfg.get("text_config", cfg)  # a vision-language model: its language model
    h, n_layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg.get("num_attention_heads", 1)
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    inter = cfg.get("intermediate_size", 4 * h)
    if experts:
        moe_inter = cfg.get("moe_intermediate_size") or inter
        shared = cfg.get("shared_expert_intermediate_size") or (cfg.get("n_shared_experts") or 0) * moe_inter
        mlp = experts * 3 * h * moe_inter + h * experts + 3 * h * shared
    else:
        mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    return vocab * h + n_layers * per_layer + h + head


def model_size(folder: str, params_b: float = 0.0) -> ModelSize | None:
    """The size of the model in `folder`; `params_b` (billions) when given wins. None when neither
    the folder nor `params_b` tells (the memory check is then skipped, and the plan says so)."""
    path = Path(folder) if folder else None
    cfg = {}
    if path is not None and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    layers = int(text.get("num_hidden_layers", 0) or 0)
    kv_per_token = 0
    if layers:
        heads = text.get("num_attention_heads", 1)
        kv = text.get("num_key_value_heads") or heads
        hd = text.get("head_dim") or text["hidden_size"] // heads
        kv_per_token = 2 * layers * kv * hd * 2
    embedding = int(text.get("vocab_size", 0) or 0) * int(text.get("hidden_size", 0) or 0)
    if params_b:
        return ModelSize(int(params_b * 1e9), embedding, layers, kv_per_token, "run.model_params_b")
    if path is None or not path.is_dir():
        return None
    found = _safetensors_params(path)
    if found:
        return ModelSize(found[0], found[1], layers, kv_per_token, "safetensors headers")
    if cfg:
        try:
            return ModelSize(params_from_config(cfg), embedding, layers, kv_per_token, "config.json")
        except KeyError:
            return None
    return None


# ---- finding the GPUs ---------------------------------------------------------------------------


def parse_fake(spec: str) -> list[Node]:
    """$CONVEYOR_FAKE_GPUS: "8" (one node of 8), "2x8" (2 nodes of 8), "8:141" (141 GiB each)."""
    text, _, mem = spec.strip().partition(":")
    nodes, _, per = text.rpartition("x")
    try:
        n_nodes, n_gpus = int(nodes or 1), int(per)
        gb = float(mem) if mem else FAKE_GPU_GB
    except ValueError:
        raise PlanError(f"{FAKE_ENV}={spec!r}: expected N, KxN or N:GiB (e.g. 8, 2x8, 8:141)") from None
    if n_nodes < 1 or n_gpus < 0 or gb <= 0:
        raise PlanError(f"{FAKE_ENV}={spec!r}: counts must be positive")
    return [Node(f"node{k}", [Gpu(str(i), gb, "fake") for i in range(n_gpus)]) for k in range(n_nodes)]


def nvidia_smi() -> list[Gpu]:
    """This machine's GPUs as nvidia-smi lists them (NVML: no CUDA context is made), or []."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode:
        return []
    gpus = []
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            gpus.append(Gpu(parts[0], float(parts[2]) / 1024, parts[3], parts[1]))
    return gpus


def cpu_torch() -> bool:
    """Whether the installed torch is a CPU build (`make install STACK=cpu` on a GPU machine): then
    no role can use the GPUs nvidia-smi lists. Read from the package's version, without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def local_gpus(gpus: str = "auto", memory_gb: float = 0.0, environ=None) -> list[Node]:
    """This machine's GPUs for a run (`run.gpus`: `auto`, `none` or a list such as "0,1,2,3"), as
    one node; `memory_gb` overrides what each reports (0: as found).

    Only the GPUs the launcher itself may use: with CUDA_VISIBLE_DEVICES set (a scheduler's share
    of the machine, indices or UUIDs), those, in that order. Each keeps nvidia-smi's index, which
    is what the roles' own CUDA_VISIBLE_DEVICES name (with CUDA_DEVICE_ORDER=PCI_BUS_ID, so that
    CUDA counts as nvidia-smi does)."""
    environ = os.environ if environ is None else environ
    fake = environ.get(FAKE_ENV, "").strip()
    if gpus.strip() == "none":
        return [Node("local", [])]
    if fake:
        found = parse_fake(fake)[0].gpus
    elif cpu_torch():
        return [Node("local", [])]
    else:
        found = nvidia_smi()
    outer = [x.strip() for x in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if "CUDA_VISIBLE_DEVICES" in environ:
        by_id = {**{g.index: g for g in found}, **{g.uuid: g for g in found if g.uuid}}
        found = [by_id[x] for x in outer if x in by_id]  # ("" or "-1": none at all)
    by_index = {g.index: g for g in found}
    if gpus.strip() not in ("", "auto"):
        wanted = [x.strip() for x in gpus.split(",") if x.strip()]
        unknown = [i for i in wanted if i not in by_index]
        if unknown and found:
            raise PlanError(f"run.gpus={gpus!r}: no GPU {', '.join(unknown)} here (this launcher may use "
                            f"{', '.join(by_index) or 'none'})")
        chosen = [by_index.get(i, Gpu(i, memory_gb or 0.0)) for i in wanted]
    else:
        chosen = found
    if memory_gb:
        chosen = [Gpu(g.index, memory_gb, g.name, g.uuid) for g in chosen]
    return [Node("local", chosen)]


# ---- the plan -----------------------------------------------------------------------------------


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
        lines.append(f"  {'node':<8} {'gpu':<4} {'GiB':>6}  {'use GiB':>8}  processes (share of the device, estimated GiB)")
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


@dataclass(frozen=True)
class Demand:
    """What a run asks for, read off its config (kept apart so tests can state it directly)."""

    learner_ranks: int
    generators: int
    tp: int
    gpu_scorers: int
    vllm: bool = True
    engine_share: float = 0.0  # generator.gpu_memory_utilization; 0 = decide
    learner_gb: tuple[float, ...] = ()  # per rank, estimated
    learner_parts: str = ""
    slot_gb: float = 0.0  # rank 0's weight-sync device slot, when an engine shares its GPU
    engine_need_gb: float = 0.0  # what an engine's share must hold (per device)
    engine_parts: str = ""
    engine_extra_gb: float = 0.0  # outside the share: receive area, context
    scorer_gb: float = 0.0
    scorer_parts: str = ""
    checked: bool = True
    send_gb: float = 0.0  # rank 0's buckets on the device while it broadcasts (two at most)


def learner_gb(size: ModelSize, ranks: int, zero: int, dtype: str, lora: bool) -> tuple[float, str]:
    """One learner rank's model, gradients and optimizer state in GiB, and how it was counted.

    Mixed precision Adam holds weights (2 B) + gradients (2 B) + fp32 master, m and v (12 B) per
    parameter, 16 B in all (fp32 training: 4 + 4 + 8, also 16); ZeRO-1 shards the optimizer state
    over the ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too. LoRA trains a few adapters:
    the frozen weights alone count."""
    w = DTYPE_BYTES[dtype]
    opt = 8 + (4 if w != 4 else 0)
    p = size.params
    weights = p * w / (ranks if zero >= 3 else 1)
    if lora:
        return weights / GIB, f"weights {weights / GIB:.1f} (LoRA: adapters only trained)"
    grads = p * w / (ranks if zero >= 2 else 1)
    state = p * opt / (ranks if zero >= 1 else 1)
    total = weights + grads + state
    return total / GIB, (f"weights {weights / GIB:.1f} + grads {grads / GIB:.1f} + Adam {state / GIB:.1f} "
                         f"(ZeRO-{zero}, {ranks} rank(s))")


def demand_of(run) -> Demand:
    """The run's demand: process counts from `run:`, sizes from the model folders."""
    r, g, s, l, w = run.run, run.generator, run.scorer, run.learner, run.weight_sync
    # a vLLM engine, or the debugging transformers backend on a CUDA device, takes devices
    vllm = g.engine == "vllm" or str(g.device).startswith("cuda")
    gpu_scorers = r.num_scorers if str(s.device).startswith("cuda") else 0
    policy = model_size(l.model_path, r.model_params_b)
    checked = policy is not None
    lgb, lparts = (0.0, "size unknown")
    slot = 0.0
    if policy is not None:
        lgb, lparts = learner_gb(policy, r.learner_ranks, l.zero_stage, l.dtype, bool(l.lora_rank))
        if l.critic_path:
            critic = model_size(l.critic_path) or policy
            cgb, _ = learner_gb(critic, r.learner_ranks, l.zero_stage, l.dtype, False)
            lgb += cgb
            lparts += f" + critic {cgb:.1f}"
        if w.same_host != "broadcast" and not l.lora_rank:
            slot = policy.params * DTYPE_BYTES[l.dtype] / GIB

    # a weight round's bucket: weight_sync.bucket_mb, or the largest tensor, which travels whole
    bucket = max(w.bucket_mb / 1024, (policy.largest * DTYPE_BYTES[l.dtype] / GIB) if policy else 0.0)
    base = lgb + ACTIVATION_GB + CONTEXT_GB
    lparts += f" + activations {ACTIVATION_GB:.1f} + context {CONTEXT_GB:.2f}"
    per_rank = tuple(base for _ in range(r.learner_ranks))
    engine_need = engine_extra = 0.0
    eparts = ""
    if policy is not None and vllm:
        tp = g.tensor_parallel_size
        weights = policy.params * DTYPE_BYTES[g.dtype] / tp / GIB
        max_len = g.max_model_len or g.prompt_max_len + g.max_new_tokens
        kv = policy.kv_bytes_per_token * max_len / tp / GIB
        engine_need = weights + kv + ACTIVATION_GB
        eparts = (f"weights {weights:.1f} + one {max_len}-token sequence's KV {kv:.2f} + activations {ACTIVATION_GB:.1f}"
                  if policy.kv_bytes_per_token else f"weights {weights:.1f} + activations {ACTIVATION_GB:.1f} (KV: "
                                                    f"layers unknown without the folder)")

    if vllm:  # the round's two receive areas and the engine's CUDA context, outside its share
        engine_extra = 2 * bucket + CONTEXT_GB
    scorer = 0.0
    sparts = ""
    if gpu_scorers:
        for kind, folder in (("reward model", s.reward_model), ("reference", s.reference)):
            if folder:
                size = model_size(folder) or model_size(l.model_path, r.model_params_b)  # (absent: the policy's size)
                if size is None:
                    checked = False
                    continue
                gb = size.params * DTYPE_BYTES[s.dtype] / GIB
                scorer += gb
                sparts += f"{kind} {gb:.1f} + "
        scorer += ACTIVATION_GB + CONTEXT_GB
        sparts += f"activations {ACTIVATION_GB:.1f} + context {CONTEXT_GB:.2f}"
    return Demand(r.learner_ranks, r.num_generators, g.tensor_parallel_size if vllm else 1, gpu_scorers, vllm,
                  g.gpu_memory_utilization, per_rank, lparts, slot, engine_need, eparts, engine_extra,
                  scorer, sparts, checked, send_gb=2 * bucket)


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
