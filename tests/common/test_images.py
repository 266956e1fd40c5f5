"""Images as datasets give them: `common.images.load_image` reads each form into checked bytes,
`check_image` refuses what is too large or unreadable, and the chat-part helpers keep one marker
per image. The images are tiny PNGs made here with PIL."""

from __future__ import annotations

import base64
import io

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from common.images import (  # noqa: E402
    IMAGE,
    BadImage,
    ImageLimits,
    check_image,
    load_image,
    parts_to_text,
    pil_image,
    text_to_parts,
)


def png(color="red", size=(8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def test_every_form_a_dataset_holds_reads_as_the_same_bytes(tmp_path):
    data = png()
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    limits = ImageLimits()
    assert load_image(data, limits) == data
    assert load_image(memoryview(data), limits) == data
    assert load_image(b64, limits) == data
    assert load_image("data:image/png;base64," + b64, limits) == data
    assert load_image("img/a.png", limits, tmp_path) == data  # relative to the dataset's folder
    assert load_image(str(tmp_path / "img" / "a.png"), limits, tmp_path / "elsewhere") == data  # absolute
    assert load_image("a.png", limits, [tmp_path / "nope", tmp_path / "img"]) == data  # the first folder that has it
    assert load_image({"bytes": data, "path": "ignored.png"}, limits) == data
    assert load_image({"bytes": None, "path": "img/a.png"}, limits, tmp_path) == data


def test_a_decoded_pil_image_is_stored_again_as_png():
    im = Image.new("RGB", (8, 8), "blue")
    back = load_image(im, ImageLimits())
    assert back.startswith(b"\x89PNG")
    assert pil_image(back).getpixel((3, 3)) == (0, 0, 255)
    with pytest.raises(BadImage, match="8x8 pixels, more than buffer.max_image_pixels=10"):
        load_image(im, ImageLimits(max_pixels=10))


def test_what_cannot_be_an_image_is_refused_saying_why(tmp_path):
    limits = ImageLimits()
    with pytest.raises(BadImage, match="URLs are not fetched"):
        load_image("https://example.com/a.png", limits)
    with pytest.raises(BadImage, match=r"'missing.png' is neither a file \(looked in .*\) nor base64"):
        load_image("missing.png", limits, tmp_path)
    # longer than a file name may be, not base64: refused, not an OSError from the file system
    with pytest.raises(BadImage, match="neither a file"):
        load_image("x" * 300 + "!", limits, tmp_path)
    with pytest.raises(BadImage, match="needs 'bytes' or 'path'"):
        load_image({"bytes": None, "path": None}, limits)
    with pytest.raises(BadImage, match="got int"):
        load_image(3, limits)
    with pytest.raises(BadImage, match="not an image file PIL can read"):
        load_image(b"not an image at all", limits)


def test_check_image_refuses_bytes_pixels_and_corrupt_data():
    data = png(size=(40, 30))
    assert check_image(data, ImageLimits(max_pixels=1200)) == data  # 40 x 30 = 1200: at the bound
    with pytest.raises(BadImage, match="40x30 pixels, more than buffer.max_image_pixels=1199"):
        check_image(data, ImageLimits(max_pixels=1199))
    with pytest.raises(BadImage, match=f"{len(data)} bytes, more than data.max_image_bytes=10"):
        check_image(data, ImageLimits(max_bytes=10, section="data"))
    with pytest.raises(BadImage, match="not an image file PIL can read"):
        check_image(data[:40], ImageLimits())  # cut inside the header
    broken = bytearray(png(size=(64, 64)))
    broken[60:90] = b"\x00" * 30  # the compressed pixels overwritten
    with pytest.raises(BadImage, match=r"not a readable image \(OSError: broken data stream"):
        check_image(bytes(broken), ImageLimits())  # the header reads; decoding the pixels fails


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path):
    (tmp_path / "big.png").write_bytes(png(size=(64, 64)))
    with pytest.raises(BadImage, match=r"big.png: \d+ bytes, more than buffer.max_image_bytes=100"):
        load_image("big.png", ImageLimits(max_bytes=100), tmp_path)


def test_parts_become_text_with_one_entry_per_marker():
    text, found = parts_to_text([{"type": "image"}, {"type": "text", "text": "What is it?"},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                 {"type": "image", "image": "b.png"}, {"type": "text", "text": f"and {IMAGE}"}], "k")
    assert text == f"{IMAGE}What is it?{IMAGE}{IMAGE}and {IMAGE}"
    assert found == [None, "data:image/png;base64,AAAA", "b.png", None]  # None: the image column gives it
    # a Parquet struct gives every part every key; a missing one reads None
    text, found = parts_to_text([{"type": "image", "text": None, "image": None},
                                 {"type": "text", "text": "hi", "image": None}], "k")
    assert (text, found) == (f"{IMAGE}hi", [None])
    assert parts_to_text(f"{IMAGE}{IMAGE}two", "k") == (f"{IMAGE}{IMAGE}two", [None, None])
    with pytest.raises(BadImage, match=r"k\[0\]: a part must be"):
        parts_to_text([{"type": "audio"}], "k")
    assert text_to_parts(f"{IMAGE}What is it?") == [{"type": "image"}, {"type": "text", "text": "What is it?"}]
