"""Images of vision-language prompts: how a dataset gives them, how they travel, how text marks them.

An image travels as the bytes of its file (PNG, JPEG, WebP, ...), never as pixels: a prompt group
(`PromptGroup.images`) and every rollout of it (`Rollout.images`) carry those bytes, in the order
their placeholders stand in the token ids. The generator's processor and the learner's turn the
same bytes into the same pixels (both run the model's own image processor), so the learner's
forward sees what the engine saw.

In text, `IMAGE` ("<image>") stands for the next image, as verl and LLaVA-style datasets write it:
"<image>How many squares?" with the row's `images` column [one image]. Chat messages whose content
is a list of parts ({"type": "image"}, {"type": "text", "text": ...}) are written the same way
when read (`parts_to_text`), and turned back into parts for the chat template (`text_to_parts`).

`load_image` takes what datasets hold in an image column: raw bytes, a `{"bytes": ..., "path": ...}`
map (how `datasets.Image` stores one in Parquet and `save_to_disk` folders), a base64 string (plain
or a `data:image/...;base64,` URL), a file path (relative to the dataset's folder) or a decoded PIL
image (stored again as PNG). URLs are not fetched. It checks the image decodes and is within the
limits, and raises `BadImage` saying what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

IMAGE = "<image>"
_DATA_URL = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)


class BadImage(ValueError):
    """An image that cannot be used; the message says why (the caller adds where it is)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 4 << 20  # one encoded image
    max_pixels: int = 4096 * 4096  # width x height, before the processor resizes it
    max_images: int = 1  # per prompt (OpenRLHF's max_images_per_prompt; 0: text prompts only)
    section: str = "buffer"  # the config section whose keys set these limits, named in messages


# What PIL raises on a file it cannot read: besides OSError (truncated data, a bad header) some
# plugins let SyntaxError (a broken chunk), struct.error or IndexError through.
_UNREADABLE = (OSError, ValueError, SyntaxError, IndexError, struct.error)


def pil_image(data: bytes):
    """Decoded RGB pixels of an encoded image (a PIL image); BadImage if they cannot be had."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert("RGB")
    except (*_UNREADABLE, Image.DecompressionBombError) as e:
        raise BadImage(_unreadable(data, e)) from None


def _unreadable(data: bytes, e: BaseException) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(e, UnidentifiedImageError):  # its message names a BytesIO object, which says nothing
        return f"not an image file PIL can read ({len(data)} bytes starting {data[:16]!r})"
    return f"not a readable image ({type(e).__name__}: {e})"


def check_image(data: bytes, limits: ImageLimits) -> bytes:
    """`data` if it is an image within `limits`; BadImage otherwise (size checked before decoding)."""
    if len(data) > limits.max_bytes:
        raise BadImage(f"{len(data)} bytes, more than {limits.section}.max_image_bytes={limits.max_bytes}")
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:  # the header only: a bomb is refused before it is decoded
            w, h = im.size
    except (*_UNREADABLE, Image.DecompressionBombError) as e:
        raise BadImage(_unreadable(data, e)) from None
    if w * h > limits.max_pixels:
        raise BadImage(f"{w}x{h} pixels, more than {limits.section}.max_image_pixels={limits.max_pixels}")
    pil_image(data)
    return data


def load_image(value: Any, limits: ImageLimits, base: Path | Sequence[Path] | None = None) -> bytes:
    """One image of a dataset column as checked bytes (see the module docstring for what it takes);
    a relative path is looked for in `base`, or in each of several folders in turn."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path"):
            value = value["path"]
        else:
            raise BadImage(f"an image map needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return check_image(bytes(value), limits)
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):  # a decoded image: store it again
        if value.width * value.height > limits.max_pixels:
            raise BadImage(f"{value.width}x{value.height} pixels, more than "
                           f"{limits.section}.max_image_pixels={limits.max_pixels}")
        out = io.BytesIO()
        (value if value.mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16") else value.convert("RGB")).save(
            out, format="PNG")
        return check_image(out.getvalue(), limits)
    if not isinstance(value, str) or not value:
        raise BadImage(f"an image must be bytes, a path, base64 text or {{'bytes'|'path': ...}}, "
                       f"got {type(value).__name__}")
    if _DATA_URL.match(value):
        return check_image(_b64(value[_DATA_URL.match(value).end():]), limits)
    if re.match(r"^(https?|s3|gs)://", value):
        raise BadImage(f"{value[:200]!r}: URLs are not fetched; give the image's bytes, a file path or base64")
    folders = [base] if base is None or isinstance(base, (str, Path)) else list(base) or [None]
    paths = [Path(value) if b is None or Path(value).is_absolute() else Path(b) / value for b in folders]
    for path in paths if len(value) < 4096 else ():
        if _is_file(path):
            size = path.stat().st_size
            if size > limits.max_bytes:
                raise BadImage(f"{path}: {size} bytes, more than {limits.section}.max_image_bytes={limits.max_bytes}")
            try:
                return check_image(path.read_bytes(), limits)
            except BadImage as e:
                raise BadImage(f"{path}: {e}") from None
    if len(value) >= 64 and re.fullmatch(r"[A-Za-z0-9+/=\s]+", value[:4096]):
        return check_image(_b64(value), limits)
    looked = ", ".join(str(p.parent) for p in paths)
    raise BadImage(f"{value[:200]!r} is neither a file (looked in {looked}) nor base64")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL: text, not a path
        return False


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError) as e:
        raise BadImage(f"bad base64 ({e})") from None


def count_images(text: str) -> int:
    return text.count(IMAGE)


def parts_to_text(content: Any, key: str) -> tuple[str, list[Any]]:
    """A chat message's content as text with IMAGE where its image parts stood, and one entry per
    IMAGE in that text, in order: the image its part names ("image", "image_url", "url" or "path"),
    or None where it names none (a bare {"type": "image"}, or IMAGE written in the text itself):
    the row's image column supplies those. A string comes back as it is, with a None per IMAGE."""
    if isinstance(content, str):
        return content, [None] * count_images(content)
    if not isinstance(content, list):
        raise BadImage(f"{key}: content must be a string or a list of parts, got {type(content).__name__}")
    text, found = [], []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
            found += [None] * count_images(part["text"])
        elif kind in ("image", "image_url"):
            text.append(IMAGE)
            # Parquet gives every part every key of the column's struct, so a missing one reads None
            src = next((part[k] for k in ("image", "image_url", "url", "path") if part.get(k) is not None), None)
            found.append(src.get("url") if isinstance(src, dict) and "url" in src else src)
        else:
            raise BadImage(f"{key}[{i}]: a part must be {{'type': 'text', 'text': str}} or {{'type': 'image'}}, "
                           f"got {str(part)[:200]}")
    return "".join(text), found


def text_to_parts(text: str) -> list[dict]:
    """Text with IMAGE markers as the content parts chat templates of vision-language models take."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(IMAGE)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts
