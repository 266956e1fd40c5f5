"""The prompt dataset a buffer leases from, and the order its rows are leased in."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


class PromptsError(ValueError):
    """The prompt dataset cannot be used; the message names the file and line."""


@dataclass
class Prompt:
    text: str
    label: str | None
    index: int  # row of the file (blank lines not counted)
    messages: list[tuple[str, str]] | None = None  # a chat prompt: (role, content) pairs


def load_prompts(path: str) -> list[Prompt]:
    """JSONL rows with `prompt` (str) and optional `label` (str or number); other keys are ignored."""
    if not path:
        raise PromptsError("buffer.prompts is not set: give a JSONL file of {\"prompt\": ..., \"label\": ...}")
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise PromptsError(f"{path}: cannot open the prompt file ({e.strerror})") from None
    prompts = []
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptsError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise PromptsError(f"{where}: expected a JSON object, got {type(row).__name__}")
            text = row.get("prompt")
            if not isinstance(text, str):
                raise PromptsError(f"{where}: `prompt` must be a string, got {text!r}")
            label = row.get("label")
            if isinstance(label, (int, float)) and not isinstance(label, bool):
                label = str(label)
            if label is not None and not isinstance(label, str):
                raise PromptsError(f"{where}: `label` must be a string or a number, got {label!r}")
            prompts.append(Prompt(text, label, len(prompts)))
    if not prompts:
        raise PromptsError(f"{path}: no prompts in the file")
    return prompts


class PromptOrder:
    """Group k -> row of the dataset: epoch k // N, shuffled with `seed + epoch` (file order if seed is None)."""

    def __init__(self, n_prompts: int, seed: int | None, epochs: int):
        self.n = n_prompts
        self.seed = seed
        self.total = n_prompts * epochs  # groups in the whole run
        self._perms: dict[int, list[int]] = {}

    def row(self, k: int) -> int:
        epoch, i = divmod(k, self.n)
        if self.seed is None:
            return i
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.n))
            random.Random(self.seed + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # groups are issued in order: one epoch's order is enough
        return perm[i]
