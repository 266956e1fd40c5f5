"""Weight rounds inside vLLM: the worker extension, and the load an `AsyncLLM` runs around it.

The engine is created with

    LLM(model_dir, ..., worker_extension_cls="actors.engines.vllm.worker.WorkerExtension")

(or `AsyncEngineArgs(..., worker_extension_cls=...)` for `AsyncLLM`), which mixes
`WorkerExtension` into every vLLM worker. A round then runs as

    llm.collective_rpc("receive_weights", args=(to_builtins(round_info),))

Only the round (a plain map) crosses `collective_rpc`: the tensors come over the round's own
process group (collective_rpc's serialisation mangles tensors), straight into the worker.
`actors.engines.vllm.engine` makes that call and stamps the engine with the round's version.

Modes (`RoundInfo.mode`, chosen in the service's config):
- `finish`: the generator polls between batches, so nothing is running when it loads.
- `interrupt`: a generator on `AsyncLLM` loads while requests are in flight:
  `await apply_round_async(engine, info)` pauses the scheduler with
  `pause_generation(mode="keep", clear_cache=False)` (running requests are frozen, their KV cache
  kept), loads through `collective_rpc`, relabels vLLM's weight version if asked, then
  `resume_generation()`. The frozen requests finish on the new weights: their tokens before the
  pause came from the old version, the rest from the new one, and vLLM reports the label per
  generated span (see `actors.engines.vllm.engine.AsyncVLLMEngine`).

LoRA (an engine started with `enable_lora`, for a learner that trains adapters): the policy is
the base model plus one adapter, vLLM's LoRA id `LORA_ID`, which every request names. At start
`init_lora_slot` registers it as vLLM's all-zero dummy adapter (version 0 is the base). An
adapter round is written to the engine's folder in peft's format and loaded into that same id
in place (`add_lora` with `load_inplace`): requests in flight then go on with the new adapter,
as they do with new full weights, so the version labels stay right in `interrupt` mode too.
"""

from __future__ import annotations

import os
import sys
import time

LORA_NAME = "policy"
LORA_ID = 1  # the one adapter id every request uses (vLLM ids start at 1)
CPU_LINEAR_ENV = "CONVEYOR_CPU_LINEAR"  # `plain` or `packed`: generator.cpu_linear, resolved by the engine


def use_cpu_linear() -> None:
    """In a process that builds vLLM models on CPU: with `plain`, vLLM's linear layers keep their
    weights and use torch's linear (its `dispatch_cpu_unquantized_gemm` falls back to it when
    oneDNN is unavailable), so a weight round is a copy into them. Must run before the model is
    built: vLLM's worker process imports this module (the worker extension) before it loads."""
    mode = os.environ.get(CPU_LINEAR_ENV)
    if mode == "plain" or (mode == "packed" and "vllm._custom_ops" in sys.modules):
        import torch
        from vllm import _custom_ops

        _custom_ops._supports_onednn = mode == "packed" and hasattr(torch.ops._C, "create_onednn_mm_handler")


use_cpu_linear()


