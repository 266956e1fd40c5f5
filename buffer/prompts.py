"""The prompt dataset a buffer leases from, and the order its rows are leased in.

`load_prompts` reads one dataset or several (comma-separated) through `common.datasets.iter_rows`,
so the buffer takes what the offline trainers take: JSONL, JSON, Parquet, `datasets.save_to_disk`
folders and hub dataset folders (`split` picks the split). A row's `input_key` column is the prompt:

  a string                 the prompt text, put into `input_template` ("Q: {}\\nA:") when one is set;
                           the generator renders it as one user message (chat template on) or as is
  a list of chat messages  [{"role": ..., "content": ...}, ...]: `Prompt.messages`, rendered by the
                           generator with the tokenizer's chat template (no input_template);
                           `Prompt.text`, what reward functions and logs see, is their contents

and its `label_key` column, a string or a number, is the label a reward function checks (optional).

A vision-language prompt also has images (`Prompt.images`, the encoded files, leased in
`PromptGroup.images`), from two places: the row's `image_key` column (one image or a list) and
image parts of chat messages' content ([{"type": "image"}, {"type": "text", "text": ...}], an
"image" / "image_url" key naming the image, or none: then the column gives it). Each "<image>"
(common.images.IMAGE) in the text stands for the next image, and image parts become "<image>" in
their message's content, so `Prompt.text` and `Prompt.messages` keep the markers (reward functions
see them). A string prompt (or, with messages, the first user message) that has images and no
marker gets one per image at its start, where Qwen-VL's examples place them; otherwise the markers
must be as many as the images. Images are read and checked when the dataset is read
(common.images.load_image: bytes, {"bytes", "path"} maps, base64, paths relative to the data file's
folder, then the dataset's), within `ImageLimits` (`buffer.max_images_per_prompt`,
`max_image_bytes`, `max_image_pixels`); with max_images_per_prompt 0 every prompt is text and
"<image>" in it is plain text. They are held in memory, as the prompts are.

The row's other columns (`columns`: which; default every one) travel with the prompt as one JSON
object (`Prompt.columns`, at most MAX_COLUMNS_BYTES; arrays become lists) to the rollouts and from
them to the reward functions, whose keyword arguments they are (actors/reward_files.py).
A bad row (an unreadable or oversized image too) raises `PromptsError` naming its file and line (or row).

Several datasets are combined as OpenRLHF's `blending_datasets` combines them:

  without probs   one after the other (`datasets.concatenate_datasets`);
  with probs      `datasets.interleave_datasets(probabilities=probs, seed=seed,
                  stopping_strategy="all_exhausted")`: each prompt comes from a dataset drawn with
                  those probabilities (numpy's `default_rng(seed)`, drawn in blocks of 1000 as
                  `datasets` draws them, so the order is the same one), a dataset that runs out
                  starts again from its first row, and the mix ends once every dataset has been
                  used whole: the smaller share of a dataset, the more often the others repeat.

A dataset named `reasoning_gym:<task>[+<task>...][?size=N&seed=S&<param>=<value>]` is made on the
spot by reasoning-gym's generators (buffer/reasoning_gym.py: deterministic from the seed), each row
carrying what the `reasoning_gym` built-in reward needs to score it (`rg_task`, `rg_entry`,
`rg_source`) and its `task`.

`max_samples` caps each dataset before the mix and the mix after it, as OpenRLHF does. The mixed
list is then one dataset to the buffer: `PromptOrder` shuffles it per epoch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from buffer.config import BufferConfig
from buffer.messages import ChatMessage, PromptGroup
from buffer.reasoning_gym import is_reasoning_gym, reasoning_gym_rows
from common.datasets import BadRow, DatasetError, chat_messages, iter_rows, where_folder
from common.images import IMAGE, BadImage, ImageLimits, count_images, load_image, parts_to_text
from common.wire import short


class PromptsError(ValueError):
    """The prompt dataset cannot be used; the message names the file and line."""


@dataclass
class Prompt:
    text: str  # the prompt's text (with messages: their contents, one per line)
    label: str | None
    index: int  # position in the (mixed) dataset; blank lines are no rows
    messages: list[tuple[str, str]] | None = None  # a chat prompt: (role, content) pairs
    columns: str = ""  # the row's other columns, a JSON object ("" when none travel)
    images: list[bytes] | None = None  # a vision-language prompt's images, one per IMAGE in text and messages


MAX_COLUMNS_BYTES = 1 << 20  # a row's other columns, as JSON


def prompt_group(p: Prompt, group_id: int) -> PromptGroup:
    """The leased form of prompt `p` as group `group_id` (training and evaluation leases alike)."""
    messages = None if p.messages is None else [ChatMessage(role, content) for role, content in p.messages]
    return PromptGroup(group_id, p.text, p.label, p.index, messages, p.columns, p.images)


def prompts_from_config(cfg: BufferConfig, dataset: str | None = None, split: str | None = None,
                        max_samples: int | None = None) -> list[Prompt]:
    """The buffer's prompts: `cfg.prompts` read with its keys and mixed by `cfg.prompt_probs`.

    With `dataset`, another dataset read with the same columns and template instead (evaluation:
    eval.dataset, eval.split, eval.max_samples); several of those are concatenated, never mixed by
    probabilities (as OpenRLHF reads its eval datasets).
    """
    return load_prompts(
        cfg.prompts if dataset is None else dataset,
        split=cfg.prompt_split if split is None else split,
        input_key=cfg.input_key, label_key=cfg.label_key, input_template=cfg.input_template,
        columns=cfg.columns, probs=cfg.prompt_probs if dataset is None else None,
        max_samples=cfg.max_samples if max_samples is None else max_samples,
        seed=cfg.shuffle_seed or 0, image_key=cfg.image_key, limits=cfg.image_limits)


def load_prompts(paths: str | Sequence[str], *, split: str = "train", input_key: str = "prompt",
                 label_key: str = "label", input_template: str = "", probs: Sequence[float] | None = None,
                 max_samples: int = 0, seed: int = 0, columns: Sequence[str] | None = None,
                 image_key: str = "images", limits: ImageLimits | None = None) -> list[Prompt]:
    """The prompts of one dataset or several (a list, or one comma-separated string), mixed as the
    module docstring says; `label_key=""` reads no labels; `max_samples=0` keeps all; `columns`:
    the other columns that travel (None: all); `image_key`: the images' column ("": none)."""
    names = [p.strip() for p in paths.split(",")] if isinstance(paths, str) else [str(p).strip() for p in paths]
    names = [n for n in names if n]
    if not names:
        raise PromptsError("no prompt dataset is set: give a JSONL or Parquet file or a dataset folder "
                           "whose rows hold {\"prompt\": ..., \"label\": ...}")
    if input_template:
        try:
            ok = "{}" in input_template and input_template.format("") is not None
        except (IndexError, KeyError, ValueError):  # other fields: "{x}", "{} {}"; write braces as {{ }}
            ok = False
        if not ok:
            raise PromptsError(f"input_template={input_template!r} must hold exactly one `{{}}` to put the "
                               f"prompt in, and no other braces unless doubled (e.g. 'Question: {{}}\\nAnswer:')")
    if probs is not None and (len(probs) != len(names) or any(not p > 0 for p in probs)):
        raise PromptsError(f"prompt_probs={list(probs)} must hold one share > 0 for each of the "
                           f"{len(names)} datasets {names}")
    keys = Keys(input_key, label_key, input_template, columns, image_key, limits or ImageLimits())
    sources = [_read(n, split, keys, max_samples) for n in names]
    if probs is None:
        rows = [row for source in sources for row in source]
    else:
        rows = [sources[d][i] for d, i in mix_order([len(s) for s in sources], probs, seed)]
    if max_samples:
        rows = rows[:max_samples]
    return [Prompt(text, label, i, messages, cols, images) for i, (text, label, messages, cols, images)
            in enumerate(rows)]


