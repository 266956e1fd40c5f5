"""Images in multi-turn episodes: the two views of an episode's ids, and how one becomes the other.

A vision-language episode's images are its prompt's (`PromptGroup.images`) and those its
environment's observations show (`StepResult.images`), in the order their placeholders stand. Its
context is kept twice, both as token ids (never re-tokenised):

- the engine's: every image as its one `<|image_pad|>` (as `actors.prompts.encode_prompt` and
  `actors.envs.api.encode_observation` write them). Each turn the engine is given these ids with
  every image so far, and expands each pad itself (vLLM: ids already expanded would be expanded
  again);
- the rollout's: every pad repeated as often as its image has tokens (`ImageTokens`: one per merged
  patch of the grid the model's image processor gives it, `learner.vision.Pixels.tokens`), which
  is what the engine ran and what the learner's forward is given with the images.

The rollout's prompt is the engine's expansion of it (`Completion.prompt_ids` of the first turn);
observations are expanded here, so the room left under the context limit is known before the next
turn is sampled. Every turn the engine's expansion of the whole context must equal the rollout's
view so far (`first_difference`), else the episode fails: a model whose processor and engine count
an image's tokens differently cannot be trained on.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

MEMO = 1 << 16  # images whose token counts are remembered


def expand(ids: Sequence[int], pad: int, sizes: Sequence[int]) -> list[int]:
    """`ids` with the i-th `pad` repeated sizes[i] times (ValueError when the pads and the sizes
    differ in number)."""
    have = sum(1 for t in ids if t == pad)
    if have != len(sizes):
        raise ValueError(f"{have} image placeholder(s) in the ids for {len(sizes)} image(s)")
    out: list[int] = []
    at = iter(sizes)
    for t in ids:
        if t == pad:
            out += [pad] * next(at)
        else:
            out.append(t)
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where `a` and `b` differ (the shorter one's length if one is the other's
    head); None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class ImageTokens:
    """How many tokens each image takes in a model's ids, by its image processor (memoised per
    image: an episode's images are counted once however many turns they stay in the context)."""

    def __init__(self, model_path: str):
        from learner.vision import Pixels  # (torch and the processor: only a vision episode loads them)

        self.pixels = Pixels(model_path)
        self.pad = self.pixels.image_token_id
        self._sizes: dict[bytes, int] = {}

    def sizes(self, images: Sequence[bytes]) -> list[int]:
        out = []
        for data in images:
            key = hashlib.blake2b(bytes(data), digest_size=16).digest()
            if key not in self._sizes:
                if len(self._sizes) >= MEMO:  # (a long run's images would pile up)
                    self._sizes.clear()
                self._sizes[key] = self.pixels.tokens(self.pixels([bytes(data)])[1])
            out.append(self._sizes[key])
        return out

    def expand(self, ids: Sequence[int], images: Sequence[bytes]) -> list[int]:
        """`ids` (one pad per image) with each image's pad expanded to its tokens."""
        return expand(ids, self.pad, self.sizes(images))


@functools.lru_cache(maxsize=4)
def image_tokens(model_path: str) -> ImageTokens:
    """The `ImageTokens` of a model folder, loaded once per process."""
    return ImageTokens(model_path)
