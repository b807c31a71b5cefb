"""Find a model's config from what the user typed: a directory, a config.json, a Hub id in the local
Hugging Face cache, a name from the built-in catalog, or else a Hub id whose config and weight headers
are read from the Hub without downloading the weights (:mod:`vramcal.estimator.hub`, docs/hub.md).

``vramcal estimate`` and ``vramcal probe`` both resolve MODEL here, so they agree on what it means.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..errors import UserError
from .quant import DTYPE_BYTES


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user typed, or the catalog name
    origin: str  # directory | config | hf-cache | hub | catalog
    config: dict = field(hash=False)
    directory: str | None = None  # holds config.json and maybe weights
    weight_files: tuple[str, ...] = ()  # *.safetensors beside the config
    # the checkpoint's image processor settings: {"preprocessor_config.json": {...}, "processor_config.json":
    # {...}}, each present only where the file is (vision-language models; vramcal.estimator.vision)
    processor: dict = field(default_factory=dict, hash=False, compare=False)
    # the commit a Hub model's files come from (hf-cache: the snapshot's; hub: the one fetched), else None
    revision: str | None = None
    # a Hub model read without its weights: each safetensors file's header, {file name: {tensor: (dtype,
    # shape)}} (vramcal.estimator.checkpoint.source_tensors reads these or weight_files, never both)
    weight_headers: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def config_hash(self) -> str:
        return config_hash(self.config)

    @property
    def ref(self) -> str:
        """How a recorded command names this model so it resolves the same from any directory."""
        return os.path.abspath(self.name) if self.origin in ("directory", "config") else self.name


def config_hash(config: dict) -> str:
    """A stable hash of the architecture: the config minus keys that do not change memory."""
    ignore = {"_name_or_path", "_vramcal_catalog", "transformers_version", "architectures_note"}
    canon = json.dumps({k: v for k, v in config.items() if k not in ignore}, sort_keys=True, default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def catalog_names() -> list[str]:
    files = resources.files("vramcal.estimator").joinpath("catalog")
    return sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))


def catalog_entry(name: str) -> dict:
    path = resources.files("vramcal.estimator").joinpath("catalog").joinpath(f"{name}.json")
    return json.loads(path.read_text())


MAX_CONFIG_BYTES = 16 * 1024**2  # the largest published config.json is a few hundred KB


def hf_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The local snapshot folder of a Hub model, or None: ``revision``'s when given, else ``refs/main``'s
    revision when it has a config.json, else the newest snapshot that has one. huggingface_hub finds the
    files; a snapshot that resolves outside its repository's cache folder (a crafted ref or link) is
    refused."""
    from huggingface_hub import constants, try_to_load_from_cache

    repo = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    candidates = [Path(found).parent] if isinstance(found, str) else []
    snapshots = repo / "snapshots"
    if not candidates and revision is None and snapshots.is_dir():
        revisions = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime,
                           reverse=True)
        for rev in revisions:
            path = try_to_load_from_cache(repo_id, "config.json", revision=rev.name)
            if isinstance(path, str):
                candidates.append(Path(path).parent)
                break
    for snap in candidates:
        # the folder and each file in it (the Hub links them to ../../blobs/<hash>, inside the repository)
        for path in (snap, *snap.iterdir()):
            try:
                real = path.resolve(strict=True)
            except (OSError, RuntimeError) as exc:  # a loop, a dangling link: refused where it is read
                if not path.name.endswith((".json", ".safetensors")):
                    continue
                raise UserError(f"{repo_id}: its cached snapshot has {path.name!r}, a link that leads nowhere "
                                f"({type(exc).__name__}): remove {repo} and download again") from None
            if not real.is_relative_to(repo.resolve()):
                raise UserError(f"{repo_id}: its cached snapshot {path} leads outside the Hugging Face cache "
                                f"({real}): the cache folder was altered; remove {repo} and download again")
        return snap
    return None


