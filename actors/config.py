"""Configuration of the generator and scorer roles (sections `generator:` and `scorer:`).

Light on purpose (no torch, no vllm): `python -m launch.generator --help` answers at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

ENGINES = ("vllm", "transformers")
SCORER_KINDS = ("reward_fn", "reward_model", "remote", "reference")


@dataclass
class GeneratorConfig:
    """Section `generator:` of the run config."""

    model: str = ""
    """Model folder (any `AutoModelForCausalLM` folder vLLM can load): the policy's initial weights."""
    tokenizer: str = ""
    """Tokenizer folder; empty: the model folder."""
    engine: Literal["vllm", "transformers"] = "vllm"
    """Generation backend: `vllm` (default), or `transformers` (a plain sampling loop, for debugging)."""
    dtype: str = "float32"
    """Weights dtype of the engine (`float32`, `bfloat16`, `float16`)."""
    seed: int = 0
    """Engine seed (vLLM's global seed, the transformers backend's torch generator)."""
    device: str = "cpu"
    """transformers backend only: the torch device it runs on."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs one engine spans."""
    gpu_memory_utilization: float = 0.0
    """vLLM: fraction of accelerator memory for weights + KV cache (on CPU: of host memory, for the
    KV cache). 0 means auto: 0.9 with CUDA, 0.05 on CPU (where VLLM_CPU_KVCACHE_SPACE also applies)."""
    max_model_len: int = 0
    """vLLM: longest prompt + completion the engine accepts; 0: the model config's limit."""
    worker_extension: str = "actors.vllm_worker.WorkerExtension"
    """vLLM: dotted path of the worker extension class that receives weights (`receive_weights`).
    Skipped, with a warning, when its module cannot be found."""
    async_engine: bool = False
    """vLLM: drive vLLM's `AsyncLLM` from a background thread instead of the offline `LLM`. Needed
    for `weight_sync.mode: interrupt`: the generator keeps polling the weight-sync service while a
    batch generates, and a new version is loaded into the running batch (pause, load, resume; each
    token records the version that sampled it). With the offline engine a generator loads weights
    between batches whatever the mode (it logs a warning in `interrupt` mode)."""

    temperature: float = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    max_new_tokens: int = 128
    """Longest completion; one that reaches it ends with finish_reason `length`."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion besides the tokenizer's eos (kept in the completion)."""

    prompt_max_len: int = 512
    """Longest prompt in tokens (after the chat template)."""
    long_prompt: Literal["truncate", "refuse"] = "truncate"
    """What to do with a longer prompt: `truncate` keeps its last prompt_max_len tokens; `refuse`
    reports the group failed to the buffer (it is counted there and not issued again)."""
    use_chat_template: bool = True
    """Wrap each prompt as one user message in the tokenizer's chat template, when it has one."""

    groups_per_lease: int = 4
    """Prompt groups asked for in one lease; all their samples are generated as one engine batch."""
    worker_id: str = ""
    """Name reported to the buffer and the weight-sync service; empty: `gen-<host>-<pid>`."""
    buffer_host: str = "127.0.0.1"
    """Address of the buffer (its control port is buffer_port; the relay input is buffer_port+2).
    `launch.generator` takes both from the config's `buffer:` section unless set here."""
    buffer_port: int = 5555
    """The buffer's control port."""
    request_timeout_s: float = 30.0
    """One buffer request waits this long for its answer."""
    buffer_patience_s: float = 300.0
    """Give up (exit 1) when the buffer has not answered for this long in a row."""
    renew_fraction: float = 0.33
    """A lease is renewed every renew_fraction * ttl_s while its batch is being generated."""
    renew_after_push_s: float = 60.0
    """Keep renewing a lease this long after its rollouts were pushed, until the buffer reports it
    answered: the buffer holds a lease open until the scored samples arrive. 0 = stop at the push."""
    max_batches: int = 0
    """Stop after this many leases (0 = until the buffer says done or a signal comes)."""
    log_every_s: float = 10.0
    """Throughput is logged this often."""

    weight_sync_host: str = "127.0.0.1"
    """Address of the weight-sync service."""
    weight_sync_port: int = 0
    """Its port; 0 = no weight sync (the generator keeps its initial weights, version 0)."""
    weight_sync_timeout_s: float = 60.0
    """Before the first lease, wait this long for the current weights (when any were published)."""
    weight_sync_poll_s: float = 0.2
    """`interrupt` mode (with async_engine): ask the service for a round this often while a batch
    generates. Well below `weight_sync.join_timeout_s`, or the learner's broadcasts go on without us."""

    def validate(self) -> None:
        errs = []
        if not self.model:
            errs.append("generator.model is empty: give a model folder")
        if self.engine not in ENGINES:
            errs.append(f"generator.engine={self.engine!r} must be one of {list(ENGINES)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            errs.append(f"generator.dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if self.tensor_parallel_size < 1:
            errs.append(f"generator.tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            errs.append(f"generator.gpu_memory_utilization={self.gpu_memory_utilization} must be in [0, 1]")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            errs.append(f"generator.temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            errs.append(f"generator.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            errs.append(f"generator.top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            errs.append(f"generator.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.prompt_max_len < 1:
            errs.append(f"generator.prompt_max_len={self.prompt_max_len} must be >= 1")
        if self.max_model_len and self.prompt_max_len + self.max_new_tokens > self.max_model_len:
            errs.append(f"generator.prompt_max_len={self.prompt_max_len} + max_new_tokens={self.max_new_tokens} "
                        f"exceeds max_model_len={self.max_model_len}")
        if self.long_prompt not in ("truncate", "refuse"):
            errs.append(f"generator.long_prompt={self.long_prompt!r} must be 'truncate' or 'refuse'")
        if self.groups_per_lease < 1:
            errs.append(f"generator.groups_per_lease={self.groups_per_lease} must be >= 1")
        if not 0 < self.buffer_port < 65533:
            errs.append(f"generator.buffer_port={self.buffer_port} must leave room for port+3 below 65536")
        if self.request_timeout_s <= 0 or self.buffer_patience_s < self.request_timeout_s:
            errs.append(f"generator.request_timeout_s={self.request_timeout_s} must be > 0 and <= "
                        f"buffer_patience_s={self.buffer_patience_s}")
        if not 0 < self.renew_fraction < 1:
            errs.append(f"generator.renew_fraction={self.renew_fraction} must be in (0, 1)")
        if self.renew_after_push_s < 0:
            errs.append(f"generator.renew_after_push_s={self.renew_after_push_s} must be >= 0")
        if self.max_batches < 0:
            errs.append(f"generator.max_batches={self.max_batches} must be >= 0")
        if not 0 <= self.weight_sync_port < 65536:
            errs.append(f"generator.weight_sync_port={self.weight_sync_port} must be 0 (off) or a port")
        if self.weight_sync_poll_s <= 0:
            errs.append(f"generator.weight_sync_poll_s={self.weight_sync_poll_s} must be > 0")
        if self.async_engine and self.engine != "vllm":
            errs.append(f"generator.async_engine=true needs generator.engine='vllm' (got {self.engine!r})")
        if errs:
            raise ValueError("; ".join(errs))


@dataclass
class ScorerConfig:
    """Section `scorer:` of the run config. Each kind in `kinds` adds a component to the reward
    (`scores[kind]`, summed with its weight into `reward`), except `reference`, which adds
    `ref_logprobs` for the learner's KL term."""

    kinds: list[str] = field(default_factory=lambda: ["reward_fn"])
    """What this process computes, any of `reward_fn`, `reward_model`, `remote`, `reference`."""

    reward_fn: str = ""
    """Path of a Python file that defines `reward_fn(prompts, completions, labels) -> list[float]`."""
    reward_fn_weight: float = 1.0
    """Weight of the reward function's score in `reward`."""
    reward_fn_timeout_s: float = 60.0
    """One call of the reward function (a message's samples, batched) may take this long; past it the
    worker process running it is killed (and restarted for the next call) and the samples fail."""

    reward_model: str = ""
    """An `AutoModelForSequenceClassification` folder (one label); the score of the last token of
    prompt + completion text is the reward."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's score in `reward`."""
    reward_model_max_len: int = 1024
    """Prompt + completion tokens the reward model sees at most (the tail is kept)."""

    remote_url: str = ""
    """HTTP endpoint taking POST `{"prompts", "completions", "labels"}` and answering `{"rewards": [...]}`."""
    remote_weight: float = 1.0
    """Weight of the remote reward in `reward`."""
    remote_timeout_s: float = 30.0
    """One HTTP request waits this long."""
    remote_retries: int = 3
    """Attempts per batch before its samples are marked failed."""
    remote_backoff_s: float = 0.5
    """Wait before the second attempt; doubled before each later one."""

    reference: str = ""
    """The frozen reference model's folder (usually the policy's initial weights)."""

    dtype: str = "float32"
    """Dtype the reward and reference models are loaded in."""
    device: str = "cpu"
    """Torch device of the reward and reference models."""
    batch_size: int = 16
    """Sequences per forward pass of the reward and reference models."""

    buffer_host: str = "127.0.0.1"
    """Address of the buffer; `launch.scorer` takes it from the config's `buffer:` section unless set here."""
    buffer_port: int = 5555
    """The buffer's control port (rollouts come from port+3, scored ones go to port+1)."""
    poll_s: float = 1.0
    """Wait this long for rollouts before checking for a stop signal again."""
    log_every_s: float = 10.0
    """Throughput and failure counts are logged this often."""
    worker_id: str = ""
    """Name in logs; empty: `scorer-<host>-<pid>`."""

    def validate(self) -> None:
        errs = []
        unknown = [k for k in self.kinds if k not in SCORER_KINDS]
        if unknown:
            errs.append(f"scorer.kinds={self.kinds} has unknown {unknown}; known: {list(SCORER_KINDS)}")
        if not self.kinds:
            errs.append("scorer.kinds is empty: list at least one of " + ", ".join(SCORER_KINDS))
        if len(set(self.kinds)) != len(self.kinds):
            errs.append(f"scorer.kinds={self.kinds} lists a kind twice")
        needs = {"reward_fn": ("reward_fn", self.reward_fn), "reward_model": ("reward_model", self.reward_model),
                 "remote": ("remote_url", self.remote_url), "reference": ("reference", self.reference)}
        for kind in self.kinds:
            if kind in needs and not needs[kind][1]:
                errs.append(f"scorer.kinds includes {kind!r} but scorer.{needs[kind][0]} is empty")
        if self.remote_url and not self.remote_url.startswith(("http://", "https://")):
            errs.append(f"scorer.remote_url={self.remote_url!r} must start with http:// or https://")
        for name in ("reward_fn_weight", "reward_model_weight", "remote_weight"):
            if not math.isfinite(getattr(self, name)):
                errs.append(f"scorer.{name}={getattr(self, name)} must be finite")
        if not 0 < self.reward_fn_timeout_s < math.inf:
            errs.append(f"scorer.reward_fn_timeout_s={self.reward_fn_timeout_s} must be > 0 and finite")
        if self.remote_timeout_s <= 0 or self.remote_retries < 1 or self.remote_backoff_s < 0:
            errs.append(f"scorer.remote_timeout_s={self.remote_timeout_s} must be > 0, remote_retries="
                        f"{self.remote_retries} >= 1 and remote_backoff_s={self.remote_backoff_s} >= 0")
        if self.batch_size < 1:
            errs.append(f"scorer.batch_size={self.batch_size} must be >= 1")
        if self.reward_model_max_len < 2:
            errs.append(f"scorer.reward_model_max_len={self.reward_model_max_len} must be >= 2")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            errs.append(f"scorer.dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if not 0 < self.buffer_port < 65533:
            errs.append(f"scorer.buffer_port={self.buffer_port} must leave room for port+3 below 65536")
        if self.poll_s <= 0:
            errs.append(f"scorer.poll_s={self.poll_s} must be > 0")
        if errs:
            raise ValueError("; ".join(errs))
