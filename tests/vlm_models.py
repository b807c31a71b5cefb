"""Tiny vision-language checkpoints of each family vramcal knows the image rule of, saved with random
weights and the preprocessor_config.json their processor reads (no download anywhere).

Widths are multiples of 64 (bitsandbytes' CPU kernel repacks 4-bit weights and needs out % 32 == 0,
in % 64 == 0); images are 56 pixels a side (4 x 4 patches of 14), so a forward takes milliseconds.
"""

from __future__ import annotations

import json

TEXT = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1}
VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "image_size": 56, "patch_size": 14}

TINY_VLM = {
    # SigLIP tower, 4 tokens per image (avg-pooled 2 x 2), one sliding-window layer of 16
    "gemma3": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 4,
               "image_token_index": 300, "boi_token_index": 301, "eoi_token_index": 302,
               "text_config": {"model_type": "gemma3_text", **TEXT, "head_dim": 32, "sliding_window": 16,
                               "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 32},
               "vision_config": {"model_type": "siglip_vision_model", **VISION, "num_attention_heads": 2},
               "dtype": "bfloat16"},
    # window attention in block 0, full attention in block 1, 2 x 2 patch merger
    "qwen2_5_vl": {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                   "image_token_id": 300, "video_token_id": 301, "vision_start_token_id": 302,
                   "vision_end_token_id": 303,
                   "text_config": {"model_type": "qwen2_5_vl_text", **TEXT,
                                   "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
                   "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                                     "out_hidden_size": 64, "fullatt_block_indexes": [1], "window_size": 112,
                                     "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
                   "dtype": "bfloat16"},
    # CLIP tower, second-to-last layer, CLS dropped: 16 tokens per image
    "llava": {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 300,
              "vision_feature_layer": -2, "vision_feature_select_strategy": "default",
              "text_config": {"model_type": "llama", **TEXT},
              "vision_config": {"model_type": "clip_vision_model", **VISION, "num_attention_heads": 2,
                                "projection_dim": 64}, "dtype": "bfloat16"},
    # tiles of 56 (4 tokens each after the 2 x 2 pixel shuffle) and a global image
    "idefics3": {"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"],
                 "image_token_id": 300, "scale_factor": 2, "text_config": {"model_type": "llama", **TEXT},
                 "vision_config": {**VISION, "num_attention_heads": 2}, "dtype": "bfloat16"},
    # 4 tiles of 56 per image, a cross-attention layer between two self-attention layers
    "mllama": {"model_type": "mllama", "architectures": ["MllamaForConditionalGeneration"], "image_token_index": 300,
               "text_config": {"model_type": "mllama_text_model", **TEXT, "num_hidden_layers": 3,
                               "cross_attention_layers": [1], "pad_token_id": 0, "bos_token_id": 1,
                               "eos_token_id": 2},
               "vision_config": {**VISION, "num_global_layers": 1, "attention_heads": 2, "max_num_tiles": 4,
                                 "intermediate_layers_indices": [0, 1], "vision_output_dim": 192},
               "dtype": "bfloat16"},
}

# what each tiny checkpoint's preprocessor_config.json says (sizes scaled to its 56-pixel tower)
PREPROCESSOR = {
    "gemma3": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56}},
    "qwen2_5_vl": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 56 * 56 * 4},
    "llava": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 56},
              "crop_size": {"height": 56, "width": 56}},
    "idefics3": {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 112},
                 "max_image_size": {"longest_edge": 56}},
    "mllama": {"image_processor_type": "MllamaImageProcessor", "size": {"height": 56, "width": 56},
               "max_image_tiles": 4},
}


def save_tiny_vlm(name: str, root) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    cfg_dict = dict(TINY_VLM[name])
    cfg = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16)
    path = root / name
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR[name]))
    return str(path)