def _read_config(path: Path) -> dict:
    """A config.json, read only if it is a regular file of a sane size (a FIFO would block, a device
    never end)."""
    data = _read_json(path)
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{path} has no model_type: it is not a transformers config.json")
    return data


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def _read_processor(folder: Path | None) -> dict:
    """The image processor files beside a config, each read like the config (a regular file of a sane
    size, valid JSON, an object); absent files are left out."""
    out = {}
    for name in PROCESSOR_FILES if folder is not None else ():
        path = folder / name
        if not os.path.lexists(path):
            continue
        data = _read_json(path)
        if not isinstance(data, dict):
            raise UserError(f"{path} is not a JSON object: fix or re-download it")
        out[name] = data
    return out


def _read_json(path: Path):
    """A JSON file of a model's folder, read only if it is a regular file of a sane size (a FIFO would
    block, a device never end)."""
    from ..files import read_regular

    raw = read_regular(path, MAX_CONFIG_BYTES, path.name,
                       missing="pass a directory holding config.json, a config.json path, a cached Hub id, or a "
                               "name from `vramcal models`")
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UserError(f"{path} is not valid JSON ({str(exc).splitlines()[0][:120]}): fix or re-download it") from None


# Fields that decide a model's size. A config may leave any of them to transformers' defaults (as
# from_pretrained does; the estimate names each default it used); the formula path, for an architecture
# the installed transformers does not know, needs the first four. A field that is given must be a
# sensible number.
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
SIZE_FIELDS = REQUIRED_FIELDS + (
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "max_position_embeddings",
    "num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "sliding_window",
    "first_k_dense_replace")
MAX_FIELD = 1 << 24  # no real model has a width, depth or vocabulary beyond 16.7 M


# What some architectures call the same fields (transformers maps them with each config's attribute_map:
# GPT-2 / GPT-BigCode / GPT-J say n_embd, n_layer, n_head; MPT d_model, n_layers, n_heads; ...)
FIELD_ALIASES = {"hidden_size": ("n_embd", "d_model", "model_dim", "dim"),
                 "num_hidden_layers": ("n_layer", "num_layers", "n_layers"),
                 "num_attention_heads": ("n_head", "num_heads", "n_heads"),
                 "vocab_size": ("padded_vocab_size",),
                 "max_position_embeddings": ("n_positions", "max_seq_len", "seq_length"),
                 "num_key_value_heads": ("num_kv_heads", "n_kv_heads", "multi_query_group_num")}


def size_field(tc: dict, key: str):
    """A size field under its own name or one of its architecture-specific aliases."""
    if tc.get(key) is not None:
        return tc[key]
    for alias in FIELD_ALIASES.get(key, ()):
        if tc.get(alias) is not None:
            return tc[alias]
    return None


