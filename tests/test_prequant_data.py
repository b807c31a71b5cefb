"""The pre-quantized evidence (issue 23): benchmarks/published/prequant.csv and the configs that price it.

Each row's stored size is the sum of its transcribed safetensors inventory and must agree with the
report's exact element total; each config (catalog entry or configs/NAME.json) must load as transformers
reads it, quantization_config included. Catches a mistyped shape, count or field in the transcriptions."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PUB = ROOT / "benchmarks" / "published"
CATALOG = ROOT / "vramcal" / "estimator" / "catalog"
SIZE = {"bf16": 2, "f16": 2, "f32": 4, "f8": 1, "u8": 1, "i32": 4}
ROWS = list(csv.DictReader(open(PUB / "prequant.csv", newline="")))


def _config_path(ref: str) -> Path:
    return PUB / f"{ref}.json" if ref.startswith("configs/") else CATALOG / f"{ref}.json"


def _inventory(path: Path) -> tuple[int, int]:
    elements = nbytes = 0
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            dtype, shape, count = line.split()
            n = math.prod(int(x) for x in shape.split(",")) * int(count)
            elements, nbytes = elements + n, nbytes + n * SIZE[dtype]
    return elements, nbytes


def test_at_least_twelve_rows_and_four_methods():
    assert len(ROWS) >= 12
    assert {r["quant_method"] for r in ROWS} >= {"mxfp4", "fp8", "compressed-tensors", "awq"}


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_stored_size_is_the_inventory_sum(row):
    elements, nbytes = _inventory(PUB / row["inventory"])
    assert elements == int(row["elements_total"]) == int(row["reported_elements"])
    assert nbytes == int(row["tensor_bytes"]) == sum(int(kv.split("=")[1]) for kv in row["bytes_by_dtype"].split(";"))
    assert f"{nbytes / 2**30:.2f}" == row["reported_tensor_gib"]
    cfg = json.loads(_config_path(row["config"]).read_text())
    assert cfg["_vramcal_catalog"]["hub_id"] == row["hub_id"] and "quantization_config" in cfg


def _pre_quantized_configs() -> list[Path]:
    paths = {_config_path(r["config"]) for r in ROWS}
    paths |= {p for p in CATALOG.glob("*.json") if "quantization_config" in json.loads(p.read_text())}
    return sorted(paths)


@pytest.mark.parametrize("path", _pre_quantized_configs(), ids=lambda p: p.stem)
def test_config_loads_with_its_quantization_config(path):
    from transformers import AutoConfig
    from transformers.quantizers.auto import AutoQuantizationConfig

    fields = json.loads(path.read_text())
    meta = fields.pop("_vramcal_catalog")
    assert meta["hub_id"] and meta["note"]
    model_type = fields.pop("model_type")
    if model_type == "kimi_k2":  # remote code; transformers has the architecture it declares
        assert fields["architectures"] == ["DeepseekV3ForCausalLM"]
        model_type = "deepseek_v3"
    cfg = AutoConfig.for_model(model_type, **json.loads(json.dumps(fields)))
    assert cfg.get_text_config().num_hidden_layers > 0
    qc = AutoQuantizationConfig.from_dict(dict(fields["quantization_config"]))
    assert qc.quant_method == fields["quantization_config"]["quant_method"]


def test_published_sizes_agree_with_what_the_estimate_stores():
    """benchmarks/published/prequant_sizes.csv: an NVFP4 checkpoint priced by vLLM's layout, a GPTQ one by
    transformers', each within the precision its size was published with (published_prequant.TOLERANCE)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from published_prequant import sizes_table

    rows = sizes_table()
    assert {r["engine"] for r in rows} == {"vllm", "transformers"} and any("NVFP4" in r["quant_method"] for r in rows)
    for r in rows:
        cfg = json.loads(_config_path(r["config"]).read_text())
        assert cfg["_vramcal_catalog"]["hub_id"] == r["hub_id"] and "quantization_config" in cfg
        assert r["within"], r
