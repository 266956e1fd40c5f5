"""Vision-language prompts read by `buffer.prompts`: images from an image column (base64, file paths,
`{"bytes", "path"}` structs, a `datasets.Image` feature) and from chat messages' image parts, one
"<image>" marker per image; the limits and bad images refused naming the file and row; the bytes
leased in `PromptGroup.images` and through a msgpack round trip. Tiny PNGs are made here with PIL.
"""

from __future__ import annotations

import base64
import io
import json

import pytest

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from buffer.config import BufferConfig  # noqa: E402
from buffer.messages import LeaseGrant, decode, encode  # noqa: E402
from buffer.prompts import PromptsError, load_prompts, prompt_group, prompts_from_config  # noqa: E402
from common.images import IMAGE, ImageLimits  # noqa: E402
from tests.helpers.datasets import write_jsonl, write_parquet


def png(color="red", size=(8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


RED, BLUE = png("red"), png("blue")
NOISE = Image.effect_noise((32, 32), 64).convert("RGB")  # noise: hundreds of bytes, as PNG does not shrink it
BIG = io.BytesIO()
NOISE.save(BIG, format="PNG")
BIG = BIG.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ------------------------------------------------------------------------------------------------
# formats


def test_jsonl_with_base64_and_file_path_images(tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    (data / "img" / "blue.png").write_bytes(BLUE)
    p = write_jsonl(data / "p.jsonl", [
        {"prompt": "What color?", "images": b64(RED), "label": "red"},  # one image, no marker: put first
        {"prompt": f"Left {IMAGE} right {IMAGE} same?", "images": ["img/blue.png", "data:image/png;base64," + b64(RED)],
         "label": "no", "level": 2},
        {"prompt": "2+2=", "label": "4"},  # a text prompt in the same file
    ])
    monkeypatch.chdir(tmp_path)  # paths are the data file's folder's, not the working directory's
    a, b, c = load_prompts(str(p), limits=ImageLimits(max_images=2))
    assert (a.text, a.images, a.label) == (f"{IMAGE}What color?", [RED], "red")
    assert (b.text, b.images) == (f"Left {IMAGE} right {IMAGE} same?", [BLUE, RED])
    assert json.loads(b.columns) == {"level": 2}  # the images are no column of the reward functions
    assert (c.text, c.images, c.columns) == ("2+2=", None, "")


def test_an_input_template_keeps_the_markers_before_it(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What color?", "images": [b64(RED)]}])
    (r,) = load_prompts(str(p), input_template="Q: {}\nA:")
    assert r.text == f"{IMAGE}Q: What color?\nA:" and r.images == [RED]


def test_parquet_with_bytes_and_path_structs(tmp_path):
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "blue.png").write_bytes(BLUE)
    p = write_parquet(tmp_path / "p.parquet", [
        {"prompt": f"{IMAGE}Color?", "images": [{"bytes": RED, "path": "red.png"}], "label": "red"},
        {"prompt": f"{IMAGE}Color?", "images": [{"bytes": None, "path": "pics/blue.png"}], "label": "blue"},
        {"prompt": "No image", "images": None, "label": "x"},
    ])
    a, b, c = load_prompts(str(p))
    assert (a.images, b.images, c.images) == ([RED], [BLUE], None)
    assert [r.text for r in (a, b, c)] == [f"{IMAGE}Color?", f"{IMAGE}Color?", "No image"]


def test_a_save_to_disk_folder_with_an_image_feature_gives_the_stored_bytes(tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"prompt": datasets.Value("string"), "image": datasets.Image(),
                                  "label": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"prompt": ["Color?", f"{IMAGE} Color?"],
                                     "image": [{"bytes": RED, "path": None}, {"bytes": BLUE, "path": None}],
                                     "label": ["red", "blue"]}, features=features)
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved"))
    a, b = load_prompts(str(tmp_path / "saved"), image_key="image")
    # not decoded into PIL images and written again: the very bytes that were stored
    assert (a.images, b.images) == ([RED], [BLUE])
    assert (a.text, b.text, a.label) == (f"{IMAGE}Color?", f"{IMAGE} Color?", "red")

    many = datasets.Dataset.from_dict({"prompt": ["Same?"], "images": [[{"bytes": RED, "path": None}] * 2]},
                                      features=datasets.Features({"prompt": datasets.Value("string"),
                                                                  "images": datasets.List(datasets.Image())}))
    many.save_to_disk(str(tmp_path / "many"))
    (r,) = load_prompts(str(tmp_path / "many"), label_key="", limits=ImageLimits(max_images=2))
    assert r.images == [RED, RED] and r.text == f"{IMAGE}{IMAGE}Same?"


def test_a_hub_folder_reads_paths_from_the_files_folder_or_its_root(tmp_path):
    (tmp_path / "hub" / "images").mkdir(parents=True)
    (tmp_path / "hub" / "images" / "red.png").write_bytes(RED)
    write_jsonl(tmp_path / "hub" / "data" / "train-00000-of-00001.jsonl",
                [{"prompt": "Color?", "images": "images/red.png"}])  # a path from the dataset's root
    (r,) = load_prompts(str(tmp_path / "hub"))
    assert r.images == [RED]


# ------------------------------------------------------------------------------------------------
# chat messages


def test_chat_messages_with_image_parts_keep_markers_in_their_content(tmp_path):
    (tmp_path / "b.png").write_bytes(BLUE)
    p = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": [{"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Color?"}]}],
         "images": [b64(RED)], "label": "red"},
        {"prompt": [{"role": "user", "content": [{"type": "text", "text": "Compare "},
                                                 {"type": "image", "image": "b.png"},
                                                 {"type": "text", "text": " with "}, {"type": "image"}]}],
         "images": [b64(RED)]},  # a part that names its image, and one the column gives
        {"prompt": [{"role": "user", "content": "Color?"}], "images": [b64(BLUE)]},  # no marker: before the text
    ])
    a, b, c = load_prompts(str(p), limits=ImageLimits(max_images=2))
    assert a.messages == [("system", "Answer in one word."), ("user", f"{IMAGE}Color?")] and a.images == [RED]
    assert a.text == f"Answer in one word.\n{IMAGE}Color?"
    assert b.messages == [("user", f"Compare {IMAGE} with {IMAGE}")] and b.images == [BLUE, RED]
    assert c.messages == [("user", f"{IMAGE}Color?")] and c.images == [BLUE]