def validate_config(config: dict, where: str) -> None:
    """Refuse, in one line, a config whose size-deciding fields are of the wrong type or impossible
    (negative, zero, nan, a string, absurdly large, heads that do not divide). Fields it leaves out are
    the installed transformers' to fill (:mod:`vramcal.estimator.meta`); only an architecture it does
    not know needs them given (:func:`missing_fields`)."""
    tc = text_config(config)
    for key in SIZE_FIELDS:
        value = size_field(tc, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: {key} must be a whole number, got {value!r}: fix the config.json")
        floor = 0 if key in ("n_shared_experts", "first_k_dense_replace") else 1
        if not floor <= value <= MAX_FIELD:
            raise UserError(f"{where}: {key} = {value} is impossible (expected {floor} to {MAX_FIELD:,}): "
                            "fix the config.json")
    for key in ("torch_dtype", "dtype"):
        value = tc.get(key)
        if value is not None and (not isinstance(value, str) or value.removeprefix("torch.") not in DTYPE_BYTES):
            raise UserError(f"{where}: {key} = {value!r} is not a dtype (bfloat16, float16, float32 ...): "
                            "fix the config.json")
    qc = config.get("quantization_config")
    if qc is not None and (not isinstance(qc, dict) or not isinstance(qc.get("quant_method", ""), str)):
        raise UserError(f"{where}: quantization_config must be an object with a quant_method, got {qc!r:.60}: "
                        "fix the config.json")
    heads = size_field(tc, "num_attention_heads")
    kv = size_field(tc, "num_key_value_heads") or heads
    if heads is not None and heads % kv:
        raise UserError(f"{where}: num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv}): "
                        "fix the config.json")
    hidden = size_field(tc, "hidden_size")
    if tc.get("head_dim") is None and tc.get("kv_lora_rank") is None and None not in (heads, hidden) and hidden % heads:
        raise UserError(f"{where}: hidden_size ({hidden}) is not divisible by num_attention_heads "
                        f"({heads}) and no head_dim is given: fix the config.json")


def missing_fields(config: dict) -> list[str]:
    """The fields the formula path needs that ``config`` does not give (its text part's)."""
    tc = text_config(config)
    return [k for k in REQUIRED_FIELDS if size_field(tc, k) is None]


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def resolve_model(spec: str, hub=None) -> ModelSource:
    """Resolve MODEL. Order: existing path, catalog name, Hub id in the local Hugging Face cache, then
    the same id's metadata from vramcal's cache or the Hub (``hub``: a
    :class:`~vramcal.estimator.hub.HubOptions`: revision, offline, progress). The config is validated
    (:func:`validate_config`) before anything uses it."""
    source = _resolve(spec, hub)
    validate_config(source.config, source.name)
    return source


def _resolve(spec, hub=None) -> ModelSource:
    if not isinstance(spec, str) or not spec:
        raise UserError("no model given: pass a directory, a config.json, a cached Hub id or a catalog name")
    path = Path(spec).expanduser()
    try:
        exists = path.exists()
    except (OSError, ValueError):  # a name too long, or with a NUL byte
        exists = False
    if exists:
        if path.is_dir():
            cfg = _read_config(path / "config.json")
            weights = tuple(sorted(str(p) for p in path.glob("*.safetensors")))
            return ModelSource(name=str(path), origin="directory", config=cfg, directory=str(path), weight_files=weights,
                               processor=_read_processor(path))
        cfg = _read_config(path)
        return ModelSource(name=str(path), origin="config", config=cfg, directory=str(path.parent),
                           weight_files=tuple(sorted(str(p) for p in path.parent.glob("*.safetensors"))),
                           processor=_read_processor(path.parent))
    if spec in catalog_names():
        cfg = catalog_entry(spec)
        processor = (cfg.get("_vramcal_catalog") or {}).get("processor") or {}
        return ModelSource(name=spec, origin="catalog", config=cfg, processor=processor)
    from .hub import HubOptions, check_repo_id, hub_metadata, looks_like_hub_id

    if looks_like_hub_id(spec):
        hub = hub or HubOptions()
        check_repo_id(spec)
        snap = hf_snapshot(spec, hub.revision)
        if snap is not None:
            return ModelSource(name=spec, origin="hf-cache", config=_read_config(snap / "config.json"),
                               directory=str(snap), weight_files=tuple(sorted(str(p) for p in snap.glob("*.safetensors"))),
                               processor=_read_processor(snap), revision=snap.name)
        meta = hub_metadata(spec, hub)
        config = meta.files["config.json"]
        if "model_type" not in config:
            raise UserError(f"{spec}'s config.json (commit {meta.commit[:12]}) has no model_type: it is not a "
                            "transformers config.json")
        return ModelSource(name=spec, origin="hub", config=config, revision=meta.commit,
                           processor={k: meta.files[k] for k in PROCESSOR_FILES if k in meta.files},
                           weight_headers=meta.headers)
    if any(not ch.isascii() or not ch.isprintable() for ch in spec):
        raise UserError(f"model {spec!r} not found: no such path, not in the catalog, and not a Hub id (OWNER/NAME in "
                        "ASCII letters, digits, '-', '_' and '.'); `vramcal models` lists the catalog")
    raise UserError(f"model {spec!r} not found: no such path and not in the catalog; `vramcal models` lists the catalog")


def text_config(config: dict) -> dict:
    """The language-model part of a config (multimodal configs nest it under ``text_config``)."""
    tc = config.get("text_config")
    return {**config, **tc} if isinstance(tc, dict) else config
