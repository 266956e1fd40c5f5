"""Pictures for the vision-language tests."""

from __future__ import annotations

import io

import numpy as np


def picture(width: int, height: int, seed: int) -> bytes:
    """A PNG of seeded noise: every picture differs, so the model's answer depends on which it sees."""
    from PIL import Image

    px = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(px).save(out, format="PNG")
    return out.getvalue()