def test_chat_parts_in_parquet_structs(tmp_path):
    # every part of a Parquet column has every key: {"type", "text", "image"}, None where unused
    p = write_parquet(tmp_path / "chat.parquet", [
        {"prompt": [{"role": "user", "content": [{"type": "image", "text": None, "image": {"bytes": RED, "path": None}},
                                                 {"type": "text", "text": "Color?", "image": None}]}]}])
    (r,) = load_prompts(str(p), label_key="")
    assert r.messages == [("user", f"{IMAGE}Color?")] and r.images == [RED]


# ------------------------------------------------------------------------------------------------
# refusals: each names the file and line (or row)


@pytest.mark.parametrize("row, limits, expect", [
    ({"prompt": f"{IMAGE}{IMAGE}Same?", "images": [b64(RED)]}, ImageLimits(max_images=4),
     f"2 {IMAGE} markers for 1 images (1 in column 'images', 0 in message parts)"),
    ({"prompt": f"{IMAGE}Color?"}, ImageLimits(), f"1 {IMAGE} markers for 0 images"),
    ({"prompt": "Same?", "images": [b64(RED), b64(BLUE)]}, ImageLimits(),
     "2 images, more than buffer.max_images_per_prompt=1"),
    ({"prompt": "Color?", "images": [b64(RED)]}, ImageLimits(max_images=0),
     "1 images, more than buffer.max_images_per_prompt=0 (0: text prompts only)"),
    ({"prompt": "Color?", "images": [b64(BIG)]}, ImageLimits(max_bytes=100),
     f"image 0 (from column 'images'): {len(BIG)} bytes, more than buffer.max_image_bytes=100"),
    ({"prompt": "Color?", "images": [b64(png(size=(40, 30)))]}, ImageLimits(max_pixels=1000),
     "image 0 (from column 'images'): 40x30 pixels, more than buffer.max_image_pixels=1000"),
    ({"prompt": "Color?", "images": ["data:image/png;base64," + b64(RED[:40])]}, ImageLimits(),
     "image 0 (from column 'images'): not an image file PIL can read"),
    ({"prompt": "Color?", "images": "gone.png"}, ImageLimits(),
     "image 0 (from column 'images'): 'gone.png' is neither a file"),
    ({"prompt": [{"role": "user", "content": [{"type": "video"}]}]}, ImageLimits(),
     "'prompt'[0].content[0]: a part must be"),
])
def test_a_bad_image_row_is_refused_naming_the_file_and_line(tmp_path, row, limits, expect):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine", "images": None}, row])
    with pytest.raises(PromptsError) as e:
        load_prompts(str(p), limits=limits)
    assert str(e.value).startswith(f"{p}:2: ") and expect in str(e.value), str(e.value)


