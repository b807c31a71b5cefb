"""llama.cpp's startup log read back: the buffer lines it prints loading a model and creating a context
(llama-model.cpp, llama-kv-cache.cpp, llama-context.cpp), in MiB with two decimals, and n_ctx.

    load_tensors:   CPU_Mapped model buffer size =    25.69 MiB
    llama_context:        CPU  output buffer size =     0.12 MiB
    llama_kv_cache:        CPU KV buffer size =     1.12 MiB
    llama_kv_cache: size =    1.12 MiB (  1536 cells,   3 layers,  1/1 seqs), K (f16): ...
    sched_reserve:        CPU compute buffer size =    63.63 MiB
    llama_context: n_ctx         = 1536

Older builds name the functions ``llm_load_tensors`` / ``llama_new_context_with_model`` /
``llama_kv_cache_init``; the patterns key on the words after the function. Several lines for one buffer
name (a split GGUF maps one CPU_Mapped range per file; a SWA model has two KV caches) add up.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...units import MIB

_BUF = r"(?P<name>[A-Za-z_][\w]*)\s+{kind} buffer size\s*=\s*(?P<mib>[\d.]+)\s*MiB"
MODEL = re.compile(_BUF.format(kind="model"))
KV = re.compile(_BUF.format(kind="KV"))
COMPUTE = re.compile(_BUF.format(kind="compute"))
OUTPUT = re.compile(_BUF.format(kind="output"))
KV_SIZE = re.compile(r"size\s*=\s*[\d.]+\s*MiB\s*\(\s*(?P<cells>\d+) cells,\s*(?P<layers>\d+) layers")
N_CTX = re.compile(r"\bn_ctx\s*=\s*(?P<n>\d+)")
N_CTX_SEQ = re.compile(r"\bn_ctx_seq\s*=\s*(?P<n>\d+)")
N_UBATCH = re.compile(r"\bn_ubatch\s*=\s*(?P<n>\d+)")
FLASH = re.compile(r"\bflash_attn\s*=\s*(?P<v>\w+)")
ERROR = re.compile(r"(?:error|failed|exception)[^\n]*", re.IGNORECASE)
HALF_CENT_MIB = MIB // 200  # half of the log's last digit: the rounding every figure carries


def _mib(text: str) -> int:
    return round(float(text) * MIB)


@dataclass
class LlamaLogged:
    model_buffer_bytes: dict[str, int] = field(default_factory=dict)
    kv_buffer_bytes: dict[str, int] = field(default_factory=dict)
    compute_buffer_bytes: dict[str, int] = field(default_factory=dict)
    output_buffer_bytes: int | None = None
    output_buffer: str | None = None
    kv_cells: list[int] = field(default_factory=list)
    kv_layers: list[int] = field(default_factory=list)
    n_ctx: int | None = None
    n_ctx_seq: int | None = None
    n_ubatch: int | None = None
    flash_attn: str | None = None
    lines: int = 0  # how many buffer lines were read (0: this log says nothing about buffers)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _add(d: dict[str, int], name: str, value: int) -> None:
    d[name] = d.get(name, 0) + value


def parse_log(text: str) -> LlamaLogged:
    """Every buffer line of a llama.cpp log, in bytes (each to the log's 0.01 MiB)."""
    out = LlamaLogged()
    for line in text.splitlines():
        for rx, target in ((MODEL, out.model_buffer_bytes), (KV, out.kv_buffer_bytes),
                           (COMPUTE, out.compute_buffer_bytes)):
            m = rx.search(line)
            if m:
                _add(target, m["name"], _mib(m["mib"]))
                out.lines += 1
                break
        else:
            m = OUTPUT.search(line)
            if m:
                out.output_buffer_bytes = (out.output_buffer_bytes or 0) + _mib(m["mib"])
                out.output_buffer = m["name"]
                out.lines += 1
                continue
            m = KV_SIZE.search(line)
            if m and "llama_kv_cache" in line or (m and "kv_cache" in line):
                out.kv_cells.append(int(m["cells"]))
                out.kv_layers.append(int(m["layers"]))
                continue
            for rx, attr in ((N_CTX, "n_ctx"), (N_CTX_SEQ, "n_ctx_seq"), (N_UBATCH, "n_ubatch")):
                m = rx.search(line)
                if m and getattr(out, attr) is None:
                    setattr(out, attr, int(m["n"]))
            m = FLASH.search(line)
            if m and out.flash_attn is None:
                out.flash_attn = m["v"]
    return out
