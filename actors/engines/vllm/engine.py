"""The vLLM backends: `VLLMEngine` (the offline `LLM`, which loads weights between batches) and
`AsyncVLLMEngine` (`AsyncLLM` driven from a background thread, so weights can also be loaded while
a batch is being generated: weight-sync mode `interrupt`; it stamps each token with the policy
version that sampled it). Both are built under `if __name__ == "__main__"` (vLLM spawns its engine
process); vllm is imported inside them.

Weights arrive as a weight-sync round: only the `RoundInfo` crosses `collective_rpc`, as a plain
map; the tensors come over the round's own process group, straight into the workers
(`actors.engines.vllm.worker.WorkerExtension`). A loaded round stamps the engine with its version.

With `lora_rank > 0` (a learner that trains LoRA adapters) the engine starts with vLLM's LoRA
support on (`enable_lora`, checked on the CPU build: adapters load into a running engine and
greedy outputs equal transformers' on the merged weights), every request names the policy's
adapter, and rounds carry only the adapter (`actors/engines/vllm/worker.py` has how it is loaded).

A vision-language policy (Qwen2-VL family, `learner.vision.is_vision_model`) takes each prompt's
images with it: the prompt's ids hold one `<|image_pad|>` per image, unexpanded (as
`actors.prompts.encode_prompt` writes them), and the decoded images go in the request's
`multi_modal_data`; vLLM runs the model's own processor on them and expands each pad to its image's
tokens. Ids already expanded would be expanded again. The completions carry the expanded prompt
ids (`Completion.prompt_ids`: what the model's processor gives for the text and the images, checked
on the CPU build), which the rollout keeps so that the learner's forward sees the same sequence.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import os
import shutil
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from actors.engines.base import Completion, Engine, Sampling
from actors.engines.vllm.worker import CPU_LINEAR_ENV, apply_round_async, lora_request, rpc_timeout, use_cpu_linear
from actors.prompts import placeholder_ids
from common.images import pil_image
from common.models import num_experts
from learner.vision import is_vision_model
from weight_sync.messages import RoundInfo, round_info, to_builtins

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's max_lora_rank takes


def extension_available(dotted: str) -> bool:
    """Whether the module of `pkg.mod.Class` can be found (without importing it)."""
    module = dotted.rsplit(".", 1)[0]
    try:
        return bool(dotted) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _vllm_kwargs(model: str, tokenizer: str, dtype: str, seed: int, tensor_parallel_size: int,
                 gpu_memory_utilization: float, max_model_len: int, worker_extension: str,
                 lora_rank: int = 0, record_routes: bool = False, max_images: int = 0) -> dict[str, Any]:
    """Engine arguments shared by `LLM` and `AsyncLLM`: eager mode, processed log-probs, the worker
    extension that receives weights (when its module exists), LoRA for adapters up to `lora_rank`,
    no prefix caching when the engine records routes (`actors.engines.vllm.routes`), up to
    `max_images` images per prompt and no videos for a vision-language model (0: a text model)."""
    if not gpu_memory_utilization:
        # Ask vLLM's own platform, never torch.cuda.is_available() before vllm is imported: without
        # PYTORCH_NVML_BASED_CUDA_CHECK=1 that call initialises the CUDA driver (torch/cuda/__init__.py,
        # is_available), a variable vLLM sets only on import (vllm/env_override.py), and vLLM forks
        # its engine core unless torch.cuda.is_initialized() (vllm/utils/system_utils.py,
        # _maybe_force_spawn): the forked core's CUDA cannot start. The platform probe uses NVML
        # (vllm/platforms/__init__.py, cuda_platform_plugin) and leaves the driver alone.
        from vllm.platforms import current_platform

        # On CPU this is the share of host memory for the KV cache (VLLM_CPU_KVCACHE_SPACE wins).
        gpu_memory_utilization = 0.9 if current_platform.is_cuda_alike() else 0.05
    kwargs: dict[str, Any] = dict(
        model=model, tokenizer=tokenizer or model, dtype=dtype, seed=seed,
        tensor_parallel_size=tensor_parallel_size, enforce_eager=True,
        gpu_memory_utilization=gpu_memory_utilization,
        logprobs_mode="processed_logprobs",  # log mu after temperature/top-k/top-p
    )
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if max_images:
        kwargs["limit_mm_per_prompt"] = {"image": max_images, "video": 0}
    if lora_rank:
        if lora_rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"lora_rank={lora_rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")
        # one adapter (the policy), updated in place; max_lora_rank takes a few values: the next one up
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora_rank))
    if record_routes:
        if not extension_available(worker_extension):
            raise ValueError(f"generator.record_routes needs the worker extension ({worker_extension!r} not found)")
        kwargs["enable_prefix_caching"] = False  # a cached prefix is never routed again: its routes would be missing
        # the recorder reads the V1 model runner's batch layout (actors/engines/vllm/routes.py); the
        # engine core inherits this process's environment
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if extension_available(worker_extension):
        kwargs["worker_extension_cls"] = worker_extension
    elif worker_extension:
        log.warning("worker extension %s not found: this engine cannot receive weights", worker_extension)
    return kwargs


def is_moe(model: str) -> bool:
    """Whether the model folder holds a mixture of experts. Its LoRA policy's weight rounds carry
    merged weights, not adapters (`learner.lora.sends_merged`: peft adapts the 3-D expert weights,
    and vLLM's CPU build has no LoRA kernels for fused-MoE layers: they need Triton), so its engine
    serves no adapters."""
    import json

    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return num_experts(config) > 0


def _sampling_params(n: int, sampling: Sampling, **extra):
    from vllm import SamplingParams

    return SamplingParams(
        n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed,
        stop=list(sampling.stop) or None, include_stop_str_in_output=bool(sampling.stop),
        logprobs=0,  # the sampled token's log-prob only
        **extra,
    )


def _completion(c, versions: list[int] | None = None, prompt_ids: list[int] | None = None) -> Completion:
    """A vLLM `CompletionOutput` as a `Completion` (`prompt_ids`: the request's expanded ones)."""
    ids = list(c.token_ids)
    lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
    return Completion(ids, lps, str(c.finish_reason or "length"), c.text, versions, c.stop_reason,
                      prompt_ids=prompt_ids)


def _check_images(prompt_ids: list[list[int]], images) -> list:
    """`images` as one entry per prompt (None: none has images)."""
    if images is None:
        return [None] * len(prompt_ids)
    if len(images) != len(prompt_ids):
        raise ValueError(f"{len(images)} image lists for {len(prompt_ids)} prompts: give one per prompt (or None)")
    return list(images)


def _request_prompt(ids, images):
    """The vLLM prompt of one request: its ids and, with images, their decoded pixels."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=[int(t) for t in ids])
    if images:
        prompt["multi_modal_data"] = {"image": [pil_image(bytes(b)) for b in images]}
    return prompt


def _expanded(output, images) -> list[int] | None:
    """A `RequestOutput`'s prompt ids as the engine expanded them, for a prompt with images."""
    return [int(t) for t in output.prompt_token_ids] if images else None


def _sequences(prompt_ids: list[list[int]], out: list[list[Completion]]) -> list[list[int]]:
    return [[int(t) for t in (p if c.prompt_ids is None else c.prompt_ids)] + list(c.token_ids)
            for p, cs in zip(prompt_ids, out) for c in cs]


def _attach_routes(out: list[list[Completion]], taken: list) -> None:
    """Give each completion the routes the worker recorded for it (`RouteRecorder.take`); a
    completion whose routes were not found has none (the generator fails its group)."""
    import numpy as np

    flat = [c for cs in out for c in cs]
    for c, got in zip(flat, taken):
        if got is not None:
            data, shape = got
            c.routes = np.frombuffer(data, np.uint8 if len(data) == int(np.prod(shape)) else np.dtype("<u2")) \
                .reshape(shape)


class _VLLMBackend(Engine):
    """What both vLLM engines share: their arguments, and the check before a round is loaded."""

    def __init__(self, model: str, *, tokenizer: str = "", dtype: str = "float32", seed: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0, max_model_len: int = 0,
                 worker_extension: str = "actors.engines.vllm.worker.WorkerExtension", lora_rank: int = 0,
                 cpu_linear: str = "auto", record_routes: bool = False, max_images_per_prompt: int = 1):
        # a mixture of experts' LoRA rounds carry merged weights (learner.lora.sends_merged): no adapters
        # (and a vision-language model's: learner.lora.sends_merged)
        served_rank = 0 if lora_rank and (is_moe(model) or is_vision_model(model)) else lora_rank
        if max_images_per_prompt < 1:
            raise ValueError(f"max_images_per_prompt={max_images_per_prompt} must be >= 1")
        max_images = max_images_per_prompt if is_vision_model(model) else 0
        kwargs = _vllm_kwargs(model, tokenizer, dtype, seed, tensor_parallel_size, gpu_memory_utilization,
                              max_model_len, worker_extension, served_rank, record_routes, max_images)
        self.record_routes = record_routes
        self.vision = max_images > 0  # (its encoder cache holds image features the old weights computed)
        # read by the worker extension's module in vLLM's worker process, before the model is built
        os.environ[CPU_LINEAR_ENV] = "plain" if cpu_linear == "plain" or (cpu_linear == "auto" and dtype == "float32") \
            else "packed"
        use_cpu_linear()  # (for an engine core in this process)
        self.has_extension = "worker_extension_cls" in kwargs
        self.tensor_parallel_size = tensor_parallel_size
        self.version = 0
        # LoRA: where adapter rounds are written, and the request every prompt names (None: no LoRA)
        self.lora_folder = tempfile.mkdtemp(prefix="conveyor-lora-") if served_rank else ""
        self.lora_request = lora_request(self.lora_folder) if served_rank and self.has_extension else None
        try:
            self._start_engine(kwargs)
            self.placeholder_ids = placeholder_ids(self.tokenizer) if max_images else ()
            if served_rank and self.has_extension:
                self._rpc("init_lora_slot", (kwargs["max_lora_rank"], self.lora_folder))
            if record_routes:
                self.route_layers = self._rpc("start_route_capture", ())[0]
        except BaseException:
            self._remove_lora_folder()
            raise

    def _start_engine(self, kwargs: dict) -> None:
        raise NotImplementedError

    def _rpc(self, method: str, args: tuple) -> list:
        raise NotImplementedError

    def _ranks_agree(self, error: BaseException) -> None:
        """After a failed round: on a tensor-parallel engine, a worker that loaded the round while
        another was left out (each rank is a member of its own) leaves shards of two versions:
        then "weights damaged", which stops the generator (`weight_sync.receiver.fatal`) rather
        than serve them. Returns when every worker holds the same version."""
        if self.tensor_parallel_size < 2:
            return
        try:
            held = [int(v) for v in self._rpc("held_version", ())]
        except Exception as e:  # a worker that cannot answer: its weights are unknown
            raise RuntimeError(f"weights damaged: after a failed round ({error}) the workers could not say "
                               f"which version they hold ({e})") from error
        if len(set(held)) > 1:
            raise RuntimeError(f"weights damaged: after a failed round ({error}) the tensor-parallel workers hold "
                               f"versions {held}") from error

    def _round(self, info) -> RoundInfo:
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot receive weights")
        return round_info(info)

    def _remove_lora_folder(self) -> None:
        if self.lora_folder:
            shutil.rmtree(self.lora_folder, ignore_errors=True)


class VLLMEngine(_VLLMBackend):
    """vLLM's offline `LLM`, eager mode, fed token ids; must be built under `if __name__ == "__main__"`
    (vLLM spawns its engine process)."""

    def _start_engine(self, kwargs: dict) -> None:
        import vllm

        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def _rpc(self, method: str, args: tuple) -> list:
        return self.llm.collective_rpc(method, args=args)

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling,
                 images: list[list[bytes] | None] | None = None) -> list[list[Completion]]:
        from vllm.exceptions import VLLMClientError

        images = _check_images(prompt_ids, images)
        prompts = [_request_prompt(p, imgs) for p, imgs in zip(prompt_ids, images)]
        try:
            outputs = self.llm.generate(prompts, _sampling_params(n, sampling), use_tqdm=False,
                                        lora_request=self.lora_request)
        except VLLMClientError as e:  # the Engine contract: refused inputs (too many images, ...) raise ValueError
            raise ValueError(str(e)) from e
        out = [[_completion(c, prompt_ids=_expanded(o, imgs)) for c in o.outputs] for o, imgs in zip(outputs, images)]
        if self.record_routes:  # (the first worker's: every tensor-parallel rank routes alike)
            _attach_routes(out, self.llm.collective_rpc("take_routes", args=(_sequences(prompt_ids, out),))[0])
        return out

    def receive_weights(self, info: RoundInfo) -> dict:
        info = self._round(info)
        # Only the round (plain data) crosses collective_rpc; the tensors come over the round's own
        # process group, straight into the workers (actors/engines/vllm/worker.py).
        try:
            stats = self.llm.collective_rpc("receive_weights", timeout=rpc_timeout(info),
                                            args=(to_builtins(info), self.lora_folder))[0]
        except Exception as e:
            self._ranks_agree(e)
            raise
        # Cached prefix blocks hold keys/values the old weights computed: a new prompt must not reuse
        # them. Nothing runs between batches, so the reset succeeds.
        self.llm.reset_prefix_cache()
        if self.vision:  # and so do the cached features of images seen before (vLLM's encoder cache)
            self.llm.llm_engine.reset_encoder_cache()
        self.version = stats.get("version", info.version)  # newer after a repaired in-place load
        return stats

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None
        self._remove_lora_folder()


def _token_versions(c) -> list[int]:
    """(T,) policy version of each token of a finished vLLM `CompletionOutput`, from its
    `weight_versions` spans ([start, end) token ranges and the label the engine core had when it
    sampled them; our labels are str(version))."""
    versions: list[int] = []
    for span in c.weight_versions or []:
        if span.start != len(versions):
            break
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != len(c.token_ids):
        raise RuntimeError(f"vLLM's weight-version spans {c.weight_versions} do not cover the "
                           f"{len(c.token_ids)} tokens of a completion")
    return versions


class AsyncVLLMEngine(_VLLMBackend):
    """vLLM's `AsyncLLM` on an asyncio loop in a background thread: weights can be loaded while a
    batch is being generated (weight-sync mode `interrupt`). Built under `if __name__ == "__main__"`
    like `VLLMEngine`.

    `submit` hands a batch to the loop and returns a future at once; all its requests go to the
    engine together, so the scheduler batches them as `LLM.generate` would. `receive_weights` of an
    `interrupt` round, called from another thread meanwhile, pauses the scheduler with the running
    requests frozen and their KV cache kept, loads, relabels the weights, and resumes: the requests
    finish on the new weights.

    Which weights sampled a token is recorded by vLLM itself: the engine core labels the outputs
    of every step with its current weight-version label, and a finished completion lists the spans
    of tokens per label (`CompletionOutput.weight_versions`). The label is set to the policy version
    while the scheduler is paused, so no step straddles a change; counting streamed tokens on this
    side instead could race the output handler, which may still hold the last step before the pause.

    A token sampled after a switch attends to keys and values that the old weights computed for the
    tokens before it (the cache is kept, not recomputed): its behaviour log-prob is what it was
    really drawn from, not a full forward pass of the new weights, and the learner's pi_old / mu
    weight corrects for the difference as for any other staleness.
    """

    loads_mid_batch = True

    def _start_engine(self, kwargs: dict) -> None:
        self.llm = None
        self._request_ids = itertools.count()
        self._batches: set[asyncio.Task] = set()  # touched on the loop's thread only
        self._prefix_cache_stale = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-asyncio", daemon=True)
        self._thread.start()
        try:
            self._run(self._start(kwargs))
        except BaseException:
            self._stop_loop()
            raise
        self.tokenizer = self.llm.get_tokenizer()

    def _rpc(self, method: str, args: tuple) -> list:
        return self._run(self.llm.collective_rpc(method, args=args))

    def _run(self, coro, timeout: float | None = None):
        """Run `coro` on the engine's loop; block this thread for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, kwargs: dict) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Built on the loop, so that its output handler task runs there. Not a local: something in
        # vLLM's start-up keeps this frame alive, and `close` must drop the last reference.
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, disable_log_stats=True))
        await self.llm.update_weight_version(str(self.version))

    def submit(self, prompt_ids: list[list[int]], n: int, sampling: Sampling,
               images: list[list[bytes] | None] | None = None) -> Future:
        """Start a batch; a future of what `generate` returns."""
        images = _check_images(prompt_ids, images)
        # (images decoded here, not on the engine's loop: its output handler keeps running meanwhile)
        prompts = [_request_prompt(p, imgs) for p, imgs in zip(prompt_ids, images)]
        return asyncio.run_coroutine_threadsafe(self._generate(prompt_ids, prompts, n, sampling, images), self._loop)

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling,
                 images: list[list[bytes] | None] | None = None) -> list[list[Completion]]:
        return self.submit(prompt_ids, n, sampling, images).result()

    async def _generate(self, prompt_ids, prompts: list, n: int, sampling: Sampling,
                        images: list) -> list[list[Completion]]:
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        task = asyncio.current_task()
        self._batches.add(task)
        try:
            if self._prefix_cache_stale:
                # Blocks cached before a load hold the old weights' keys and values: new prompts must
                # not reuse them. Reset once no batch runs (a running request holds its blocks).
                if len(self._batches) == 1:
                    if self.vision:  # the encoder cache's image features too (the old weights computed them)
                        await self.llm.reset_encoder_cache()
                    self._prefix_cache_stale = not await self.llm.reset_prefix_cache()
            # FINAL_ONLY: the finished completions only (the version spans come with them)
            params = _sampling_params(n, sampling, output_kind=RequestOutputKind.FINAL_ONLY)
            try:
                # a failing request (one the engine refuses) cancels, and so aborts, the others
                async with asyncio.TaskGroup() as tg:
                    requests = [tg.create_task(self._request(prompt, params)) for prompt in prompts]
            except ExceptionGroup as eg:
                e = eg.exceptions[0]
                if isinstance(e, VLLMClientError):  # the Engine contract: refused inputs raise ValueError
                    raise ValueError(str(e)) from e
                raise e from None
            out = [[_completion(c, _token_versions(c), _expanded(r.result(), imgs)) for c in r.result().outputs]
                   for r, imgs in zip(requests, images)]
            if self.record_routes:
                taken = await self.llm.collective_rpc("take_routes", args=(_sequences(prompt_ids, out),))
                _attach_routes(out, taken[0])
            return out
        finally:
            self._batches.discard(task)

    async def _request(self, prompt, params):
        final = None
        async for final in self.llm.generate(prompt, params, request_id=f"conveyor-{next(self._request_ids)}",
                                             lora_request=self.lora_request):
            pass
        return final

    def receive_weights(self, info: RoundInfo) -> dict:
        """Load a round. In `interrupt` mode around the batch in flight (if any): pause, load,
        relabel, resume; otherwise (`finish`) the caller calls this between batches."""
        try:
            return self._run(self._receive(self._round(info)))
        except Exception as e:
            self._ranks_agree(e)
            raise

    async def _receive(self, info: RoundInfo) -> dict:
        # the label is the policy version, set while the scheduler is paused (see the class docstring)
        stats = await apply_round_async(self.llm, info, label=str(info.version), lora_folder=self.lora_folder)
        self.version = stats.get("version", info.version)  # newer after a repaired in-place load
        self._prefix_cache_stale = True
        return stats

    def close(self) -> None:
        if self.llm is None:
            return
        try:
            self._run(self._shutdown(), timeout=60)
        finally:
            self.llm = None
            self._stop_loop()
            self._remove_lora_folder()

    async def _shutdown(self) -> None:
        # a batch still in flight (a second signal interrupted it): cancelling aborts its requests
        for task in self._batches:
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        self.llm.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
