"""The workload a user describes, and the rules every command shares about it.

One home for: the default number of generated tokens, the stage names, dtype and device spellings,
the validation of counts and sizes, and the command line that reproduces a configuration -- so an
estimate, a probe, a proposal, a memo and a recheck all mean the same thing by ``--ctx`` and can only
print commands the parser accepts.

Context arithmetic (docs/accounting.md): ``ctx`` is the whole context, prompt + new tokens. The
prefill runs over the prompt; each of the ``new_tokens`` generated tokens but the last is fed back, so
a dynamic cache at the end holds ``prompt + new_tokens - 1`` positions. ``--prompt P`` may be given
instead of ``--ctx``: "8k prompt, 1k answer" is ``--prompt 8192 --new-tokens 1024``.

This module imports nothing heavy; the command line's start-up depends on it.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass

from .errors import UserError

NEW_TOKENS = 16  # the probe's shortest run, and the default of --new-tokens
DEFAULT_CTX = 4096

# What an estimate predicts and a probe measures, in order. A probe also reads ``baseline`` (imports
# done, device untouched) and, on a GPU, ``context`` (CUDA initialised).
STAGES = ("load_peak", "post_load", "first_token", "end")
PROBE_STAGES = ("baseline", "context") + STAGES
STAGE_LABELS = {"load_peak": "load peak", "post_load": "after load", "first_token": "first token (prefill)",
                "end": "end"}

QUANTS = ("auto", "bf16", "fp16", "fp32", "int8", "nf4", "nf4-dq", "fp4", "fp4-dq")
POLICIES = ("quality", "context", "throughput")  # orders of the what-to-change ladder (calibrate.proposals)
GOALS = ("quality", "context", "speed")  # vramcal plan --goal (docs/plan.md)
ATTNS = ("auto", "sdpa", "eager", "flash_attention_2")
CACHES = ("dynamic", "static")
KV_DTYPES = ("auto", "fp8")

# Every spelling of a dtype a user may type, to the torch name. ``--quant fp16`` and ``--dtype fp16``
# mean the same dtype.
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
          "fp32": "float32", "float32": "float32", "float": "float32"}
DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

# Beyond these a figure is not a workload anyone runs; refused rather than computed.
MAX_TOKENS = 1 << 24  # 16.7 M positions
MAX_BATCH = 1 << 16
MAX_IMAGES = 256  # per prompt
MAX_IMAGE_SIDE = 1 << 15  # 32768 px


def parse_dtype(text: str | None, flag: str = "--dtype") -> str | None:
    """``bf16``/``bfloat16``/... -> the torch name; None stays None (the config's own dtype)."""
    if text is None:
        return None
    name = DTYPES.get(str(text).lower().removeprefix("torch."))
    if name is None:
        raise UserError(f"unknown {flag} {text!r}: choose bf16, fp16 or fp32 (or bfloat16, float16, float32)")
    return name


def parse_quant(text: str | None) -> str:
    name = (text or "auto").lower()
    if name not in QUANTS:
        raise UserError(f"unknown quant {text!r}: choose one of {', '.join(QUANTS)}")
    return name


def choice(value: str, choices: tuple[str, ...], flag: str) -> str:
    if value not in choices:
        raise UserError(f"unknown {flag} {value!r}: choose one of {', '.join(choices)}")
    return value


_DEVICE = re.compile(r"(cpu)|(disk)|cuda(?::(0|[1-9][0-9]{0,2}))?|(0|[1-9][0-9]{0,2})")


@dataclass(frozen=True)
class Device:
    """A device as vramcal means it: ``cpu``, ``cuda:N`` or, in a placement, ``disk``."""

    kind: str  # cpu | cuda | disk
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def accelerate_key(self) -> int | str:
        """accelerate's and transformers' key in ``max_memory`` / ``device_map``: 0, "cpu", "disk"."""
        return self.index if self.kind == "cuda" else self.kind

    @property
    def order(self) -> tuple[int, int]:
        """GPUs first by index, then cpu, then disk (accelerate's order)."""
        return (0, self.index) if self.kind == "cuda" else ((1, 0) if self.kind == "cpu" else (2, 0))


def parse_device(text, default: str = "cuda:0", *, placement: bool = False, flag: str = "device") -> Device:
    """``cpu``, ``cuda`` (= ``cuda:0``) or ``cuda:N``; with ``placement`` also ``disk`` and accelerate's bare
    GPU index (``0``, as a ``max_memory`` key). Anything else is refused in one line. The one parser of
    device strings: every other unit asks it."""
    if isinstance(text, Device):
        return text
    if isinstance(text, int) and not isinstance(text, bool) and placement and text >= 0:
        return Device("cuda", text)
    text = default if text is None else str(text)
    if placement:  # a max_memory key as accelerate reads it: case and spaces around it do not matter
        text = text.strip().lower()
    m = _DEVICE.fullmatch(text)
    if m is not None and (placement or not (m.group(2) or m.group(4))):
        if m.group(1):
            return Device("cpu")
        if m.group(2):
            return Device("disk")
        return Device("cuda", int(m.group(3) or m.group(4) or 0))
    if placement:
        raise UserError(f"unknown {flag} {text!r}: use cuda:N, cpu or disk")
    raise UserError(f"unknown {flag} {text!r}: use cpu, cuda or cuda:N (e.g. cuda:1)")


def device_name(text) -> str:
    """The canonical name of a device string or accelerate key: ``cuda:0``, ``cpu``, ``disk``."""
    return str(parse_device(text, placement=True))


def device_kind(text) -> str:
    """``cpu`` for the CPU path, ``cuda`` for anything that runs on a GPU."""
    return "cpu" if str(text).strip().lower().startswith("cpu") else "cuda"


def count(value, flag: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number of tokens, rows, layers... from the command line or a library call."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise UserError(f"{flag} must be a whole number, got {value!r}")
    if value < minimum:
        raise UserError(f"{flag} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise UserError(f"{flag} {value:,} is beyond anything vramcal can plan for (at most {maximum:,})")
    return value


def positive_number(value, flag: str, example: str) -> float:
    """A finite positive real (``--params-b``, ``--bits``); nan and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UserError(f"{flag} must be a finite positive number, e.g. {flag} {example}; got {value!r}")
    return float(value)


_IMAGE_SIZE = re.compile(r"\s*([0-9]+)\s*[xX×]\s*([0-9]+)\s*")


def parse_image_size(text) -> tuple[int, int]:
    """``1024x768`` -> (1024, 768): width x height in pixels, each 1 to 32768. One-line UserError else."""
    if isinstance(text, (tuple, list)) and len(text) == 2:
        w, h = text
    else:
        m = _IMAGE_SIZE.fullmatch(str(text))
        if m is None:
            raise UserError(f"--image-size {text!r} does not parse: give WIDTHxHEIGHT in pixels, e.g. "
                            "--image-size 1024x768")
        w, h = int(m.group(1)), int(m.group(2))
    for value, what in ((w, "width"), (h, "height")):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_IMAGE_SIDE:
            raise UserError(f"--image-size {text!r}: the {what} must be a whole number of pixels from 1 to "
                            f"{MAX_IMAGE_SIDE:,}, e.g. --image-size 1024x768")
    return w, h


@dataclass(frozen=True)
class Workload:
    """What runs: ``batch`` rows of a ``prompt``-token prompt, then ``new_tokens`` generated tokens.

    ``images`` images of ``image_size`` (width, height; None: the model's processor's default size) go
    into every row's prompt. Their tokens depend on the model (:mod:`vramcal.estimator.vision`) and are
    added to ``prompt``: ``ctx`` counts the text only, an estimate reports the image tokens and the
    context they make."""

    prompt: int
    new_tokens: int = NEW_TOKENS
    batch: int = 1
    images: int = 0
    image_size: tuple[int, int] | None = None

    @property
    def ctx(self) -> int:
        return self.prompt + self.new_tokens

    @property
    def end_positions(self) -> int:
        """Positions a dynamic cache holds at the end: the last generated token is never fed back."""
        return self.prompt + self.new_tokens - 1

    @property
    def tokens(self) -> int:
        """ctx x batch: what per-token corrections scale with."""
        return self.ctx * self.batch

    def args(self) -> list[str]:
        """The flags that reproduce this workload (``--ctx`` as the whole context)."""
        out = ["--ctx", str(self.ctx), "--batch", str(self.batch)]
        if self.new_tokens != NEW_TOKENS:
            out += ["--new-tokens", str(self.new_tokens)]
        if self.images:
            out += ["--images", str(self.images)]
            if self.image_size is not None:
                out += ["--image-size", f"{self.image_size[0]}x{self.image_size[1]}"]
        return out


def images_of(images=0, image_size=None) -> tuple[int, tuple[int, int] | None]:
    """``--images N`` and ``--image-size WxH``, validated: (count, (width, height) or None)."""
    images = count(0 if images is None else images, "--images", 0, MAX_IMAGES)
    if image_size is None:
        return images, None
    size = parse_image_size(image_size)
    if not images:
        raise UserError("--image-size needs --images N (how many images of that size each prompt holds)")
    return images, size


def workload(ctx=None, batch=1, new_tokens=NEW_TOKENS, prompt=None, images=0, image_size=None) -> Workload:
    """Validate and build a :class:`Workload` from ``ctx`` (prompt + new) or ``prompt``, and the images
    each prompt holds."""
    images, image_size = images_of(images, image_size)
    new_tokens = count(new_tokens, "--new-tokens", 1, MAX_TOKENS)
    batch = count(batch, "--batch", 1, MAX_BATCH)
    if prompt is not None and ctx is not None:
        raise UserError("give --ctx (prompt + new tokens) or --prompt, not both")
    if prompt is None:
        ctx = DEFAULT_CTX if ctx is None else ctx
        if isinstance(ctx, int) and not isinstance(ctx, bool) and 0 < ctx <= new_tokens:
            raise UserError(f"--ctx {ctx} leaves no prompt: it counts the prompt and the {new_tokens} new tokens, "
                            f"so it must be above {new_tokens} (or give --prompt)")
        ctx = count(ctx, "--ctx", new_tokens + 1, MAX_TOKENS)
        prompt = ctx - new_tokens
    prompt = count(prompt, "--prompt", 1, MAX_TOKENS)
    if prompt + new_tokens > MAX_TOKENS:
        raise UserError(f"prompt + new tokens = {prompt + new_tokens:,} is beyond {MAX_TOKENS:,} positions")
    return Workload(prompt=prompt, new_tokens=new_tokens, batch=batch, images=images, image_size=image_size)


@dataclass(frozen=True)
class Configuration:
    """One run as a user would type it: the model, its quantization, the workload and the device. Its
    :meth:`command` is the ``vramcal`` command line that runs it again; every value goes through the
    spellings the parser accepts (a test feeds every proposal and memo command back through it)."""

    model: str
    work: Workload
    quant: str = "auto"
    device: str = "cuda:0"
    dtype: str | None = None
    kv_dtype: str = "auto"
    attn: str = "auto"
    cache: str = "dynamic"
    synthetic: bool = False
    max_memory: dict[str, int] | str | None = None  # placement: {"cuda:0": bytes, "cpu": bytes} or its text
    device_map: str | None = None  # auto | balanced | balanced_low_0 | sequential

    def command(self, verb: str, extra: list[str] | None = None) -> str:
        parts = ["vramcal", verb, self.model, "--quant", parse_quant(self.quant), *self.work.args(),
                 "--device", str(parse_device(self.device))]
        if self.dtype is not None:
            parts += ["--dtype", DTYPE_SHORT[parse_dtype(self.dtype)]]
        if self.kv_dtype != "auto":
            parts += ["--kv-dtype", choice(self.kv_dtype, KV_DTYPES, "--kv-dtype")]
        if self.attn != "auto":
            parts += ["--attn", choice(self.attn, ATTNS, "--attn")]
        if self.cache != "dynamic":
            parts += ["--cache", choice(self.cache, CACHES, "--cache")]
        if self.synthetic:
            parts.append("--synthetic")
        if self.max_memory is not None:
            parts += ["--max-memory", max_memory_text(self.max_memory)]
        if self.device_map is not None:
            parts += ["--device-map", self.device_map]
        return shlex.join(parts + list(extra or []))


def size_text(n: int) -> str:
    """Exact bytes in the largest binary unit that divides them: ``24GiB``, ``1536MiB``, ``1000``."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(int(n))


def max_memory_text(max_memory: dict[str, int] | str) -> str:
    """``--max-memory`` as the parser reads it back, to the byte."""
    if isinstance(max_memory, str):
        return max_memory.replace(" ", "")
    return ",".join(f"{dev}={size_text(int(b))}" for dev, b in max_memory.items())
