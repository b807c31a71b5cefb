"""Images in a prompt: how many tokens each adds and what the vision encoder sees, per family.

The rules are the installed transformers' processors' (transformers 5.24), written out as pure
functions so that an estimate needs no torch (a cached one imports nothing heavy) and so each can be
checked against the real processor classes (tests/test_vision.py runs them on several image sizes).
The settings come, in this order, from the checkpoint's ``preprocessor_config.json`` /
``processor_config.json``, from the model's own config where the model fixes them (the vision tower's
input resolution, its patch size, the features per image: a processor that disagrees with the model
makes the model raise), and else from the processor class's defaults. :class:`ImagePlan` records
which came from where.

"Image tokens" are every id the processor puts into the prompt for an image except text characters:
the placeholders the model fills with image features, and the special tokens around them (Gemma 3's
``<start_of_image>`` / ``<end_of_image>``, Qwen's ``<|vision_start|>`` / ``<|vision_end|>`` that its
chat template wraps every image in, Idefics3's ``<fake_token_around_image>``, ``<row_i_col_j>`` and
``<global-img>``). Newlines a processor adds between rows of tiles and the words of Gemma 3's
pan-and-scan sentence are text: their token count depends on the tokenizer, and they belong to the
text prompt.

| family | tokens per image | what the encoder runs |
| --- | --- | --- |
| Gemma 3 | (1 + crops) x (mm_tokens_per_image + 2); crops only with pan-and-scan | (1 + crops) images at the vision size (896) |
| Qwen2-VL / 2.5-VL | (h/28)(w/28) + 2 after smart resize between min and max pixels | (h/14)(w/14) patches, one sequence |
| LLaVA(-1.5) | (S/p)^2 (+1 CLS with "full" feature selection) | 1 image at S (336) |
| Idefics3 / SmolVLM | (r*c + 1) x seq + 2 r*c + 3 (:func:`idefics3_plan`) | r*c tiles + 1 global image |
| Mllama | 1 (the image enters through cross-attention) | max_num_tiles tiles of 560, padded ones too |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import UserError

PREPROCESSOR = "preprocessor_config.json"
PROCESSOR = "processor_config.json"
CALL = "call"  # what a caller passes to processor(...) itself (Gemma 3's do_pan_and_scan=True), beside the files

IDEFICS3_MAX_SIDE = 4096  # transformers' MAX_IMAGE_SIZE in idefics3's image processor


@dataclass(frozen=True)
class ImagePlan:
    """What one image of ``width`` x ``height`` becomes for this model (every image of a workload is
    the same size)."""

    family: str
    width: int
    height: int
    tokens: int  # ids one image adds to the prompt (placeholders + special tokens)
    blocks: tuple[int, ...]  # runs of placeholders, in order (one per crop / tile / image)
    encoder_images: int  # images the vision encoder runs for one image (crops, tiles, padded tiles)
    encoder_size: tuple[int, int]  # (height, width) of each encoder image, after the processor's resize
    encoder_tokens: int  # the encoder's sequence per encoder image (patches, + CLS where it has one)
    grid: tuple[int, int, int] | None = None  # Qwen's image_grid_thw
    tiles: tuple[int, int] | None = None  # Idefics3: (rows, cols); Mllama: (tiles high, tiles wide)
    patch_values: int | None = None  # Qwen: values per flattened patch (3 x temporal x patch x patch)
    # {setting: [value, where it came from]}: the processor file, the model config or a class default
    settings: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def placeholders(self) -> int:
        return sum(self.blocks)

    @property
    def specials(self) -> int:
        return self.tokens - self.placeholders


# --------------------------------------------------------------------------------------------- families

def family(config: dict) -> str | None:
    """The image-token family of a config, or None: a text model, or a multimodal one whose image rule
    vramcal does not know (its weights are still exact; ``--images`` is refused)."""
    mt = config.get("model_type")
    return mt if mt in RULES else None


def is_multimodal(config: dict) -> bool:
    return isinstance(config.get("vision_config"), dict) or family(config) is not None


def _sub(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _files(processor: dict | None) -> tuple[dict, dict]:
    processor = processor or {}
    pre, proc = processor.get(PREPROCESSOR), processor.get(PROCESSOR)
    return (pre if isinstance(pre, dict) else {}), (proc if isinstance(proc, dict) else {})


class _Settings:
    """Reads a setting from the processor files, the model config or a default, and notes the source."""

    def __init__(self, processor: dict | None):
        self.pre, self.proc = _files(processor)
        call = (processor or {}).get(CALL)
        self.call = call if isinstance(call, dict) else {}
        self.used: dict[str, list] = {}

    def note(self, name: str, value, source: str):
        self.used[name] = [value, source]
        return value

    def pick(self, name: str, *candidates):
        """The first candidate ``(value, source)`` whose value is not None."""
        for value, source in candidates:
            if value is not None:
                return self.note(name, value, source)
        raise UserError(f"no value for the image processor's {name}: give the checkpoint's {PREPROCESSOR}")


def _int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise UserError(f"the image processor's {what} = {value!r} is not a positive whole number: "
                        f"fix {PREPROCESSOR}")
    return int(value)


def _edge(size, *keys):
    """A value from a processor ``size`` entry: a dict with one of ``keys``, or a bare number."""
    if isinstance(size, dict):
        for key in keys:
            if size.get(key) is not None:
                return size[key]
        return None
    return size if isinstance(size, (int, float)) and not isinstance(size, bool) else None


# Gemma 3 ------------------------------------------------------------------------------------------

def pan_and_scan_crops(width: int, height: int, min_crop: int, max_crops: int, min_ratio: float) -> int:
    """Gemma3ImageProcessor.pan_and_scan: how many crops an image gets besides itself (0: none)."""
    if width >= height:
        if width / height < min_ratio:
            return 0
        n = min(int(math.floor(width / min_crop)), int(math.floor(width / height + 0.5)))
        n = min(max_crops, max(2, n))
        crop_w, crop_h = int(math.ceil(width / n)), height
    else:
        if height / width < min_ratio:
            return 0
        n = min(int(math.floor(height / min_crop)), int(math.floor(height / width + 0.5)))
        n = min(max_crops, max(2, n))
        crop_w, crop_h = width, int(math.ceil(height / n))
    return 0 if min(crop_w, crop_h) < min_crop else n


def gemma3_plan(config: dict, processor: dict | None, width: int, height: int) -> ImagePlan:
    s = _Settings(processor)
    vc = _sub(config, "vision_config")
    side = s.pick("size", (_edge(s.pre.get("size"), "height"), PREPROCESSOR),
                  (vc.get("image_size"), "vision_config.image_size"))
    side = _int(side, "size")
    patch = _int(s.pick("patch_size", (vc.get("patch_size"), "vision_config")), "patch_size")
    per = _int(s.pick("tokens per image", (config.get("mm_tokens_per_image"), "mm_tokens_per_image")),
               "mm_tokens_per_image")
    # Gemma3Processor hands its own defaults for pan-and-scan to the image processor at every call, over
    # whatever preprocessor_config.json says: only a caller's own argument turns it on
    default = "Gemma3Processor default (it overrides the preprocessor file)"
    pas = bool(s.pick("do_pan_and_scan", (s.call.get("do_pan_and_scan"), CALL), (False, default)))
    crops = 0
    if pas:
        min_crop = _int(s.pick("pan_and_scan_min_crop_size", (s.call.get("pan_and_scan_min_crop_size"), CALL),
                               (256, default)), "pan_and_scan_min_crop_size")
        max_crops = _int(s.pick("pan_and_scan_max_num_crops", (s.call.get("pan_and_scan_max_num_crops"), CALL),
                                (4, default)), "pan_and_scan_max_num_crops")
        ratio = s.pick("pan_and_scan_min_ratio_to_activate",
                       (s.call.get("pan_and_scan_min_ratio_to_activate"), CALL), (1.2, default))
        crops = pan_and_scan_crops(width, height, min_crop, max_crops, float(ratio))
    n = 1 + crops
    return ImagePlan("gemma3", width, height, tokens=n * (per + 2), blocks=(per,) * n, encoder_images=n,
                     encoder_size=(side, side), encoder_tokens=(side // patch) ** 2, settings=s.used)


# Qwen2-VL / Qwen2.5-VL ----------------------------------------------------------------------------

QWEN_MIN_PIXELS = 56 * 56  # Qwen2VLImageProcessor's class defaults
QWEN_MAX_PIXELS = 28 * 28 * 1280


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen2_vl's smart_resize: each side a multiple of ``factor``, the area within [min, max] pixels."""
    if max(height, width) / min(height, width) > 200:
        raise UserError(f"--image-size {width}x{height}: Qwen's image processor refuses an aspect ratio above 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen_settings(config: dict, processor: dict | None) -> tuple[_Settings, int, int, int, int, int]:
    s = _Settings(processor)
    vc = _sub(config, "vision_config")
    size = s.pre.get("size") if isinstance(s.pre.get("size"), dict) else {}
    min_px = _int(s.pick("min_pixels", (s.pre.get("min_pixels"), PREPROCESSOR), (size.get("shortest_edge"), PREPROCESSOR),
                         (QWEN_MIN_PIXELS, "class default")), "min_pixels")
    max_px = _int(s.pick("max_pixels", (s.pre.get("max_pixels"), PREPROCESSOR), (size.get("longest_edge"), PREPROCESSOR),
                         (QWEN_MAX_PIXELS, "class default")), "max_pixels")
    patch = _int(s.pick("patch_size", (s.pre.get("patch_size"), PREPROCESSOR), (vc.get("patch_size"), "vision_config"),
                        (14, "class default")), "patch_size")
    merge = _int(s.pick("merge_size", (s.pre.get("merge_size"), PREPROCESSOR),
                        (vc.get("spatial_merge_size"), "vision_config"), (2, "class default")), "merge_size")
    temporal = _int(s.pick("temporal_patch_size", (s.pre.get("temporal_patch_size"), PREPROCESSOR),
                           (vc.get("temporal_patch_size"), "vision_config"), (2, "class default")),
                    "temporal_patch_size")
    return s, min_px, max_px, patch, merge, temporal


def qwen_plan(config: dict, processor: dict | None, width: int, height: int) -> ImagePlan:
    s, min_px, max_px, patch, merge, temporal = _qwen_settings(config, processor)
    h, w = smart_resize(height, width, patch * merge, min_px, max_px)
    gh, gw = h // patch, w // patch
    n = gh * gw // (merge * merge)
    return ImagePlan(config.get("model_type", "qwen2_vl"), width, height, tokens=n + 2, blocks=(n,),
                     encoder_images=1, encoder_size=(h, w), encoder_tokens=gh * gw, grid=(1, gh, gw),
                     patch_values=3 * temporal * patch * patch, settings=s.used)


def qwen_default_size(config: dict, processor: dict | None) -> tuple[int, int]:
    """The largest square the processor keeps whole: max_pixels' side, rounded down to the resize factor
    (Qwen's processor has no fixed size; this is the most it gives one image)."""
    _, _, max_px, patch, merge, _ = _qwen_settings(config, processor)
    factor = patch * merge
    side = max(factor, math.isqrt(max_px) // factor * factor)
    return side, side


# LLaVA ----------------------------------------------------------------------------------------------

def llava_plan(config: dict, processor: dict | None, width: int, height: int) -> ImagePlan:
    s = _Settings(processor)
    vc = _sub(config, "vision_config")
    crop = s.pick("crop_size", (_edge(s.pre.get("crop_size"), "height", "shortest_edge"), PREPROCESSOR),
                  (vc.get("image_size"), "vision_config.image_size"))
    crop = _int(crop, "crop_size")
    patch = _int(s.pick("patch_size", (vc.get("patch_size"), "vision_config")), "patch_size")
    strategy = s.pick("vision_feature_select_strategy", (config.get("vision_feature_select_strategy"), "config"),
                      ("default", "config default"))
    patches = (crop // patch) ** 2
    n = patches if strategy == "default" else patches + 1  # "default" drops CLS, "full" keeps it
    return ImagePlan("llava", width, height, tokens=n, blocks=(n,), encoder_images=1, encoder_size=(crop, crop),
                     encoder_tokens=patches + 1, settings=s.used)


# Idefics3 / SmolVLM -------------------------------------------------------------------------------

def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        if height % 2:
            height += 1
    else:
        height = max_len
        width = int(height * aspect)
        if width % 2:
            width += 1
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _resize_for_encoder(height: int, width: int, tile: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def idefics3_plan(config: dict, processor: dict | None, width: int, height: int) -> ImagePlan:
    """Resize so the longest edge is ``size.longest_edge`` (small images are scaled up), cap at 4096,
    round each side up to a multiple of the tile (``max_image_size``), split into rows x cols tiles plus
    one global image. Per image: rows x cols x (fake + <row_i_col_j> + seq placeholders) and fake +
    <global-img> + seq + fake; seq = (tile / patch)^2 / scale_factor^2."""
    s = _Settings(processor)
    vc = _sub(config, "vision_config")
    tile = s.pick("max_image_size", (_edge(s.pre.get("max_image_size"), "longest_edge"), PREPROCESSOR),
                  (vc.get("image_size"), "vision_config.image_size"))
    tile = _int(tile, "max_image_size")
    longest = _int(s.pick("size.longest_edge", (_edge(s.pre.get("size"), "longest_edge"), PREPROCESSOR),
                          (4 * tile, "class default: 4 x max_image_size")), "size.longest_edge")
    split = bool(s.pick("do_image_splitting", (s.pre.get("do_image_splitting"), PREPROCESSOR),
                        (True, "class default")))
    patch = _int(s.pick("patch_size", (vc.get("patch_size"), "vision_config")), "patch_size")
    scale = _int(s.pick("scale_factor", (config.get("scale_factor"), "config")), "scale_factor")
    seq = (tile // patch) ** 2 // (scale * scale)
    rows = cols = 0
    if split:
        h, w = _rescale_to_max_len(height, width, longest)
        h, w = _scale_below(h, w, IDEFICS3_MAX_SIDE)
        h, w = _resize_for_encoder(h, w, tile)
        if h > tile or w > tile:
            rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
    tiles = rows * cols
    n = tiles + 1
    return ImagePlan(config.get("model_type", "idefics3"), width, height, tokens=n * seq + 2 * tiles + 3,
                     blocks=(seq,) * n, encoder_images=n, encoder_size=(tile, tile),
                     encoder_tokens=(tile // patch) ** 2, tiles=(rows, cols), settings=s.used)


# Mllama ---------------------------------------------------------------------------------------------

def mllama_arrangements(max_tiles: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1) if a * b <= max_tiles]


def mllama_canvas(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """get_optimal_tiled_canvas: the canvas (tiles high, tiles wide) the image is fitted to."""
    options = mllama_arrangements(max_tiles)
    scales = [min(a * tile / height, b * tile / width) for a, b in options]
    up = [x for x in scales if x >= 1]
    chosen = min(up) if up else max(scales)
    picks = [o for o, x in zip(options, scales) if x == chosen]
    return min(picks, key=lambda o: o[0] * o[1])


def mllama_plan(config: dict, processor: dict | None, width: int, height: int) -> ImagePlan:
    s = _Settings(processor)
    vc = _sub(config, "vision_config")
    tile = _int(s.pick("size", (_edge(s.pre.get("size"), "height"), PREPROCESSOR),
                       (vc.get("image_size"), "vision_config.image_size")), "size")
    max_tiles = _int(s.pick("max_image_tiles", (s.pre.get("max_image_tiles"), PREPROCESSOR),
                            (vc.get("max_num_tiles"), "vision_config.max_num_tiles")), "max_image_tiles")
    patch = _int(s.pick("patch_size", (vc.get("patch_size"), "vision_config")), "patch_size")
    canvas = mllama_canvas(height, width, max_tiles, tile)
    per_tile = (tile // patch) ** 2 + 1  # + CLS
    return ImagePlan("mllama", width, height, tokens=1, blocks=(1,), encoder_images=max_tiles,
                     encoder_size=(tile, tile), encoder_tokens=per_tile, tiles=canvas, settings=s.used)


RULES = {"gemma3": gemma3_plan, "qwen2_vl": qwen_plan, "qwen2_5_vl": qwen_plan, "llava": llava_plan,
         "idefics3": idefics3_plan, "mllama": mllama_plan}
LABELS = {"gemma3": "Gemma 3", "qwen2_vl": "Qwen2-VL", "qwen2_5_vl": "Qwen2.5-VL", "llava": "LLaVA",
          "idefics3": "Idefics3 / SmolVLM", "mllama": "Mllama (Llama 3.2 Vision)"}


def default_size(config: dict, processor: dict | None) -> tuple[int, int]:
    """The image size ``--image-size`` defaults to: the size the processor brings every image to (Gemma 3,
    LLaVA, Mllama's tile, Idefics3's longest edge), or for Qwen the largest square it keeps whole."""
    fam = family(config)
    if fam in ("qwen2_vl", "qwen2_5_vl"):
        return qwen_default_size(config, processor)
    plan = RULES[fam](config, processor, 1024, 1024)
    if fam == "idefics3":
        side = _int(_edge(_files(processor)[0].get("size"), "longest_edge") or 4 * plan.encoder_size[0],
                    "size.longest_edge")
        return side, side
    return plan.encoder_size[1], plan.encoder_size[0]


@dataclass(frozen=True)
class Images:
    """The images of a workload on one model: ``count`` per prompt (batch row), each as ``plan``."""

    count: int
    plan: ImagePlan
    size_given: bool  # --image-size was given (else the processor's default size)
    # where the processor settings came from when the checkpoint has no preprocessor_config.json
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def tokens(self) -> int:
        """Image tokens of one prompt, over all its images."""
        return self.count * self.plan.tokens

    def key(self) -> str:
        """What decides the traced tensors: part of the dry run's cache key."""
        p = self.plan
        return (f"{self.count}x{p.family}:{p.tokens}:{','.join(map(str, p.blocks))}:{p.encoder_images}:"
                f"{p.encoder_size[0]}x{p.encoder_size[1]}:{p.grid}:{p.tiles}")


def check_images(config: dict, count: int, where: str = "the model") -> None:
    """Refuse images, in one line, for a text model or a family whose image rule vramcal does not know
    (from the config as given: before anything is built)."""
    if not count or family(config) is not None:
        return
    if is_multimodal(config):
        raise UserError(f"{where} is a {config.get('model_type')} vision-language model, whose image rule vramcal "
                        f"does not know yet (it knows {', '.join(LABELS.values())}): drop --images")
    raise UserError(f"{where} is a text-only model ({config.get('model_type')}): it takes no images; drop --images")


def catalog_processor(config: dict) -> tuple[str, str | None, dict] | None:
    """The built-in catalog's entry a config is (every architecture field the entry transcribes, equal
    in ``config``) with processor files: (catalog name, Hub id, its processor), else None."""
    from .resolve import catalog_entry, catalog_names

    for name in catalog_names():
        entry = catalog_entry(name)
        meta = entry.get("_vramcal_catalog") or {}
        if not meta.get("processor") or entry.get("model_type") != config.get("model_type"):
            continue
        fields = {k: v for k, v in entry.items() if k not in ("_vramcal_catalog", "transformers_version",
                                                                 "_name_or_path", "architectures_note")}
        if all(config.get(k) == v for k, v in fields.items()):
            return name, meta.get("hub_id"), meta["processor"]
    return None


def processor_or_catalog(config: dict, processor: dict | None) -> tuple[dict | None, list[str]]:
    """The processor settings a model's images follow, and a note where they are not the checkpoint's
    own: a folder without preprocessor_config.json takes the catalog's files when it is a known catalog
    model, else transformers' class defaults -- which can differ from the published processor (Qwen2.5-VL:
    max_pixels 1,003,520 against the published 12,845,056, 1,225 tokens against 1,369 for 1024x1024)."""
    pre, _ = _files(processor)
    if pre:
        return processor, []
    known = catalog_processor(config)
    if known is not None:
        name, hub, files = known
        return {**(processor or {}), **files}, [
            f"no {PREPROCESSOR} beside the model: it is the catalog's {name} ({hub or 'no Hub id'}), so that "
            "processor's settings are used"]
    return processor, [f"no {PREPROCESSOR} beside the model: the image rule uses transformers' class defaults "
                       "(settings below), which may differ from the checkpoint's processor; copy its "
                       f"{PREPROCESSOR} beside config.json for the real figures"]


def plan_images(config: dict, processor: dict | None, count: int, size: tuple[int, int] | None,
                where: str = "the model", source_config: dict | None = None) -> Images | None:
    """The images of a workload, or None for none (``config`` as transformers filled it; ``source_config``
    as given, to know a catalog model by). A text model with images, a family whose rule vramcal does not
    know, or images whose tokens do not fit the model's positions, are refused in one line."""
    from .resolve import size_field, text_config

    if not count:
        return None
    check_images(config, count, where)
    processor, notes = processor_or_catalog(source_config or config, processor)
    fam = family(config)
    if size is None:
        w, h = default_size(config, processor)
    else:
        w, h = size
    images = Images(count, RULES[fam](config, processor, w, h), size is not None, tuple(notes))
    limit = size_field(text_config(config), "max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and images.tokens >= limit:
        most = (limit - 1) // images.plan.tokens
        raise UserError(f"--images {count}: {count} image(s) of {w}x{h} are {images.tokens:,} tokens, more than the "
                        f"{limit:,} positions of {where} (with the prompt's text): give at most {most} image(s) "
                        "of that size, or a smaller --image-size")
    return images


# ------------------------------------------------------------------------ the tensors of a prompt
# Built here once for the dry run (moved to the meta device) and the probe (moved to the GPU): the
# token layout and the text-side inputs the family's processor returns. Torch is imported only here.

def _cfg_id(cfg, *names):
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def special_ids(cfg) -> dict[str, int | None]:
    """The ids a family's prompt uses around images, from the built config: the placeholder, and the
    tokens before / after each run of placeholders where the config names them."""
    return {"image": _cfg_id(cfg, "image_token_id", "image_token_index"),
            "before": _cfg_id(cfg, "vision_start_token_id", "boi_token_id", "boi_token_index"),
            "after": _cfg_id(cfg, "vision_end_token_id", "eoi_token_id", "eoi_token_index")}


def reserved_ids(cfg) -> set[int]:
    """Ids a random text prompt must avoid: every id the config gives an image or video meaning."""
    out = set()
    for name in ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id",
                 "vision_end_token_id", "vision_token_id", "boi_token_id", "boi_token_index", "eoi_token_id",
                 "eoi_token_index"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out.add(value)
    return out


def image_layout(plan: ImagePlan, ids: dict[str, int | None], filler: int) -> list[int]:
    """One image's ids: each run of placeholders with the family's specials around it (``filler`` for
    special tokens the config does not name: Idefics3's row / column and global markers)."""
    per = plan.specials // len(plan.blocks)
    extra = plan.specials - per * len(plan.blocks)
    before = ids["before"] if ids["before"] is not None else filler
    after = ids["after"] if ids["after"] is not None else filler
    out: list[int] = []
    for block in plan.blocks:
        head = per - per // 2
        out += [before] * head + [ids["image"]] * block + [after] * (per - head)
    return out + [filler] * extra


def prompt_ids(cfg, images: Images, batch: int, text_tokens: int, text=None):
    """``batch`` rows of ``text_tokens`` text ids with ``images.count`` images after the first text token
    (CPU int64). ``text(n)`` gives n text ids (default: a fixed id no image rule uses)."""
    import torch

    ids = special_ids(cfg)
    if ids["image"] is None:
        raise UserError(f"the {images.plan.family} config names no image token id: vramcal cannot lay out an image")
    reserved = reserved_ids(cfg)
    filler = next(i for i in range(3, 1 << 20) if i not in reserved)
    if text is None:
        def text(n):
            return [filler] * n
    rows = []
    for _ in range(batch):
        words = list(text(text_tokens))
        row = words[:1]
        for _ in range(images.count):
            row += image_layout(images.plan, ids, filler)
        rows.append(row + words[1:])
    return torch.tensor(rows, dtype=torch.long)


def text_side_inputs(cfg, images: Images, ids) -> dict:
    """What the family's processor returns beside ``input_ids`` and the pixels, made from the ids: Gemma 3's
    ``token_type_ids`` (its images attend to themselves both ways), Qwen's ``mm_token_type_ids`` (its
    3-D rope positions), Mllama's ``cross_attention_mask`` (batch, seq, images, tiles)."""
    import torch

    fam = images.plan.family
    image_id = special_ids(cfg)["image"]
    if fam == "gemma3":
        return {"token_type_ids": (ids == image_id).long()}
    if fam in ("qwen2_vl", "qwen2_5_vl"):
        return {"mm_token_type_ids": (ids == image_id).long()}
    if fam == "mllama":
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        rows = ids.tolist()
        sparse = [get_cross_attention_token_mask(row, image_id) for row in rows]
        used = images.plan.tiles[0] * images.plan.tiles[1]
        dense = convert_sparse_cross_attention_mask_to_dense(sparse, [[used] * images.count] * len(rows),
                                                             images.plan.encoder_images, ids.shape[1])
        return {"cross_attention_mask": torch.from_numpy(dense).long()}
    return {}


def pixel_inputs(images: Images, batch: int, dtype) -> dict:
    """Pixel tensors of the shapes the family's image processor returns for ``batch`` prompts, for the
    dry run: ones (so no image looks like padding), each pixel tensor and mask one stored element
    expanded to its shape -- CPU memory of a few bytes whatever the images' number and size (the dry run
    moves them to the meta device, which counts what the device would hold). The grids and ratios are
    real: the forward reads them. The probe takes its pixels from the real image processor."""
    import torch

    def ones(*shape, dtype=dtype):
        return torch.ones((), dtype=dtype).expand(*shape)

    p = images.plan
    n = batch * images.count
    h, w = p.encoder_size
    fam = p.family
    if fam in ("qwen2_vl", "qwen2_5_vl"):
        t, gh, gw = p.grid
        return {"pixel_values": ones(n * t * gh * gw, p.patch_values),
                "image_grid_thw": torch.tensor([list(p.grid)] * n, dtype=torch.long)}
    if fam == "idefics3":
        tiles = images.count * p.encoder_images
        return {"pixel_values": ones(batch, tiles, 3, h, w),
                "pixel_attention_mask": ones(batch, tiles, h, w, dtype=torch.long)}
    if fam == "mllama":
        a, b = p.tiles
        ratio = mllama_arrangements(p.encoder_images).index((a, b)) + 1
        mask = torch.zeros(batch, images.count, p.encoder_images, dtype=torch.long)
        mask[..., :a * b] = 1
        return {"pixel_values": ones(batch, images.count, p.encoder_images, 3, h, w),
                "aspect_ratio_ids": torch.full((batch, images.count), ratio, dtype=torch.long),
                "aspect_ratio_mask": mask}
    return {"pixel_values": ones(n * p.encoder_images, 3, h, w)}


def decode_inputs(images: Images, prefill: dict) -> dict:
    """What ``generate`` passes at every decode step besides the new token (Mllama: the last position's
    cross-attention mask)."""
    mask = prefill.get("cross_attention_mask")
    if images.plan.family == "mllama" and mask is not None:
        return {"cross_attention_mask": mask[:, -1:].clone()}
    return {}


# Where a plan's setting lives in the family's image processor (None: the model's, not the processor's)
_PROCESSOR_KEYS = {
    "gemma3": {"size": lambda v: {"size": {"height": v, "width": v}}, "do_pan_and_scan": "do_pan_and_scan",
               "pan_and_scan_min_crop_size": "pan_and_scan_min_crop_size",
               "pan_and_scan_max_num_crops": "pan_and_scan_max_num_crops",
               "pan_and_scan_min_ratio_to_activate": "pan_and_scan_min_ratio_to_activate"},
    "qwen": {"min_pixels": "min_pixels", "max_pixels": "max_pixels", "patch_size": "patch_size",
             "merge_size": "merge_size", "temporal_patch_size": "temporal_patch_size"},
    "llava": {"crop_size": lambda v: {"crop_size": {"height": v, "width": v}, "size": {"shortest_edge": v}}},
    "idefics3": {"max_image_size": lambda v: {"max_image_size": {"longest_edge": v}},
                 "size.longest_edge": lambda v: {"size": {"longest_edge": v}},
                 "do_image_splitting": "do_image_splitting"},
    "mllama": {"size": lambda v: {"size": {"height": v, "width": v}}, "max_image_tiles": "max_image_tiles"},
}


def image_processor_settings(plan: ImagePlan, processor: dict | None) -> dict:
    """Keyword arguments for the family's image processor that make it do what ``plan`` says: the
    checkpoint's preprocessor_config.json, plus each setting the plan took from the model config or a
    class default (a checkpoint without the file)."""
    pre, _ = _files(processor)
    out = {k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class", "auto_map",
                                                     "image_seq_length")}
    fam = "qwen" if plan.family in ("qwen2_vl", "qwen2_5_vl") else plan.family
    for name, (value, source) in plan.settings.items():
        key = _PROCESSOR_KEYS.get(fam, {}).get(name)
        if key is None or source == PREPROCESSOR:
            continue  # the model's own setting, or one the file already gives
        out.update(key(value) if callable(key) else {key: value})
    if fam == "qwen":  # the class reads min / max pixels from size
        out["size"] = {"shortest_edge": plan.settings["min_pixels"][0], "longest_edge": plan.settings["max_pixels"][0]}
        out.pop("min_pixels", None)
        out.pop("max_pixels", None)
    return out
