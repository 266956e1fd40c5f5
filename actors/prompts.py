"""Prompts as the generator sends them to its engine: a prompt group's text or chat messages encoded
to token ids (`encode_prompt`, shared with environments that open an episode with their own text),
and the length rule (`fit_prompt`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.config import GeneratorConfig


def encode_prompt(tokenizer, text: str, use_chat_template: bool, messages=None, tools=None) -> list[int]:
    """Token ids of one prompt, its chat `messages` (ChatMessage) when it has them, else `text` as
    one user message, rendered by the tokenizer's chat template when it has one and
    use_chat_template is on (with `tools`, JSON schemas, as the template's `tools=`). Without a
    template, the texts as the offline trainers' loaders encode them: the first with the
    tokenizer's specials (bos), the others after it without."""
    chat = ([{"role": "user", "content": text}] if messages is None
            else [{"role": m.role, "content": m.content} for m in messages])
    if not chat:
        return []  # (refused by fit_prompt as empty)
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        # The template writes the special tokens itself (bos and the like); the ids are the ones
        # it gives (the offline loaders tokenize the same rendered text without specials).
        return list(tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, return_dict=False))
    ids = list(tokenizer.encode(chat[0]["content"]))
    for m in chat[1:]:
        ids.extend(tokenizer.encode(m["content"], add_special_tokens=False))
    return ids


def fit_prompt(ids: list[int], cfg: GeneratorConfig) -> tuple[list[int] | None, str]:
    """(ids to generate from, "") or (None, why it is refused); a long prompt keeps its tail."""
    if not ids:
        return None, "empty prompt (0 tokens)"
    if len(ids) <= cfg.prompt_max_len:
        return ids, ""
    if cfg.long_prompt == "truncate":
        # The tail holds the question and the generation prompt; the head is usually context.
        return ids[-cfg.prompt_max_len:], ""
    return None, f"prompt of {len(ids)} tokens > generator.prompt_max_len={cfg.prompt_max_len}"
