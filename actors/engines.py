"""Generation engines: the interface a generator drives, and its backends.

`VLLMEngine` is the default: vLLM's offline `LLM`, which loads weights between batches.
`AsyncVLLMEngine` drives vLLM's `AsyncLLM` from a background thread instead, so that weights can
also be loaded while a batch is being generated (weight-sync mode `interrupt`); it stamps each
token with the policy version that sampled it. `TransformersEngine` is a plain sampling loop over
a Hugging Face model with a KV cache: slow, but easy to step through, and a second opinion on
vLLM's numbers.

All return, for each sampled token, its behaviour log-prob `log mu(token)` under the distribution
it was actually drawn from: log_softmax(logits / T) after top-k/top-p masking and renormalisation
(vLLM's `processed_logprobs`). With temperature 0 (greedy) it is log_softmax(logits).

torch and vllm are imported inside the backends, so importing this module is cheap.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import logging
import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

log = logging.getLogger(__name__)


@dataclass
class Sampling:
    """How to sample; `top_k=0` and `top_p=1` switch those filters off, `temperature=0` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    seed: int | None = None  # per-call seed (reproducible samples); None: the engine's stream


@dataclass
class Completion:
    """One sampled completion: its tokens, the behaviour log-prob of each, why it ended, its text."""

    token_ids: list[int]
    logprobs: list[float]  # (T,) log mu of each sampled token
    finish_reason: str  # "stop" (eos or a stop token, which is kept) | "length"
    text: str
    # (T,) policy version of the weights that sampled each token, from an engine whose weights can
    # change mid-completion (AsyncVLLMEngine); None: every token has the engine's version at the
    # start of the batch
    versions: list[int] | None = None


class Engine(ABC):
    """What a generator needs from an inference engine. `version` is the policy version of the
    weights it holds; the generator stamps it on every token it samples."""

    version: int = 0
    tokenizer: Any = None
    loads_mid_batch: bool = False
    """True for an engine with `submit(prompt_ids, n, sampling) -> Future` that returns at once and
    a `receive_weights` that may run while that batch generates (weight-sync mode `interrupt`); its
    completions then carry per-token `versions`."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        """`n` completions of each prompt, in prompt order."""

    @abstractmethod
    def receive_weights(self, round_info: dict) -> None:
        """Join a weight-sync round (see weight_sync/) and load the broadcast weights in place."""

    @abstractmethod
    def load_state_dict(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load weights given directly as (Hugging Face name, tensor) pairs."""

    def close(self) -> None:
        """Free the engine (processes, memory)."""


