"""Prompts as the generator sends them to its engine: a prompt group's text or chat messages encoded
to token ids (`encode_prompt`, shared with environments that open an episode with their own text),
and the length rule (`fit_prompt`).

A vision-language prompt (a group with `images`) writes each image as Qwen2-VL's
`<|vision_start|><|image_pad|><|vision_end|>`: one `<|image_pad|>` per image, which the engine
expands to the image's tokens (one per merged patch) when it sees the pixels. Where an image stands
is marked "<image>" in the prompt's text or messages (common.images); the chat template gets those
contents as image and text parts, so it writes the image as the model was trained to see it. A
prompt whose markers, pads and images do not agree one to one is refused (`PromptRefused`), never
guessed at: an image in the wrong place, or a pad without pixels, would train on what the model
never saw.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from common.images import IMAGE, text_to_parts

if TYPE_CHECKING:
    from actors.config import GeneratorConfig

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
IMAGE_TEXT = VISION_START + IMAGE_PAD + VISION_END  # one image, as Qwen2-VL's chat template writes it


class PromptRefused(ValueError):
    """A prompt that cannot be encoded as it is; the message says why (its group is reported failed)."""


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` in the tokenizer's vocabulary; None when it has no such token (an unknown
    token maps to the unk id, whose token is not `token`)."""
    i = tokenizer.convert_tokens_to_ids(token)
    return int(i) if i is not None and tokenizer.convert_ids_to_tokens(int(i)) == token else None


def placeholder_ids(tokenizer) -> tuple[int, ...]:
    """The ids of the image and video placeholders the tokenizer has (none: a text tokenizer)."""
    return tuple(i for i in (token_id(tokenizer, IMAGE_PAD), token_id(tokenizer, VIDEO_PAD)) if i is not None)


def encode_prompt(tokenizer, text: str, use_chat_template: bool, messages=None, tools=None,
                  images: Sequence[bytes] | None = None) -> list[int]:
    """Token ids of one prompt, its chat `messages` (ChatMessage) when it has them, else `text` as
    one user message, rendered by the tokenizer's chat template when it has one and
    use_chat_template is on (with `tools`, JSON schemas, as the template's `tools=`). Without a
    template, the texts as the offline trainers' loaders encode them: the first with the
    tokenizer's specials (bos), the others after it without.

    `images` (a vision-language group's, None for a text prompt): each "<image>" in the contents
    becomes an image part for the template, or `IMAGE_TEXT` without one; the ids then hold one
    `<|image_pad|>` per image. PromptRefused when the markers, the pads and the images differ in
    number, or the tokenizer has no image tokens."""
    chat = ([{"role": "user", "content": text}] if messages is None
            else [{"role": m.role, "content": m.content} for m in messages])
    if not chat:
        return []  # (refused by fit_prompt as empty)
    templated = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    pad = None
    if images is not None:
        pad = _image_pad(tokenizer, chat, len(images), templated)
        for m in chat:
            if IMAGE in m["content"]:  # (a message without images stays a string, as the template expects most)
                m["content"] = text_to_parts(m["content"]) if templated else m["content"].replace(IMAGE, IMAGE_TEXT)
    if templated:
        # The template writes the special tokens itself (bos and the like); the ids are the ones
        # it gives (the offline loaders tokenize the same rendered text without specials).
        ids = list(tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, return_dict=False))
    else:
        ids = list(tokenizer.encode(chat[0]["content"]))
        for m in chat[1:]:
            ids.extend(tokenizer.encode(m["content"], add_special_tokens=False))
    if pad is not None and ids.count(pad) != len(images):
        how = "the chat template wrote" if templated else "the prompt's text holds"
        raise PromptRefused(f"{how} {ids.count(pad)} {IMAGE_PAD} for the prompt's {len(images)} image(s) "
                            f"(an image's pad must come from its {IMAGE} marker, one each)")
    return ids


def _image_pad(tokenizer, chat: list[dict], n_images: int, templated: bool) -> int:
    """The id of the image pad of a prompt with `n_images` images, once its markers are counted."""
    markers = sum(m["content"].count(IMAGE) for m in chat)
    if markers != n_images:
        raise PromptRefused(f"the prompt has {markers} {IMAGE} marker(s) but {n_images} image(s): "
                            f"each image needs its marker where it stands in the text")
    pad = token_id(tokenizer, IMAGE_PAD)
    if pad is None or (not templated and (token_id(tokenizer, VISION_START) is None
                                          or token_id(tokenizer, VISION_END) is None)):
        raise PromptRefused(f"a prompt with {n_images} image(s), but the tokenizer has no "
                            f"{IMAGE_TEXT if not templated else IMAGE_PAD} tokens (not a Qwen2-VL-family "
                            f"vision-language model's)")
    return pad


def fit_prompt(ids: list[int], cfg: GeneratorConfig, images: int = 0) -> tuple[list[int] | None, str]:
    """(ids to generate from, "") or (None, why it is refused); a long prompt keeps its tail, unless
    it has `images` (cutting it could cut an image's tokens: it is refused instead). An image
    counts as its one pad here; the engine expands it."""
    if not ids:
        return None, "empty prompt (0 tokens)"
    if images > cfg.max_images_per_prompt:
        return None, f"{images} images in the prompt > generator.max_images_per_prompt={cfg.max_images_per_prompt}"
    if len(ids) <= cfg.prompt_max_len:
        return ids, ""
    if cfg.long_prompt == "truncate" and not images:
        # The tail holds the question and the generation prompt; the head is usually context.
        return ids[-cfg.prompt_max_len:], ""
    if images:
        return None, (f"prompt of {len(ids)} tokens with {images} image(s) > generator.prompt_max_len="
                      f"{cfg.prompt_max_len} (a prompt with images is never truncated: it could cut an image)")
    return None, f"prompt of {len(ids)} tokens > generator.prompt_max_len={cfg.prompt_max_len}"
