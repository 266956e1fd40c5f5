"""Vision-language policies (the Qwen2-VL family): loading them, and the pixels of a batch's images.

Light like `learner.modeling` (no DeepSpeed import): the learner, the reference scorer and the
transformers engine share it.

A rollout of an image prompt carries its images as encoded bytes (`Rollout.images`, in the order
of their placeholders) and its prompt ids as the engine expanded them: each image's
`<|image_pad|>` repeated once per merged patch (its grid's t * h * w / merge^2). The learner runs
the model's own image processor on the same bytes, so `pixel_values` and `image_grid_thw` are
what the engine computed, and checks that every row holds as many placeholders as its images
need (`ImageMismatch` otherwise: a rollout whose ids and images disagree is never trained on).

`VisionRows` keeps each row's pixels apart, so a micro-batch takes its rows' images
(`select`), and gives the model the batch's images in row order (`forward_kwargs`), the order in
which Qwen2-VL's forward puts image features at the placeholder positions. M-RoPE positions are
computed by the model from the ids and grids; packed rows would need them per document, so image
batches are never packed (`learner.packing` is refused for a vision policy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch


class ImageMismatch(ValueError):
    """A row's placeholders and its images disagree (the message names the row and both counts)."""


def read_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def is_vision_model(path: str | Path) -> bool:
    """Whether the model folder holds a vision-language model (a config with a vision tower)."""
    return "vision_config" in read_config(path)


def auto_model_class(path: str | Path):
    """The transformers Auto class that loads the folder's model with its LM head."""
    if is_vision_model(path):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def vision_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The vision tower's parameters (`model.visual`, patch merger included) of a Qwen2-VL-class model."""
    base = getattr(model, "model", model)
    visual = getattr(base, "visual", None) or getattr(model, "visual", None)
    if visual is None:
        return []
    ids = {id(p) for p in visual.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def freeze_vision_tower(model) -> int:
    """Stop gradients into the vision tower (OpenRLHF's --actor.freeze_visual_encoder); returns how
    many parameters were frozen. Its weights then never change, so weight rounds leave them out."""
    params = vision_parameters(model)
    if not params:
        raise ValueError("learner.freeze_visual_encoder: the policy has no vision tower (a text-only model)")
    for _, p in params:
        p.requires_grad_(False)
    return len(params)


def is_vision_name(name: str) -> bool:
    """Whether a parameter name (HF or vLLM naming) belongs to the vision tower."""
    return ".visual." in f".{name}" or name.startswith("visual.")


class Pixels:
    """The model's image processor: encoded images -> (pixel_values (N, D) fp32, image_grid_thw (n, 3))."""

    def __init__(self, path: str | Path):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(str(path))
        self.merge = int(getattr(self.processor, "merge_size", 2))
        config = read_config(path)
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index", -1)))
        if self.image_token_id < 0:
            raise ValueError(f"{path}: config.json names no image_token_id")

    def __call__(self, images: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        from common.images import pil_image

        if not images:
            return torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long)
        out = self.processor(images=[pil_image(bytes(b)) for b in images], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def tokens(self, grid: torch.Tensor) -> int:
        """How many placeholders the images of `grid` (n, 3) take in the ids."""
        return int((grid.prod(-1) // (self.merge ** 2)).sum()) if len(grid) else 0


@dataclass
class VisionRows:
    """The pixels of each row of a batch (rows without images hold none)."""

    pixels: list[torch.Tensor]  # per row: (N_b, D) patches of its images, in order
    grids: list[torch.Tensor]  # per row: (n_b, 3) long, each image's (t, h, w) in patches
    image_token_id: int

    @classmethod
    def of(cls, pixels: Pixels, images: Sequence[Sequence[bytes] | None], input_ids: torch.Tensor,
           names: Sequence[str] | None = None) -> "VisionRows":
        """Rows' images through `pixels`, checked against the placeholders in `input_ids` (B, L)."""
        px, grids = [], []
        for b, imgs in enumerate(images):
            p, g = pixels(list(imgs or ()))
            have = int((input_ids[b] == pixels.image_token_id).sum())
            if have != pixels.tokens(g):
                who = names[b] if names else f"row {b}"
                raise ImageMismatch(f"{who}: {have} image placeholders in its ids, but its {len(g)} image(s) "
                                    f"need {pixels.tokens(g)}")
            px.append(p)
            grids.append(g)
        return cls(px, grids, pixels.image_token_id)

    def select(self, idx: torch.Tensor) -> "VisionRows":
        rows = [int(i) for i in idx]
        return VisionRows([self.pixels[i] for i in rows], [self.grids[i] for i in rows], self.image_token_id)

    def to(self, device) -> "VisionRows":
        return VisionRows([p.to(device) for p in self.pixels], [g.to(device) for g in self.grids],
                          self.image_token_id)

    def forward_kwargs(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> dict:
        """What the model's forward takes besides the ids: the rows' images in row order and which
        tokens are image tokens (`mm_token_type_ids`: 1 at placeholders, for M-RoPE)."""
        kinds = (input_ids == self.image_token_id).long()  # (B, L)
        with_images = [p for p in self.pixels if len(p)]
        if not with_images:
            return {"mm_token_type_ids": kinds}
        pixel_values = torch.cat(with_images)  # (N, D)
        return {"pixel_values": pixel_values if dtype is None else pixel_values.to(dtype),
                "image_grid_thw": torch.cat([g for g in self.grids if len(g)]),
                "mm_token_type_ids": kinds}


def pad_token_id(config) -> int:
    """The pad id of a model config; a vision-language model's is its text config's."""
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(config, "text_config", None), "pad_token_id", None)
    return int(pad or 0)


def policy_pixels(model_path: str, *, packing: bool = False, sequence_parallel: int = 1,
                  critic: bool = False) -> Pixels | None:
    """The image processor of a vision-language policy (None for a text model), refusing what its
    image rows cannot do: packing and sequence parallelism (M-RoPE positions come from each whole
    sequence), and a critic (the value model is the text backbone: GAE is for text policies)."""
    if not is_vision_model(model_path):
        return None
    refused = [why for on, why in ((packing, "learner.packing"), (sequence_parallel > 1, "learner.sequence_parallel"),
                                   (critic, "learner.advantage_estimator=gae (a critic)")) if on]
    if refused:
        raise ValueError(f"{model_path} is a vision-language model: {', '.join(refused)} cannot be used with it "
                         f"(image rows are run whole and unpacked, and the critic reads text only)")
    return Pixels(model_path)