# (text, label, messages, columns, images)
Row = tuple[str, "str | None", "list[tuple[str, str]] | None", str, "list[bytes] | None"]


@dataclass(frozen=True)
class Keys:
    """How a row is read: its columns, the template, the image limits."""

    input_key: str = "prompt"
    label_key: str = "label"
    template: str = ""
    columns: Sequence[str] | None = None  # the other columns that travel (None: all)
    image_key: str = "images"
    limits: ImageLimits = ImageLimits()


def _read(path: str, split: str, keys: Keys, limit: int) -> list[Row]:
    rows: list[Row] = []
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        if is_reasoning_gym(path):  # procedural rows, made here (buffer/reasoning_gym.py)
            try:
                made = reasoning_gym_rows(path)
            except ValueError as e:  # a bad spec: its message names it
                raise PromptsError(str(e)) from None
            names = {"prompt": keys.input_key, "label": keys.label_key}
            source = ((f"{path}: row {i}", {names.get(k, k): v for k, v in row.items()}) for i, row in enumerate(made))
        else:
            source = iter_rows(path, split)
        for where, row in source:
            if limit and len(rows) >= limit:
                break
            try:  # relative image paths: the data file's folder, then the dataset's (a hub folder's root)
                rows.append(_prompt_of(row, keys, lambda: list(dict.fromkeys((where_folder(where), root)))))
            except BadRow as e:
                raise PromptsError(f"{where}: {e}") from None
    except PromptsError:
        raise
    except DatasetError as e:
        raise PromptsError(str(e)) from None
    except (OSError, ValueError) as e:  # a file that pyarrow or `datasets` cannot read
        raise PromptsError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not rows:
        raise PromptsError(f"{path}: no prompts in the dataset (split {split!r})")
    return rows


