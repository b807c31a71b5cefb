"""Random weights at a model's real widths, written as a safetensors checkpoint.

``--synthetic`` probes a model before downloading it: the config's architecture, random values, the
same ``from_pretrained`` path as a real checkpoint. Where this can differ from the real checkpoint:
its stored dtype is the config's (a real one may be stored in another dtype and converted at load),
a pre-quantized config is refused (:func:`refuse_pre_quantized`: the random weights are 16-bit),
tied embeddings are stored once (as published tied checkpoints are), and values differ, which moves
only data-dependent parts (MoE routing, LLM.int8 outlier columns), not the tensors' sizes.
"""

from __future__ import annotations

import json
import sys


def checkpoint_bytes(source, spec) -> int:
    """Bytes of the checkpoint :func:`write_checkpoint` writes for ``source``: every parameter once, at
    the config's dtype (the inventory's count, made on the meta device and cached for the estimate)."""
    from ..estimator.inventory import inventory
    from ..estimator.meta import clean_config
    from ..estimator.quant import DTYPE_BYTES, config_dtype

    return inventory(source, spec).params * DTYPE_BYTES[config_dtype(clean_config(source.config))]


def refuse_pre_quantized(source, spec) -> None:
    """A pre-quantized checkpoint (fp8, MXFP4, compressed-tensors, GPTQ, AWQ, serialized bitsandbytes) is
    refused in one line: the random checkpoint is written in 16 bits without the config's
    quantization_config, so the load would hold a plain model while the estimate prices the stored format
    (kept) or its dequantizing load (which reads the stored layout). The probe would measure another model."""
    if not spec.pre_quantized:
        return
    from ..errors import UserError
    from ..estimator.formats import format_for

    label = format_for(source.config.get("quantization_config") or {}).label
    raise UserError(f"--synthetic writes plain 16-bit random weights, not this checkpoint's {label} layout, so the "
                    f"probe would measure another model than the one {source.name} loads; nothing was run or "
                    "recorded: download its weights and probe them, or probe the unquantized base model's config "
                    "with --synthetic")


def check_room(source, spec, folder: str | None = None) -> int:
    """Refuse, before a run is recorded, random weights that cannot be written: the checkpoint is held
    whole in memory and then saved under the temporary folder, so it needs that much available RAM and
    that much free disk there. Returns the checkpoint's bytes; a one-line UserError otherwise."""
    import shutil
    import tempfile

    import psutil

    from ..errors import UserError
    from ..units import fmt_gib_gb

    need = checkpoint_bytes(source, spec)
    folder = folder or tempfile.gettempdir()
    try:
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise UserError(f"--synthetic: cannot use the temporary folder {folder} ({exc.strerror or exc}): "
                        "set TMPDIR to a writable folder") from None
    ram = psutil.virtual_memory().available
    for what, room, fix in ((f"free in {folder}", free, "free space there or set TMPDIR to a larger disk"),
                            ("of available RAM (it is made in memory first)", ram, "probe a smaller model")):
        if need > room:
            raise UserError(f"--synthetic: the random checkpoint of {source.name} is {fmt_gib_gb(need)}, more than "
                            f"the {fmt_gib_gb(room)} {what}; nothing was run or recorded: {fix}")
    return need


def write_checkpoint(config: dict, out_dir: str, seed: int = 0) -> str:
    import torch
    from transformers import AutoConfig

    from ..estimator.meta import auto_class_for, clean_config
    from ..estimator.quant import config_dtype

    raw = clean_config(config)
    raw.pop("quantization_config", None)
    dtype = getattr(torch, config_dtype(raw))
    cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):  # the class the checkpoint names (a VLM with its vision tower)
        model = auto_class_for(cfg, raw.get("architectures")).from_config(cfg, dtype=dtype)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.zero_()
    model.tie_weights()
    model.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> int:
    """``python -m vramcal.probes.synthetic CONFIG_JSON OUT_DIR``: run in its own process, so the
    memory used to make the weights is returned to the system before the probe measures anything."""
    config = json.loads(open(argv[0]).read())
    write_checkpoint(config, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
