"""Real image inputs for a probe: synthetic pictures of the asked size through the model's own image
processor class (the one its ``preprocessor_config.json`` names, else the family's), with the settings
the estimate's rule used (:func:`vramcal.estimator.vision.image_processor_settings`).

What the processor returns is checked against the rule before anything runs: a rule that disagrees
with the installed processor (another grid, another tile count) stops the probe with a one-line error
naming both, instead of a model error about placeholder counts.
"""

from __future__ import annotations

from ..estimator.vision import PREPROCESSOR, Images, image_processor_settings, pixel_inputs

# what the processors return that no model forward takes
_NOT_MODEL_INPUTS = ("num_crops", "num_tiles", "rows", "cols", "image_sizes")


def image_processor(model_type: str, images: Images, processor: dict | None):
    """The image processor the checkpoint would load, on its PIL backend (no torchvision needed)."""
    from transformers.models.auto.image_processing_auto import (
        IMAGE_PROCESSOR_MAPPING_NAMES,
        get_image_processor_class_from_name,
    )

    pre = (processor or {}).get(PREPROCESSOR) or {}
    cls = None
    named = pre.get("image_processor_type")
    if isinstance(named, str) and named:
        base = named.removesuffix("Fast")
        cls = get_image_processor_class_from_name(base + "Pil") or get_image_processor_class_from_name(base)
    if cls is None:
        names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
        name = names.get("pil") if isinstance(names, dict) else None
        cls = get_image_processor_class_from_name(name) if name else None
    if cls is None:
        raise RuntimeError(f"no image processor class for {model_type} ({named or 'none named'})")
    return cls(**image_processor_settings(images.plan, processor))


def picture(width: int, height: int, seed: int = 0):
    """A random-pixel RGB picture (its values move nothing a probe measures)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def real_image_inputs(model_type: str, images: Images, processor: dict | None, batch: int, dtype) -> dict:
    """The pixel inputs of ``batch`` prompts with ``images.count`` pictures each, as the image processor
    makes them (floating tensors in ``dtype``, as ``processor(...).to(device, dtype)`` leaves them).
    Raises RuntimeError when their shapes are not the ones the estimate's rule traced."""
    import torch

    ip = image_processor(model_type, images, processor)
    p = images.plan
    pics = [[picture(p.width, p.height, seed=i * images.count + j) for j in range(images.count)] for i in range(batch)]
    nested = p.family in ("idefics3", "mllama")  # these take one list of pictures per prompt
    out = ip(images=pics if nested else [x for row in pics for x in row], return_tensors="pt")
    got = {k: v for k, v in out.items() if k not in _NOT_MODEL_INPUTS}
    want = pixel_inputs(images, batch, dtype)
    for key, ref in want.items():
        have = got.get(key)
        if have is None or tuple(have.shape) != tuple(ref.shape):
            raise RuntimeError(f"the {p.family} image rule and the installed image processor {type(ip).__name__} "
                               f"disagree for a {p.width}x{p.height} image: {key} "
                               f"{None if have is None else tuple(have.shape)} made, {tuple(ref.shape)} ruled")
        if not ref.is_floating_point() and key != "pixel_attention_mask" and not torch.equal(have.long(), ref):
            raise RuntimeError(f"the {p.family} image rule and {type(ip).__name__} disagree for a {p.width}x"
                               f"{p.height} image: {key} {have.tolist()} made, {ref.tolist()} ruled")
    return {k: (v.to(dtype) if v.is_floating_point() else v.long()) for k, v in got.items() if k in want}