def _prompt_of(row: Any, keys: Keys, folders: Callable[[], list[Path]] = list) -> Row:
    """(text, label, messages, columns, images) of one row; BadRow saying what is wrong with it.
    `folders`: where relative image paths are looked for (asked only when a row has one)."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"expected an object (a row of columns), got {type(row).__name__}")
    input_key, label_key = keys.input_key, keys.label_key
    value = row.get(input_key)
    if value is None:
        raise BadRow(f"no prompt: {input_key!r} is missing or null (the row's keys: {sorted(row)})")
    column = row.get(keys.image_key) if keys.image_key else None
    column = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    messages = None
    if isinstance(value, str):
        text = keys.template.format(value) if keys.template else value
        sources = [None] * count_images(text)
        if column and not sources:  # images before the text
            text, sources = IMAGE * len(column) + text, [None] * len(column)
    else:
        messages, sources = _chat(value, input_key)
        first_user = next((i for i, (role, _) in enumerate(messages) if role == "user"), None)
        if column and not sources and first_user is not None:
            messages[first_user] = ("user", IMAGE * len(column) + messages[first_user][1])
            sources = [None] * len(column)
        text = "\n".join(content for _, content in messages)
    images = _images(sources, column, keys, folders)
    label = row.get(label_key) if label_key else None
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        label = str(label)
    if label is not None and not isinstance(label, str):
        raise BadRow(f"{label_key!r} must be a string or a number, got {short(label)}")
    return text, label, messages, other_columns(row, (input_key, label_key, keys.image_key), keys.columns), images


def _chat(value: Any, key: str) -> tuple[list[tuple[str, str]], list[Any]]:
    """Chat messages as (role, content) with IMAGE for their image parts, and per IMAGE in them (in
    order) the image its part names, or None (the image column gives it)."""
    if not isinstance(value, list):
        chat_messages(value, key)  # raises BadRow saying what a prompt column must be
    sources: list[Any] = []
    plain = []
    for i, m in enumerate(value):
        if isinstance(m, dict) and isinstance(m.get("content"), (str, list)):
            try:
                content, found = parts_to_text(m["content"], f"{key!r}[{i}].content")
            except BadImage as e:
                raise BadRow(str(e)) from None
            m = {**m, "content": content}
            sources += found
        plain.append(m)
    return [(m["role"], m["content"]) for m in chat_messages(plain, key)], sources


def _images(sources: list[Any], column: list[Any], keys: Keys, folders: Callable[[], list[Path]]) -> list[bytes] | None:
    """The images of a prompt whose IMAGE markers name `sources` (None: the next of `column`), read
    and checked; None for a text prompt."""
    limits = keys.limits
    named = sum(s is not None for s in sources)
    given = len(column) + named
    if given == 0 and (not sources or limits.max_images == 0):
        return None  # a text prompt (with max_images 0, "<image>" in it is plain text)
    if given > limits.max_images:
        raise BadRow(f"{given} images, more than {limits.section}.max_images_per_prompt={limits.max_images}"
                     + (" (0: text prompts only)" if limits.max_images == 0 else ""))
    if len(sources) != given:
        raise BadRow(f"{len(sources)} {IMAGE} markers for {given} images ({len(column)} in column "
                     f"{keys.image_key!r}, {named} in message parts): each {IMAGE} stands for one image")
    out: list[bytes] = []
    rest = iter(column)
    where: list[Path] | None = None
    for i, src in enumerate(sources):
        value = next(rest) if src is None else src
        if where is None and isinstance(value, (str, dict)):  # it may be a path
            where = folders()
        try:
            out.append(load_image(value, limits, where))
        except BadImage as e:
            origin = f"column {keys.image_key!r}" if src is None else "a message part"
            raise BadRow(f"image {i} (from {origin}): {e}") from None
    return out


def other_columns(row: dict, taken: Sequence[str], columns: Sequence[str] | None) -> str:
    """The row's columns but `taken` (or only `columns`, those it has) as a JSON object; "" if none."""
    keep = {k: v for k, v in row.items() if k not in taken and (columns is None or k in columns)}
    if not keep:
        return ""
    text = json.dumps(keep, default=_plain, ensure_ascii=False)
    if len(text.encode()) > MAX_COLUMNS_BYTES:
        big = max(keep, key=lambda k: len(json.dumps(keep[k], default=_plain)))
        raise BadRow(f"its other columns take {len(text.encode())} bytes of JSON (at most {MAX_COLUMNS_BYTES}; "
                     f"the largest: {big!r}): name the ones reward functions need in buffer.columns")
    return text


def _plain(x: Any) -> Any:
    """A value json cannot write as it is: arrays and numpy scalars as lists and numbers, else its str."""
    return x.tolist() if hasattr(x, "tolist") else str(x)


def mix_order(sizes: Sequence[int], probs: Sequence[float], seed: int) -> list[tuple[int, int]]:
    """(dataset, row) of each prompt of the mix: `datasets.interleave_datasets` with probabilities
    and stopping_strategy="all_exhausted" (a dataset that runs out starts again at row 0; the mix
    ends with the draw that completes the last dataset)."""
    p = np.asarray(probs, dtype=np.float64)
    rng = np.random.default_rng(seed)
    taken = [0] * len(sizes)
    left = len(sizes)  # datasets not yet used whole
    out: list[tuple[int, int]] = []
    while True:
        for d in rng.choice(len(sizes), size=1000, p=p / p.sum()):
            out.append((int(d), taken[d] % sizes[d]))
            taken[d] += 1
            left -= taken[d] == sizes[d]
            if not left:
                return out


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
