"""The installed transformers' own model for a config, on the ``meta`` device, with the installed
quantizer's module replacement applied: what the inventory counts, the dry run runs and placement
maps. Nothing here allocates memory for weights.
"""

from __future__ import annotations

import contextlib

from ..errors import UserError
from ..interrupts import sigint_noted
from .formats import REPLACED_ON_META, format_for
from .quant import QuantSpec
from .resolve import ModelSource


class UnknownArchitecture(Exception):
    """The installed transformers cannot build this config's architecture (the formula path takes over)."""


def clean_config(config: dict) -> dict:
    """A deep copy without vramcal's own keys: transformers' config classes edit nested dicts in place
    (``rope_scaling``), and the caller's config must stay as read, or its hash would change."""
    import copy

    return copy.deepcopy({k: v for k, v in config.items() if not k.startswith("_vramcal")})


def import_bitsandbytes():
    """Import bitsandbytes without compiling its kernels.

    bitsandbytes wraps several CPU kernels in ``torch.compile`` at import time, which loads dynamo and
    inductor: about 1.9 s on two cores, more than the whole meta inventory of a 70B model. The
    estimator never runs those kernels, so the first import here swaps ``torch.compile`` for the
    identity; the kernels behave the same, uncompiled, if this process later runs them. A process that
    imported bitsandbytes earlier keeps its compiled kernels."""
    import sys

    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    import torch

    real_compile = torch.compile

    def identity(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    torch.compile = identity
    try:
        import bitsandbytes
    finally:
        torch.compile = real_compile
    return bitsandbytes


_META_MODELS: dict[tuple, tuple] = {}  # the last few meta models built in this process


def build_meta_model(source: ModelSource, quant: QuantSpec, attn: str | None = None, device=None, *,
                     device_map=None, bnb_extra: dict | None = None):
    """The installed transformers' model for ``source``, on ``meta`` (or under ``device``, e.g. a fake
    mode), with the quantizer's module replacement applied. Returns ``(model, hf_quantizer, dtype)``.

    ``device_map`` is what ``from_pretrained`` hands the quantizer's ``preprocess_model`` (a custom map
    changes which modules bitsandbytes converts); ``bnb_extra`` adds ``BitsAndBytesConfig`` arguments
    (``llm_int8_enable_fp32_cpu_offload``).

    A meta model holds no memory, so the plain one the inventory counted is kept and handed to the dry
    run of the same model, quantization and attention (building it is most of an inventory's cost)."""
    plain = device is None and device_map is None and not bnb_extra
    key = (source.config_hash, quant.key(), attn)
    if plain and key in _META_MODELS:
        return _META_MODELS[key]
    with sigint_noted():  # a Ctrl-C that tore an import apart ends the build as the interrupt it was
        out = _build_meta_model(source, quant, attn, device, device_map, bnb_extra)
    if plain:
        while len(_META_MODELS) >= 4:
            _META_MODELS.pop(next(iter(_META_MODELS)))
        _META_MODELS[key] = out
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def _known_model_types() -> set[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return set(CONFIG_MAPPING_NAMES)


# The auto classes that build a generating model, in the order tried when a checkpoint names no class
# they know: the text-and-image one first for a config with a vision part, else the causal LM one.
# (AutoModelForVision2Seq, its older name, is gone from transformers 5.)
GENERATING_AUTO_CLASSES = ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModelForMultimodalLM",
                           "AutoModelForVision2Seq")


def auto_class_for(cfg, architectures=None):
    """The auto class that builds the model class the checkpoint names (``architectures[0]``), as
    ``from_pretrained`` of that class would: a Mllama checkpoint names MllamaForConditionalGeneration,
    which AutoModelForCausalLM would silently swap for the text-only MllamaForCausalLM. Without a name
    any auto class knows, the first that knows the config (see :data:`GENERATING_AUTO_CLASSES`); with
    none, AutoModelForCausalLM, whose error then says so."""
    import transformers

    autos = [getattr(transformers, n) for n in GENERATING_AUTO_CLASSES if hasattr(transformers, n)]
    known = [a for a in autos if type(cfg) in a._model_mapping]
    named = (architectures or [None])[0] if isinstance(architectures, (list, tuple)) else None
    for auto in known:
        if getattr(auto._model_mapping[type(cfg)], "__name__", None) == named:
            return auto
    if not known:
        return transformers.AutoModelForCausalLM
    if getattr(cfg, "vision_config", None) is None:
        known.sort(key=lambda a: a is not transformers.AutoModelForCausalLM)
    return known[0]


def declared_model_type(raw: dict) -> str | None:
    """For a config transformers does not know by its ``model_type`` (remote code: Kimi-K2's ``kimi_k2``),
    the model type of the class its ``architectures`` names, where transformers has that class (Kimi-K2
    declares DeepseekV3ForCausalLM); None otherwise, or when the model type is known."""
    model_type = raw.get("model_type")
    named = (raw.get("architectures") or [None])[0]
    if not isinstance(named, str) or model_type in _known_model_types():
        return None
    from transformers.models.auto import modeling_auto

    types = sorted({t for attr in dir(modeling_auto) if attr.startswith("MODEL_") and attr.endswith("_MAPPING_NAMES")
                    for t, cls in getattr(modeling_auto, attr).items() if cls == named})
    if not types:
        return None
    prefix = named.lower()
    # the model type the class is named after (deepseek_v3 for DeepseekV3ForCausalLM, not a model reusing it)
    return next((t for t in types if prefix.startswith(t.replace("_", "").replace("-", ""))), types[0])


def build_config(source: ModelSource, raw: dict | None = None):
    """The config object transformers makes of ``source.config`` (every field it leaves out filled with
    the config class's default, as ``from_pretrained`` fills it). UnknownArchitecture when the
    installed transformers does not know the model type; a one-line UserError when it rejects the config."""
    from transformers import AutoConfig

    raw = clean_config(source.config) if raw is None else raw
    model_type = raw.get("model_type")
    declared = declared_model_type(raw)
    if declared is not None:  # remote code whose declared class transformers has: price that architecture
        raw = {**raw, "model_type": declared}
        model_type = declared
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (ValueError, KeyError) as exc:
        if model_type in _known_model_types():  # a known architecture whose config transformers rejects
            raise UserError(f"{source.name}: transformers rejects this {model_type} config "
                            f"({_first_line(exc)}): fix the config.json") from None
        raise UnknownArchitecture(f"model_type {model_type!r} is not one this transformers knows") from None
    except ImportError:
        raise  # a library the model needs is missing: the inventory falls back to its formula and says why
    except Exception as exc:  # noqa: BLE001 -- a field of the wrong kind (rope_scaling: "yes", a list for an
        # object): whatever transformers raises about a user's config is about the config, not a bug here
        raise UserError(f"{source.name}: transformers rejects this config ({type(exc).__name__}: "
                        f"{_first_line(exc)}): fix the config.json") from None


def _build_meta_model(source: ModelSource, quant: QuantSpec, attn: str | None, device, device_map, bnb_extra):
    import torch

    raw = clean_config(source.config)
    if (quant.method in ("bnb4", "bnb8") and not quant.pre_quantized) or quant.method in ("none", "dequantized"):
        raw.pop("quantization_config", None)  # a dequantized load builds the plain model in the load dtype
    elif quant.pre_quantized and quant.method not in ("bnb4", "bnb8"):
        # a config transformers would refuse for its quantization_config is one line, not a traceback
        raw.pop("quantization_config", None)
    cfg = build_config(source, raw)
    dtype = getattr(torch, quant.dtype)
    hf_quantizer = None
    fmt = None
    if quant.pre_quantized and quant.method in REPLACED_ON_META:
        fmt = format_for(quant.extra["quantization_config"])
        from transformers.quantizers.auto import AutoHfQuantizer

        hf_quantizer = AutoHfQuantizer.from_config(fmt.quantization_config(quant.extra["quantization_config"], True),
                                                   pre_quantized=True)
        fmt.prepare(hf_quantizer, quant.extra.get("capability"))
    if quant.method in ("bnb4", "bnb8"):
        import_bitsandbytes()
        from transformers import BitsAndBytesConfig
        from transformers.quantizers.auto import AutoHfQuantizer

        kwargs = {**quant.bnb_config_kwargs(), **(bnb_extra or {})}
        if "bnb_4bit_compute_dtype" in kwargs:
            kwargs["bnb_4bit_compute_dtype"] = dtype
        hf_quantizer = AutoHfQuantizer.from_config(BitsAndBytesConfig(**kwargs), pre_quantized=quant.pre_quantized)
        dtype = hf_quantizer.update_dtype(dtype)
    ctx = device if device is not None else torch.device("meta")
    auto = auto_class_for(cfg, raw.get("architectures"))
    try:
        with ctx:
            model = auto.from_config(cfg, dtype=dtype, **({"attn_implementation": attn} if attn else {}))
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc) or "not supported" in str(exc).lower():
            raise UnknownArchitecture(str(exc).splitlines()[0]) from None
        raise UserError(f"{source.name}: transformers cannot build this {raw.get('model_type')} config "
                        f"({_first_line(exc)}): fix the config.json") from None
    except ImportError:
        raise  # a library the model needs is missing: the inventory falls back to its formula and says why
    except Exception as exc:  # noqa: BLE001 -- building the model out of the user's config failed in transformers
        # (an assertion in a module's constructor, Mllama's pad_token_id beyond the vocabulary, ...)
        raise UserError(f"{source.name}: transformers cannot build this {raw.get('model_type')} config "
                        f"({type(exc).__name__}: {_first_line(exc)}): fix the config.json") from None
    if hf_quantizer is not None:
        # from_pretrained runs the module replacement inside ``local_torch_dtype``: the new Linear layers
        # create their bias in the load dtype, not float32 (device maps size them so)
        before = torch.get_default_dtype()
        try:
            if dtype.is_floating_point:
                torch.set_default_dtype(dtype)
            with contextlib.ExitStack() as stack:
                for patch in (fmt.replacement_patches() if fmt is not None else ()):
                    stack.enter_context(patch)
                stack.enter_context(torch.device("meta"))
                # use_kernels=True keeps MXFP4's CPU branch from switching to its dequantized load: the GPU
                # decided the path already (formats.Format.path)
                hf_quantizer.preprocess_model(model=model, dtype=dtype, device_map=device_map, checkpoint_files=None,
                                              use_kernels=fmt is not None)
        except (ImportError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
            if fmt is None:
                raise
            raise UserError(f"{source.name}: transformers' {fmt.label} quantizer cannot convert this model "
                            f"({type(exc).__name__}: {_first_line(exc)}): the format or its library is not "
                            "supported for this architecture here") from None
        finally:
            torch.set_default_dtype(before)
    return model, hf_quantizer, dtype
