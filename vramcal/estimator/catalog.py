"""The built-in catalog: public configs shipped as package data, so estimates work offline."""

from __future__ import annotations

from .resolve import catalog_entry, catalog_names

# Parameter counts as published for each model (tied weights once); tests check the catalog against them.
# The vision-language entries count the vision tower and projector too (the published checkpoint's total).
PARAMS = {
    "deepseek-v2-lite": 15_706_484_224, "gemma-2-27b": 27_227_128_320, "gemma-2-9b": 9_241_705_984,
    "gemma-3-12b": 12_187_325_040, "gemma-3-27b": 27_432_406_640, "gemma-3-4b": 4_300_079_472,
    "llama-3.1-70b": 70_553_706_496, "llava-1.5-7b": 7_063_427_072, "qwen2.5-vl-7b": 8_292_166_656,
    "smolvlm-256m": 256_484_928,
    "llama-3.1-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "mistral-7b-v0.3": 7_248_023_552, "mixtral-8x7b": 46_702_792_704, "phi-3-mini-4k": 3_821_079_552,
    "phi-4": 14_659_507_200, "qwen2.5-0.5b": 494_032_768, "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352, "qwen2.5-72b": 72_706_203_648, "qwen2.5-7b": 7_615_616_512,
    "qwen3-30b-a3b": 30_532_122_624, "qwen3-32b": 32_762_123_264, "qwen3-8b": 8_190_735_360,
    "qwen3-vl-8b": 8_767_123_696,  # the checkpoint's tensor count (safetensors headers), vision tower included
}


def catalog_rows() -> list[dict]:
    rows = []
    for name in catalog_names():
        cfg = catalog_entry(name)
        meta = cfg.get("_vramcal_catalog", {})
        rows.append({"name": name, "architecture": (cfg.get("architectures") or ["?"])[0],
                     "model_type": cfg.get("model_type"), "hub_id": meta.get("hub_id"),
                     "params_b": PARAMS[name] / 1e9 if name in PARAMS else None})  # None: no published count
    return rows
