"""Generation engines: the interface a generator drives, and its two backends.

`VLLMEngine` is the default. `TransformersEngine` is a plain sampling loop over a Hugging Face
model with a KV cache: slow, but easy to step through, and a second opinion on vLLM's numbers.

Both return, for each sampled token, its behaviour log-prob `log mu(token)` under the distribution
it was actually drawn from: log_softmax(logits / T) after top-k/top-p masking and renormalisation
(vLLM's `processed_logprobs`). With temperature 0 (greedy) it is log_softmax(logits).

torch and vllm are imported inside the backends, so importing this module is cheap.
"""

from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
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


class Engine(ABC):
    """What a generator needs from an inference engine. `version` is the policy version of the
    weights it holds; the generator stamps it on every token it samples."""

    version: int = 0
    tokenizer: Any = None

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


class VLLMEngine(Engine):
    """vLLM's offline `LLM`, eager mode, fed token ids; must be built under `if __name__ == "__main__"`
    (vLLM spawns its engine process)."""

    def __init__(self, model: str, *, tokenizer: str = "", dtype: str = "float32", seed: int = 0,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.0, max_model_len: int = 0,
                 worker_extension: str = "actors.vllm_worker.WorkerExtension"):
        import torch
        import vllm

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
        self.has_extension = "worker_extension_cls" in kwargs
        self.llm = vllm.LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed,
            logprobs=0,  # the sampled token's log-prob only
        )
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        result = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [c.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
                group.append(Completion(ids, lps, str(c.finish_reason or "length"), c.text))
            result.append(group)
        return result

    def receive_weights(self, round_info: dict) -> None:
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot receive weights")
        # Only the round_info (plain data) crosses collective_rpc; the tensors come over the round's
        # own process group, straight into the workers (actors/vllm_worker.py).
        timeout = float(round_info.get("timeout_s", 600.0)) + 60.0
        self.llm.collective_rpc("receive_weights", timeout=timeout, args=(round_info,))

    def load_state_dict(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        # Needs a `load_named_tensors` method on the worker extension. collective_rpc's serialisation
        # is not reliable for tensors (DESIGN.md): use it for small debugging loads only; real
        # weights arrive by receive_weights over a process group.
        if not self.has_extension:
            raise RuntimeError("this vLLM engine was started without a worker extension; it cannot load weights")
        self.llm.collective_rpc("load_named_tensors", args=(list(named_tensors),))

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None


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
        return VLLMEngine(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                          tensor_parallel_size=cfg.tensor_parallel_size,
                          gpu_memory_utilization=cfg.gpu_memory_utilization, max_model_len=cfg.max_model_len,
                          worker_extension=cfg.worker_extension)
    elif cfg.engine == "transformers":
        return TransformersEngine(cfg.model, tokenizer=cfg.tokenizer, dtype=cfg.dtype, seed=cfg.seed,
                                  device=cfg.device)
    raise ValueError(f"generator.engine={cfg.engine!r} is not 'vllm' or 'transformers'")