def test_a_bad_image_in_parquet_names_the_row(tmp_path):
    p = write_parquet(tmp_path / "p.parquet", [{"prompt": "ok", "images": [{"bytes": RED, "path": None}]},
                                               {"prompt": "bad", "images": [{"bytes": b"garbage", "path": None}]}])
    with pytest.raises(PromptsError, match=rf"{p}: row 1: image 0 \(from column 'images'\): not an image file"):
        load_prompts(str(p))


def test_with_max_images_0_markers_are_plain_text(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"What does the HTML tag {IMAGE} do?"}])
    (r,) = load_prompts(str(p), limits=ImageLimits(max_images=0))
    assert r.text == f"What does the HTML tag {IMAGE} do?" and r.images is None


# ------------------------------------------------------------------------------------------------
# the config and the wire


def test_prompts_from_config_uses_the_image_keys_for_training_and_evaluation(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"q": "Same?", "pics": [b64(RED), b64(BLUE)]}])
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"q": f"{IMAGE} Color?", "pics": b64(BLUE), "a": "blue"}])
    cfg = BufferConfig(prompts=str(train), input_key="q", label_key="a", image_key="pics", max_images_per_prompt=2)
    (t,) = prompts_from_config(cfg)
    (e,) = prompts_from_config(cfg, dataset=str(evals), split="train")
    assert t.images == [RED, BLUE] and (e.images, e.label) == ([BLUE], "blue")
    small = BufferConfig(**{**cfg.model_dump(), "max_image_bytes": len(RED) - 1})
    with pytest.raises(PromptsError, match=f"{train}:1: image 0 .* more than buffer.max_image_bytes={len(RED) - 1}"):
        prompts_from_config(small)


def test_the_images_are_leased_and_survive_the_wire(tmp_path):
    p = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Same?", "images": [b64(RED), b64(BLUE)], "label": "no"},
                                           {"prompt": "1+1=", "label": "2"}])
    vision, text = load_prompts(str(p), limits=ImageLimits(max_images=2))
    groups = [prompt_group(vision, 7), prompt_group(text, 8)]
    assert groups[0].images == [RED, BLUE] and groups[1].images is None
    back = decode(encode(LeaseGrant(lease_id=1, groups=groups, n_samples=4, ttl_s=60.0, version=0)))
    assert isinstance(back, LeaseGrant)
    g, h = back.groups
    assert (g.group_id, g.prompt, g.label) == (7, f"{IMAGE}{IMAGE}Same?", "no")
    assert [bytes(x) for x in g.images] == [RED, BLUE] and h.images is None
    assert Image.open(io.BytesIO(g.images[1])).getpixel((0, 0)) == (0, 0, 255)  # still the blue image
