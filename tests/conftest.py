"""Tiny real checkpoints, built from configs and saved with random weights (no download anywhere).

Each is saved once per session and then loaded for real through ``from_pretrained``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY = {
    # dense, grouped-query attention, untied lm_head (widths are multiples of 64: bitsandbytes repacks
    # 4-bit weights for its CPU kernel at the first forward and needs out % 32 == 0, in % 64 == 0)
    "dense-gqa": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000,
                  "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "tie_word_embeddings": False, "dtype": "bfloat16"},
    # tied input embeddings and lm_head
    "tied": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1200, "hidden_size": 128,
             "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "tie_word_embeddings": True, "dtype": "bfloat16"},
    # sliding-window layers interleaved with full attention (Gemma 3 pattern), window far below ctx
    "sliding": {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 1000,
                "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 24,
                "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                "query_pre_attn_scalar": 32, "dtype": "bfloat16"},
    # mixture of experts (fused 3-D expert weights in transformers 5)
    "moe": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2, "dtype": "bfloat16"},
    # multi-head latent attention (DeepSeek-V2): compressed KV
    "mla": {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 1000,
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": None,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "dtype": "bfloat16"},
}


def save_tiny(name: str, cfg_dict: dict, root) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = root / name
    cfg = AutoConfig.for_model(cfg_dict["model_type"], **{k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: save_tiny(name, cfg, root) for name, cfg in TINY.items()}


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict[str, str]:
    """Tiny vision-language checkpoints of each family (tests/vlm_models.py)."""
    from vlm_models import TINY_VLM, save_tiny_vlm

    root = tmp_path_factory.mktemp("tiny-vlm")
    return {name: save_tiny_vlm(name, root) for name in TINY_VLM}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Each test gets its own inventory cache directory, so no test reads another's results."""
    monkeypatch.setenv("VRAMCAL_CACHE", str(tmp_path / "cache"))
    # and its own records and journals: nothing lands in the home folder, and parallel workers (-n auto)
    # never share a default database
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))



@pytest.fixture
def fake():
    """Install a scripted fake at the one NVML door (tests/fake_nvml.py); the real door again after."""
    from fake_nvml import FakeNVML

    from vramcal.probes import nvml

    def install(*args, **kwargs):
        f = FakeNVML(*args, **kwargs)
        nvml.use_backend(f)
        return f

    yield install
    nvml.use_backend(None)


def pytest_collection_modifyitems(config, items):
    """Cheap tests first: everything marked ``slow`` (full widths, load and fault tests, killed runs) runs
    after the rest, so a failure in the quick part shows early."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
