"""What the vision-language tests of actors/ share: noise pictures, and the tiny Qwen2-VL's tokenizer
and processor (its folder: tests/conftest.py `vlm_dir`)."""

from __future__ import annotations

import pytest

from tests.helpers.vision import picture


@pytest.fixture(scope="session")
def pics() -> dict[str, bytes]:
    return {"a": picture(56, 56, 0), "b": picture(56, 56, 1), "wide": picture(112, 56, 2), "big": picture(84, 84, 3)}


@pytest.fixture(scope="session")
def tok(vlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="session")
def processor(vlm_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(vlm_dir)