def process_logits(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The logits a token is sampled from: scaled by 1/T, then top-k and top-p masked to -inf.

    logits: (N, V) -> (N, V) fp32. The same order and tie rules as vLLM's sampler (temperature
    first; top-p keeps tokens until the ascending cumulative probability passes 1 - p, and always
    the most likely one), so log_softmax of the result is vLLM's processed log-prob.
    Temperature 0 (greedy) leaves the logits unscaled and unfiltered, as vLLM does.
    """
    import torch

    logits = logits.float()
    if temperature <= 0:
        return logits
    logits = logits / temperature
    if top_k <= 0 and top_p >= 1.0:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=False)  # (N, V) ascending
    if 0 < top_k < vocab:
        kth = sorted_logits[:, vocab - top_k].unsqueeze(-1)  # (N, 1) the k-th largest
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p < 1.0:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # (N, V)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False  # keep at least the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def _stop_ids(tokenizer, model_path: str, extra: Sequence[int]) -> set[int]:
    """eos ids of the tokenizer and of generation_config.json, plus `extra`."""
    ids = set(int(t) for t in extra)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:  # no generation_config.json
        pass
    return ids


# --------------------------------------------------------------------------------------------
# vLLM


def extension_available(dotted: str) -> bool:
    """Whether the module of `pkg.mod.Class` can be found (without importing it)."""
    module = dotted.rsplit(".", 1)[0]
    try:
        return bool(dotted) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _vllm_kwargs(model: str, tokenizer: str, dtype: str, seed: int, tensor_parallel_size: int,
                 gpu_memory_utilization: float, max_model_len: int, worker_extension: str) -> dict[str, Any]:
    """Engine arguments shared by `LLM` and `AsyncLLM`: eager mode, processed log-probs, the worker
    extension that receives weights (when its module exists)."""
    import torch

    if not gpu_memory_utilization:
        # On CPU this is the share of host memory for the KV cache (VLLM_CPU_KVCACHE_SPACE wins).
        gpu_memory_utilization = 0.9 if torch.cuda.is_available() else 0.05
    kwargs: dict[str, Any] = dict(
        model=model, tokenizer=tokenizer or model, dtype=dtype, seed=seed,
        tensor_parallel_size=tensor_parallel_size, enforce_eager=True,
        gpu_memory_utilization=gpu_memory_utilization,
        logprobs_mode="processed_logprobs",  # log mu after temperature/top-k/top-p
    )
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    if extension_available(worker_extension):
        kwargs["worker_extension_cls"] = worker_extension
    elif worker_extension:
        log.warning("worker extension %s not found: this engine cannot receive weights", worker_extension)
    return kwargs


def _sampling_params(n: int, sampling: Sampling, **extra):
    from vllm import SamplingParams

    return SamplingParams(
        n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed,
        logprobs=0,  # the sampled token's log-prob only
        **extra,
    )


def _completion(c, versions: list[int] | None = None) -> Completion:
    """A vLLM `CompletionOutput` as a `Completion`."""
    ids = list(c.token_ids)
    lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
    return Completion(ids, lps, str(c.finish_reason or "length"), c.text, versions)


class VLLMEngine(Engine):
    """vLLM's offline `LLM`, eager mode, fed token ids; must be built under `if __name__ == "__main__"`
    (vLLM spawns its engine process)."""

    def __init__(self, model: str, *, tokenizer: str = "", dtype: str = "float32", seed: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0, max_model_len: int = 0,
                 worker_extension: str = "actors.vllm_worker.WorkerExtension"):
        import vllm

        kwargs = _vllm_kwargs(model, tokenizer, dtype, seed, tensor_parallel_size, gpu_memory_utilization,
                              max_model_len, worker_extension)
        self.has_extension = "worker_extension_cls" in kwargs
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids]
        outputs = self.llm.generate(prompts, _sampling_params(n, sampling), use_tqdm=False)
        return [[_completion(c) for c in out.outputs] for out in outputs]

    def receive_weights(self, round_info: dict) -> None:
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot receive weights")
        # Only the round_info (plain data) crosses collective_rpc; the tensors come over the round's
        # own process group, straight into the workers (actors/vllm_worker.py).
        timeout = float(round_info.get("timeout_s", 600.0)) + 60.0
        self.llm.collective_rpc("receive_weights", timeout=timeout, args=(round_info,))
        # Cached prefix blocks hold keys/values the old weights computed: a new prompt must not reuse
        # them. Nothing runs between batches, so the reset succeeds.
        self.llm.reset_prefix_cache()

    def load_state_dict(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        # Needs a `load_named_tensors` method on the worker extension. collective_rpc's serialisation
        # is not reliable for tensors (DESIGN.md): use it for small debugging loads only; real
        # weights arrive by receive_weights over a process group.
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot load weights")
        self.llm.collective_rpc("load_named_tensors", args=(list(named_tensors),))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None


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


class AsyncVLLMEngine(Engine):
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

    def __init__(self, model: str, *, tokenizer: str = "", dtype: str = "float32", seed: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0, max_model_len: int = 0,
                 worker_extension: str = "actors.vllm_worker.WorkerExtension"):
        kwargs = _vllm_kwargs(model, tokenizer, dtype, seed, tensor_parallel_size, gpu_memory_utilization,
                              max_model_len, worker_extension)
        self.has_extension = "worker_extension_cls" in kwargs
        self.version = 0
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

    def submit(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> Future:
        """Start a batch; a future of what `generate` returns."""
        return asyncio.run_coroutine_threadsafe(self._generate(prompt_ids, n, sampling), self._loop)

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        return self.submit(prompt_ids, n, sampling).result()

    async def _generate(self, prompt_ids, n: int, sampling: Sampling) -> list[list[Completion]]:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        task = asyncio.current_task()
        self._batches.add(task)
        try:
            if self._prefix_cache_stale:
                # Blocks cached before a load hold the old weights' keys and values: new prompts must
                # not reuse them. Reset once no batch runs (a running request holds its blocks).
                if len(self._batches) == 1:
                    self._prefix_cache_stale = not await self.llm.reset_prefix_cache()
            # FINAL_ONLY: the finished completions only (the version spans come with them)
            params = _sampling_params(n, sampling, output_kind=RequestOutputKind.FINAL_ONLY)
            try:
                # a failing request (one the engine refuses) cancels, and so aborts, the others
                async with asyncio.TaskGroup() as tg:
                    requests = [tg.create_task(self._request(TokensPrompt(prompt_token_ids=[int(t) for t in p]),
                                                             params)) for p in prompt_ids]
            except ExceptionGroup as eg:
                e = eg.exceptions[0]
                if isinstance(e, VLLMClientError):  # the Engine contract: refused inputs raise ValueError
                    raise ValueError(str(e)) from e
                raise e from None
            return [[_completion(c, _token_versions(c)) for c in r.result().outputs] for r in requests]
        finally:
            self._batches.discard(task)

    async def _request(self, prompt, params):
        final = None
        async for final in self.llm.generate(prompt, params, request_id=f"conveyor-{next(self._request_ids)}"):
            pass
        return final

    def receive_weights(self, round_info: dict) -> None:
        """Load a round. In `interrupt` mode around the batch in flight (if any): pause, load, resume;
        otherwise (`finish`) the caller calls this between batches."""
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot receive weights")
        self._run(self._receive(round_info))

    async def _receive(self, round_info: dict) -> None:
        interrupt = round_info.get("mode") == "interrupt"
        if interrupt:
            # running requests are frozen where they are; their KV cache is kept
            await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            # only the round_info crosses collective_rpc; the tensors come over the round's group
            timeout = float(round_info.get("timeout_s", 600.0)) + 60.0
            await self.llm.collective_rpc("receive_weights", timeout=timeout, args=(round_info,))
            # relabel while paused: every step from now on is computed by, and labelled with, the new weights
            await self.llm.update_weight_version(str(int(round_info["version"])))
            self._prefix_cache_stale = True
        finally:
            if interrupt:
                await self.llm.resume_generation()

    def load_state_dict(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        # between batches only, for small debugging loads (see VLLMEngine.load_state_dict)
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot load weights")
        self._run(self.llm.collective_rpc("load_named_tensors", args=(list(named_tensors),)))
        self._prefix_cache_stale = True

    def close(self) -> None:
        if self.llm is None:
            return
        try:
            self._run(self._shutdown(), timeout=60)
        finally:
            self.llm = None
            self._stop_loop()

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


# --------------------------------------------------------------------------------------------
# transformers


class TransformersEngine(Engine):
    """A Hugging Face causal LM sampled by hand: all n*len(prompts) sequences in one left-padded
    batch, one forward per new token over the KV cache."""

    def __init__(self, model: str, *, tokenizer: str = "", dtype: str = "float32", seed: int = 0,
                 device: str = "cpu"):
        import torch
        from transformers import AutoTokenizer

        from learner.modeling import load_causal_lm

        self.model_path = model
        self.model = load_causal_lm(model, dtype=dtype, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.device = torch.device(device)
        self.rng = torch.Generator(device="cpu").manual_seed(seed)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.eos_ids = _stop_ids(self.tokenizer, model, [])
        self.version = 0

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        import torch

        if not prompt_ids:
            return []
        seqs = [list(map(int, p)) for p in prompt_ids for _ in range(n)]
        rng = self.rng if sampling.seed is None else torch.Generator(device="cpu").manual_seed(sampling.seed)
        stop = self.eos_ids | set(int(t) for t in sampling.stop_token_ids)
        tokens, logprobs, reasons = self._sample(seqs, sampling, stop, rng)
        out: list[list[Completion]] = []
        for i in range(len(prompt_ids)):
            group = []
            for b in range(i * n, (i + 1) * n):
                text = self.tokenizer.decode(tokens[b], skip_special_tokens=True)
                group.append(Completion(tokens[b], logprobs[b], reasons[b], text))
            out.append(group)
        return out

    def _sample(self, seqs, sampling, stop, rng):
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            B = len(seqs)
            P = max(len(s) for s in seqs)
            ids = torch.full((B, P), self.pad_id, dtype=torch.long)  # (B, P) left-padded
            attn = torch.zeros((B, P), dtype=torch.long)
            for b, s in enumerate(seqs):
                ids[b, P - len(s):] = torch.tensor(s)
                attn[b, P - len(s):] = 1
            # Positions count real tokens only, so a left-padded prompt sees the positions it would alone.
            pos = (attn.cumsum(-1) - 1).clamp_min(0)  # (B, P)
            dev = self.device
            out = self.model(input_ids=ids.to(dev), attention_mask=attn.to(dev), position_ids=pos.to(dev),
                             use_cache=True)
            tokens: list[list[int]] = [[] for _ in range(B)]
            logprobs: list[list[float]] = [[] for _ in range(B)]
            reasons = ["length"] * B
            alive = torch.ones(B, dtype=torch.bool)
            stop_t = torch.tensor(sorted(stop), dtype=torch.long)
            for _ in range(sampling.max_tokens):
                logits = process_logits(out.logits[:, -1].cpu(), sampling.temperature, sampling.top_k,
                                        sampling.top_p)  # (B, V)
                lp = F.log_softmax(logits, dim=-1)  # (B, V)
                if sampling.temperature <= 0:
                    nxt = logits.argmax(dim=-1)  # (B,)
                else:
                    nxt = torch.multinomial(lp.exp(), 1, generator=rng).squeeze(-1)  # (B,)
                picked = lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)  # (B,)
                for b in alive.nonzero().flatten().tolist():
                    tokens[b].append(int(nxt[b]))
                    logprobs[b].append(float(picked[b]))
                ended = alive & torch.isin(nxt, stop_t)
                for b in ended.nonzero().flatten().tolist():
                    reasons[b] = "stop"
                alive &= ~ended
                if not alive.any():
                    break
                # Finished rows keep stepping (their tokens are ignored): the batch stays rectangular.
                attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], dim=1)  # (B, P+t+1)
                pos = pos[:, -1:] + 1  # (B, 1)
                out = self.model(input_ids=nxt.unsqueeze(-1).to(dev), attention_mask=attn.to(dev),
                                 position_ids=pos.to(dev), past_key_values=out.past_key_values, use_cache=True)
            return tokens, logprobs, reasons

    def receive_weights(self, round_info: dict) -> None:
        from weight_sync.receiver import receive_into_model

        receive_into_model(self.model, round_info)

    def load_state_dict(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        import torch

        params = dict(self.model.named_parameters())
        missing = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    missing.append(name)
                    continue
                params[name].copy_(tensor.to(params[name].dtype))
        if missing:
            raise KeyError(f"{len(missing)} tensor names not in the model, e.g. {missing[:3]}")

    def close(self) -> None:
        self.model = None


def build_engine(cfg) -> Engine:
    """The engine a `GeneratorConfig` asks for."""
    if cfg.engine == "vllm":
        cls = AsyncVLLMEngine if cfg.async_engine else VLLMEngine
        return cls(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                   tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
                   max_model_len=cfg.max_model_len, worker_extension=cfg.worker_extension)
    elif cfg.engine == "transformers":
        return TransformersEngine(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                                  device=cfg.device)
    raise ValueError(f"generator.engine={cfg.engine!r} is not 'vllm' or 'transformers'")