def lora_request(folder: str):
    """The `LoRARequest` of the policy's adapter (its files: `<folder>/rank0`)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, LORA_ID, os.path.join(folder, "rank0"))


class WorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `reload_weights`, `device`)."""

    def init_lora_slot(self, rank: int, folder: str) -> None:
        """Register the policy's adapter id as an all-zero adapter of `rank`, pinned (never evicted)."""
        req = lora_request(folder)
        self._conveyor_lora_rank = rank
        self.model_runner.lora_manager.add_dummy_lora(req, rank)
        self.model_runner.pin_lora(req.lora_int_id)

    def held_version(self) -> int:
        """The version this worker last loaded whole (0: the weights it started with). A
        tensor-parallel engine whose round failed asks every worker: ranks that disagree hold
        shards of two versions (`actors.engines.vllm.engine._VLLMBackend._ranks_agree`)."""
        return int(getattr(self, "_conveyor_version", 0))

    def receive_weights(self, round_info: dict, lora_folder: str = "") -> dict:
        """`_receive_weights`, and the version this worker then holds (`held_version`)."""
        stats = self._receive_weights(round_info, lora_folder)
        self._conveyor_version = int(stats.get("version", round_info.get("version", 0)))
        return stats

    def _receive_weights(self, round_info: dict, lora_folder: str = "") -> dict:
        """Receive a weight round and load it in place; returns stats (version, bytes, seconds).

        A same-host round through shared memory (or, for a CUDA worker, the sender's device slot
        mapped by CUDA IPC) is loaded straight out of the sender's slot
        (`weight_sync.slot.load_in_place`); `version` in the stats is the version loaded (newer
        than the round's only when a torn load was repaired). A CUDA worker receiving the NCCL
        broadcast streams it bucket by bucket into the engine (`_receive_streamed`): its extra
        device memory is two buckets, never the model. An adapter round (`info.adapter`) is
        written under `lora_folder` and loaded as the policy's adapter. Raises
        `weight_sync.receiver.RoundMissed` (through collective_rpc) when this generator was left
        out of the round; the weights are then untouched. Raises `WeightsDamaged` ("weights
        damaged: ...") when a streamed round broke off after loading began: the generator stops.
        """
        from weight_sync.messages import round_info as checked
        from weight_sync.receiver import receive_named_tensors
        from weight_sync.slot import in_place, load_in_place

        info = checked(round_info)  # a plain map across collective_rpc: checked again here
        local_rank = int(getattr(self, "rank", 0) or 0)  # tensor-parallel workers hold consecutive ranks
        device = getattr(self, "device", "cpu")
        if info.backend == "gloo":
            device = "cpu"  # gloo moves host tensors; loading copies them to the model's device
        if info.adapter is not None and not lora_folder:
            raise RuntimeError(f"round {info.round_id} carries a LoRA adapter (rank {info.adapter.r}) but this "
                               f"engine was started without LoRA: set generator.lora_rank")
        if in_place(info, device):
            stats = load_in_place(info, self._load_named, local_rank, device)
            self._after_full_load(lora_folder)
            return {**stats, "local_rank": local_rank, "load_path": self._conveyor_load_path}
        if str(device).startswith("cuda") and info.adapter is None and info.backend != "disk":
            return self._receive_streamed(info, local_rank, device, lora_folder)
        # host buffers are kept between rounds (one model copy of RAM; fresh pages cost as much as
        # the transfer); a device receives an adapter round (small) into fresh buffers
        buffers = None
        if str(device) == "cpu":
            buffers = self.__dict__.setdefault("_weight_sync_buffers", [])
        named, stats = receive_named_tensors(info, local_rank, device, buffers)
        t0 = time.monotonic()
        if info.adapter is not None:
            from vllm.lora.request import LoRARequest

            from weight_sync.adapter import write_adapter

            # each worker reads its own copy: no worker waits on another's file
            path = write_adapter(named, info.adapter, os.path.join(lora_folder, f"rank{local_rank}"))
            self.add_lora(LoRARequest(LORA_NAME, LORA_ID, path, load_inplace=True))
        else:
            finish = self._load_named(named)
            if finish is not None:
                finish()
            stats["load_path"] = self._conveyor_load_path
            self._after_full_load(lora_folder)
        stats.update(load_s=time.monotonic() - t0, version=info.version, local_rank=local_rank)
        return stats

    def _load_named(self, named: list):
        """Copy full weights `named` into the model; returns what completes the load (repacking
        layers), or None when nothing is left to do."""
        from actors.engines.vllm.load import copy_plan, finish_plan, load_plan, repack_cpu_experts

        # a repacked layer's staging weight is kept between rounds, as the receive buffers are
        plan = load_plan(self.model_runner.get_model(), named, self.__dict__.setdefault("_weight_sync_staging", {}))
        if plan is None:
            # reload_weights, not model.load_weights: the latter fails on the CPU build once the
            # weights have been repacked into kernel layout
            self.reload_weights(weights_iterator=iter(named))
            self._conveyor_load_path = "reload_weights"
            if repack_cpu_experts(self.model_runner.get_model()):
                self._conveyor_load_path = "reload_weights+repack_experts"
            return None
        copy_plan(plan, named)
        self._conveyor_load_path = "repack" if plan.rebind else "direct"
        return lambda: finish_plan(plan)

    def _receive_streamed(self, info, local_rank: int, device, lora_folder: str) -> dict:
        """A broadcast round of full weights onto this CUDA worker, each bucket loaded as it
        arrives (`weight_sync.receiver.receive_streaming`) through two receive areas of the largest
        bucket, kept between rounds (`_weight_sync_areas`: the only device memory a round adds,
        docs/weight_sync_memory.md). How a bucket is loaded: `_bucket_loader`."""
        from weight_sync.receiver import receive_streaming

        load, finish, path, stages = self._bucket_loader(info)
        areas = self.__dict__.setdefault("_weight_sync_areas", [])
        t0 = time.monotonic()
        stats = receive_streaming(info, load, local_rank, device, areas, stages=stages)
        t1 = time.monotonic()
        if finish is not None:
            finish()
        self._conveyor_load_path = path
        self._after_full_load(lora_folder)
        # the loads ran inside the transfer (overlapped with it): load_s is what came after
        stats.update(load_s=time.monotonic() - t1, stream_s=t1 - t0, load_path=path, version=info.version,
                     local_rank=local_rank)
        return stats

    def _bucket_loader(self, info):
        """(load, finish, path, stages) for a streamed round: `load(named)` takes one bucket's
        (name, view) pairs, `finish()` (or None) runs once every bucket is in.

        - "direct": the round's tensors have places in the model (`actors.engines.vllm.load.load_plan`,
          made from the manifest's shapes alone): each bucket is copied there.
        - "load_weights": no such places (a tensor-parallel engine: its parameters hold shards),
          unquantised weights: the model's own `load_weights`, bucket by bucket; each
          parameter's `weight_loader` narrows the full tensor to this rank's shard and copies it
          at once (see actors/engines/vllm/load.py), so nothing of the area is kept.
        - "staged": a quantised engine (its kernels read processed weights: only `reload_weights`
          rebuilds them, and it holds its input until a layer is complete, which a reused area
          cannot give it): each bucket goes to host buffers (one model copy of host memory, kept
          between rounds, like the CPU path's) and `reload_weights` reads them once all are in.
          The engine is untouched until then (`stages`: a broken round leaves it unchanged).
        """
        import torch

        from actors.engines.vllm.load import copy_part, load_plan
        from weight_sync import buckets as bk

        manifest = info.manifest
        model = self.model_runner.get_model()
        shapes = [(t.name, torch.empty(t.shape, dtype=bk.torch_dtype(t.dtype), device="meta"))
                  for t in manifest.tensors]
        plan = load_plan(model, shapes, None)
        if plan is not None and not plan.reprocess:
            index = {name: i for i, (name, _) in enumerate(shapes)}
            return (lambda named: copy_part(plan, index, named)), None, "direct", False
        quantization = getattr(getattr(self, "model_config", None), "quantization", None)
        if quantization is None:
            def load(named: list) -> None:
                with self._vllm_config_context(), torch.no_grad():
                    model.load_weights(iter(named))

            return load, None, "load_weights", False
        host = self.__dict__.setdefault("_weight_sync_buffers", [])
        if [b.numel() for b in host] != list(manifest.buckets) or any(b.device.type != "cpu" for b in host):
            host[:] = [torch.empty(n, dtype=torch.uint8) for n in manifest.buckets]
        into = dict(bk.unpack(manifest, host))

        def stage(named: list) -> None:
            for name, t in named:
                into[name].copy_(t)  # device to host: waits for the bucket, then the area is free

        def finish() -> None:
            self.reload_weights(weights_iterator=iter(bk.unpack(manifest, host)))

        return stage, finish, "staged_reload_weights", True

    def start_route_capture(self) -> int:
        """Record the experts every token is routed to (`actors.engines.vllm.routes`); returns the
        number of MoE layers."""
        from actors.engines.vllm.routes import RouteRecorder

        self._conveyor_routes = RouteRecorder(self.model_runner)
        return len(self._conveyor_routes.layers)

    def take_routes(self, sequences: list) -> list:
        """The recorded routes of each prompt + completion (`RouteRecorder.take`)."""
        return self._conveyor_routes.take(sequences)

    def _vllm_config_context(self):
        """vLLM's current config around a load, as its worker's own `reload_weights` sets it (some
        weight loaders read it)."""
        import contextlib

        config = getattr(self, "vllm_config", None)
        if config is None:
            return contextlib.nullcontext()
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(config)

    def _after_full_load(self, lora_folder: str) -> None:
        if lora_folder and LORA_ID not in self.list_loras():
            # full (e.g. merged) weights into a LoRA engine: the reload dropped the adapters;
            # the zero adapter again, so the requests' adapter id stays valid
            self.init_lora_slot(self._conveyor_lora_rank, lora_folder)


