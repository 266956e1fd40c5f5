"""Generation engines: the interface a generator drives, and the choice of backend.

`VLLMEngine` is the default: vLLM's offline `LLM`, which loads weights between batches.
`AsyncVLLMEngine` drives vLLM's `AsyncLLM` from a background thread instead, so that weights can
also be loaded while a batch is being generated (weight-sync mode `interrupt`); it stamps each
token with the policy version that sampled it. Both live in `actors/engines/vllm/engine.py`.
`TransformersEngine` (`actors/engines/hf.py`) is a plain sampling loop over a Hugging
Face model with a KV cache: slow, but easy to step through, and a second opinion on vLLM's numbers.

An engine owns its weights' version: `receive_weights(round)` loads a weight-sync round and sets
`engine.version` to the round's version, which the generator stamps on the tokens it samples.

All return, for each sampled token, its behaviour log-prob `log mu(token)` under the distribution
it was actually drawn from: log_softmax(logits / T) after top-k/top-p masking and renormalisation
(vLLM's `processed_logprobs`). With temperature 0 (greedy) it is log_softmax(logits).

A vision-language policy's prompts come with their images (the vLLM engines take them, as vLLM's
`multi_modal_data`; the transformers engine samples text prompts only).

torch and vllm are imported inside the backends, and the backends' modules on first use
(`actors.engines.VLLMEngine`: actors/engines/__init__.py), so importing this module is cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weight_sync.messages import RoundInfo


@dataclass
class Sampling:
    """How to sample; `top_k=0` and `top_p=1` switch those filters off, `temperature=0` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    # Strings that end a completion once its text contains one: the token that completes it is the
    # last one kept (so ids stay exactly as sampled), and the text ends with it (vLLM's `stop` with
    # `include_stop_str_in_output`; nothing after it, even within that token, is in `text`).
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # per-call seed (reproducible samples); None: the engine's stream


@dataclass
class Completion:
    """One sampled completion: its tokens, the behaviour log-prob of each, why it ended, its text."""

    token_ids: list[int]
    logprobs: list[float]  # (T,) log mu of each sampled token
    finish_reason: str  # "stop" (eos, a stop token or a stop string, which are kept) | "length"
    text: str
    # (T,) policy version of the weights that sampled each token, from an engine whose weights can
    # change mid-completion (AsyncVLLMEngine); None: every token has the engine's version at the
    # start of the batch
    versions: list[int] | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None: eos or length
    # (P+T-1, layers, k) uint8/uint16 numpy: the experts a mixture-of-experts engine routed each token
    # of prompt + completion but the last to, from an engine that records them (record_routes); else None
    routes: Any = None
    # (P,) the prompt's ids as the engine ran them, given for a prompt with images: each image's one
    # placeholder expanded to its tokens (what the model's processor gives for the text and images);
    # None: the prompt ids it was given
    prompt_ids: list[int] | None = None


class Engine(ABC):
    """What a generator needs from an inference engine. `version` is the policy version of the
    weights it holds (0: the initial checkpoint); the generator stamps it on every token it
    samples, and only `receive_weights` changes it."""

    version: int = 0
    tokenizer: Any = None
    placeholder_ids: tuple[int, ...] = ()
    """A vision-language policy's image and video placeholder ids (`<|image_pad|>`, `<|video_pad|>`):
    a completion that samples one is ended before it (`actors.generator.before_placeholder`), since
    the model's forward matches every placeholder to an image's features. Empty: a text policy."""
    loads_mid_batch: bool = False
    """True for an engine with `submit(prompt_ids, n, sampling, images=None) -> Future` that returns
    at once and a `receive_weights` that may run while that batch generates (weight-sync mode
    `interrupt`); its completions then carry per-token `versions`."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: Sampling,
                 images: list[list[bytes] | None] | None = None) -> list[list[Completion]]:
        """`n` completions of each prompt, in prompt order.

        `images`: per prompt, its encoded images (common.images) or None; a prompt with images holds
        one placeholder per image (`actors.prompts.encode_prompt`), and its completions carry the
        expanded ids (`Completion.prompt_ids`). An engine that cannot take them raises ValueError."""

    @abstractmethod
    def receive_weights(self, info: RoundInfo) -> dict:
        """Join a weight-sync round (see weight_sync/), load the broadcast weights in place and set
        `self.version = info.version`; returns the load's stats. Raises (weights and version
        unchanged) when the round went on without this engine."""

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