def rpc_timeout(info) -> float:
    """How long `collective_rpc` may take for a round: the round's own bound, and a margin to load."""
    return float(info.timeout_s) + 60.0


async def apply_round_async(engine, info, mode: str | None = None, label: str | None = None,
                            lora_folder: str = "") -> dict:
    """Load a round (a `RoundInfo`) into an `AsyncLLM`; in `interrupt` mode, around in-flight requests.

    `label`: vLLM's weight-version label to set while the scheduler is paused, so that no step
    straddles the change. `lora_folder`: where an adapter round is written (an engine with LoRA).
    Returns the first worker's stats plus `pause_s` (time spent pausing).
    """
    from weight_sync.messages import to_builtins

    interrupt = (mode or info.mode) == "interrupt"
    t0 = time.monotonic()
    if interrupt:
        await engine.pause_generation(mode="keep", clear_cache=False)  # running requests keep their KV cache
    pause_s = time.monotonic() - t0
    try:
        results = await engine.collective_rpc("receive_weights", timeout=rpc_timeout(info),
                                              args=(to_builtins(info), lora_folder))
        if label is not None:
            # while paused: every step from now on is computed by, and labelled with, the new weights
            # (the version loaded: newer than the round's after a repaired in-place load)
            loaded = results[0].get("version", info.version)
            await engine.update_weight_version(str(loaded) if loaded != info.version else label)
    finally:
        if interrupt:
            await engine.resume_generation()
    return {**results[0], "pause_s": pause_s}
