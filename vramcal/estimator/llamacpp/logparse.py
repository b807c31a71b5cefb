"""llama.cpp's startup log read back: the buffer lines it prints loading a model and creating a context
(llama-model.cpp, llama-kv-cache.cpp, llama-context.cpp), in MiB with two decimals, n_ctx, and what the
loader printed about the model (its metadata dump, its hyper-parameters, its tensor types).

    load_tensors:   CPU_Mapped model buffer size =    25.69 MiB
    llama_context:        CPU  output buffer size =     0.12 MiB
    llama_kv_cache:        CPU KV buffer size =     1.12 MiB
    llama_kv_cache: size =    1.12 MiB (  1536 cells,   3 layers,  1/1 seqs), K (f16): ...
    llama_memory_recurrent:        CPU RS buffer size =     0.27 MiB
    llama_memory_recurrent: size =    0.27 MiB (     1 cells,   4 layers,  1 seqs  0 rs_seq), R (f32): ...
    sched_reserve:        CPU compute buffer size =    63.63 MiB
    llama_context: n_ctx         = 1536

The wordings of older builds read the same (each seen in a published log,
benchmarks/published/llamacpp/):

- ``llm_load_tensors:      CUDA0 buffer size =  3820.94 MiB`` (before "model" was added, 2024);
- ``llama_kv_cache_init:      CUDA0 KV buffer size`` and ``llama_new_context_with_model: KV self size  =
  1024.00 MiB, K (f16): ...`` (the total of all caches), later ``llama_kv_cache_unified:`` and
  ``llama_kv_cache:``;
- ``llama_new_context_with_model:`` / ``llama_init_from_model:`` / ``llama_context:`` / ``sched_reserve:``
  before the output and compute lines; ``n_ctx_per_seq`` before ``n_ctx_seq``;
- a decimal comma (``636,18 MiB``) where the C locale was not in force; a timestamp or a service's prefix
  (``0.00.348.961 I ``, ``ollama[1073]: ``) before the function name.

Several lines for one buffer name (a split GGUF maps one CPU_Mapped range per file; a SWA model has two KV
caches) add up. A recurrent or hybrid model's state (mamba, rwkv, jamba ...) is an "RS buffer", kept apart from
the KV buffers as llama.cpp allocates it apart (llama-memory-recurrent.cpp); an MLA cache's summary line
prints ``K (f16): ..., V (f16): 0.00 MiB``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ...units import MIB

_NUM = r"[\d]+(?:[.,]\d+)?"
_NAME = r"(?P<name>RPC\[[^\]]*\]|[A-Za-z_][\w]*)"  # a backend's buffer: CUDA0, CPU_Mapped, RPC[host:port] ...
_BUF = _NAME + r"\s+{kind} buffer size\s*=\s*(?P<mib>" + _NUM + r")\s*MiB"
MODEL = re.compile(_BUF.format(kind="model"))
# llm_load_tensors before the word "model" (2024): "llm_load_tensors:        CPU buffer size = ..."
MODEL_OLD = re.compile(r"load_tensors:\s+" + _NAME + r"\s+buffer size\s*=\s*(?P<mib>" + _NUM + r")\s*MiB")
KV = re.compile(_BUF.format(kind="KV"))
RS = re.compile(_BUF.format(kind="RS"))
# "llama_memory_recurrent: size = 0.27 MiB (     1 cells,   4 layers,  1 seqs  0 rs_seq), R (f32): ..."
RS_SIZE = re.compile(r"memory_recurrent:\s+size\s*=\s*(?P<mib>" + _NUM + r")\s*MiB\s*\(\s*(?P<cells>\d+) cells")
COMPUTE = re.compile(_BUF.format(kind="compute"))
OUTPUT = re.compile(_BUF.format(kind="output"))
KV_SIZE = re.compile(r"size\s*=\s*(?P<mib>" + _NUM + r")\s*MiB\s*\(\s*(?P<cells>\d+) cells,\s*(?P<layers>\d+) layers")
KV_SELF = re.compile(r"KV self size\s*=\s*(?P<mib>" + _NUM + r")\s*MiB")
KV_TYPES = re.compile(r"K \((?P<k>\w+)\):\s*" + _NUM + r"\s*MiB,\s*V \((?P<v>\w+)\)")
N_CTX = re.compile(r"\bn_ctx\s*=\s*(?P<n>\d+)")
N_CTX_SEQ = re.compile(r"\bn_ctx_(?:seq|per_seq)\s*=\s*(?P<n>\d+)")
N_BATCH = re.compile(r"\bn_batch\s*=\s*(?P<n>\d+)")
N_UBATCH = re.compile(r"\bn_ubatch\s*=\s*(?P<n>\d+)")
N_SEQ_MAX = re.compile(r"\bn_seq_max\s*=\s*(?P<n>\d+)")
FLASH = re.compile(r"\bflash_attn\s*=\s*(?P<v>\w+)")
BUILD = re.compile(r"\bbuild(?::| =)\s*(?P<v>\d+ \(\w+\))")
# the loader's metadata dump: "llama_model_loader: - kv  15:    qwen3moe.block_count u32    = 48"
META = re.compile(r"llama_model_loader: - kv\s+\d+:\s+(?P<key>\S+)\s+(?P<type>arr\[\w+,\s*\d+\]|\w+)\s+=\s?(?P<v>.*)$")
TENSOR_TYPE = re.compile(r"llama_model_loader: - type\s+(?P<type>\w+):\s+(?P<n>\d+) tensors")
N_TENSORS = re.compile(r"loaded meta data with \d+ key-value pairs and (?P<n>\d+) tensors")
# the hyper-parameters as llama-model.cpp prints them ("print_info: n_layer = 48"; before 2025
# "llm_load_print_meta:")
HPARAM = re.compile(r"(?:print_info|llm_load_print_meta):\s+(?P<key>[a-z_][\w ]*?)\s*=\s*(?P<v>.+?)\s*$")
ERROR = re.compile(r"(?:error|failed|exception)[^\n]*", re.IGNORECASE)
HALF_CENT_MIB = MIB // 200  # half of the log's last digit: the rounding every figure carries


def _mib(text: str) -> int:
    return round(float(text.replace(",", ".")) * MIB)


def _meta_value(kind: str, text: str):
    """A metadata value as the loader prints it; arrays only by their length (the dump cuts them)."""
    m = re.fullmatch(r"arr\[\w+,\s*(\d+)\]", kind)
    if m:
        return ("array", int(m.group(1)))
    text = text.strip()
    try:
        if kind in ("u8", "i8", "u16", "i16", "u32", "i32", "u64", "i64"):
            return int(text)
        if kind in ("f32", "f64"):
            return float(text)
    except ValueError:
        return text
    if kind == "bool":
        return text == "true"
    return text


@dataclass
class LlamaLogged:
    model_buffer_bytes: dict[str, int] = field(default_factory=dict)
    kv_buffer_bytes: dict[str, int] = field(default_factory=dict)
    rs_buffer_bytes: dict[str, int] = field(default_factory=dict)  # the recurrent state ("RS buffer")
    rs_cells: int | None = None
    rs_size_bytes: int | None = None  # the recurrent cache's own total (its "size =" line)
    compute_buffer_bytes: dict[str, int] = field(default_factory=dict)
    output_buffer_bytes: int | None = None
    output_buffer: str | None = None
    kv_cells: list[int] = field(default_factory=list)
    kv_layers: list[int] = field(default_factory=list)
    kv_size_bytes: int | None = None  # the caches' own total ("size = ..." lines, or "KV self size")
    kv_types: tuple[str, str] | None = None  # (type_k, type_v) as the cache printed them
    n_ctx: int | None = None
    n_ctx_seq: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    n_seq_max: int | None = None
    flash_attn: str | None = None
    build: str | None = None  # "7342 (2fbe3b7bb)": llama.cpp's build number and commit, where logged
    metadata: dict = field(default_factory=dict)  # the loader's dump of the GGUF's keys (arrays by length)
    hparams: dict[str, str] = field(default_factory=dict)  # print_info's lines, as printed
    tensor_types: dict[str, int] = field(default_factory=dict)  # "type q8_0: 338 tensors"
    n_tensors: int | None = None
    lines: int = 0  # how many buffer lines were read (0: this log says nothing about buffers)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _add(d: dict[str, int], name: str, value: int) -> None:
    d[name] = d.get(name, 0) + value


def _first(out: LlamaLogged, attr: str, value) -> None:
    if getattr(out, attr) is None:
        setattr(out, attr, value)


def parse_log(text: str) -> LlamaLogged:
    """Every buffer line of a llama.cpp log, in bytes (each to the log's 0.01 MiB), and what the loader
    printed about the model."""
    out = LlamaLogged()
    kv_sizes: list[int] = []
    kv_self: list[int] = []
    for line in text.splitlines():
        m = META.search(line)
        if m:
            out.metadata.setdefault(m["key"], _meta_value(m["type"], m["v"]))
            continue
        m = TENSOR_TYPE.search(line)
        if m:
            out.tensor_types[m["type"]] = out.tensor_types.get(m["type"], 0) + int(m["n"])
            continue
        m = HPARAM.search(line)
        if m:
            out.hparams.setdefault(m["key"].strip(), m["v"])
            continue
        m = N_TENSORS.search(line)
        if m:
            _first(out, "n_tensors", int(m["n"]))
            continue
        matched = False
        m = RS_SIZE.search(line)
        if m:
            out.rs_cells = int(m["cells"])
            out.rs_size_bytes = (out.rs_size_bytes or 0) + _mib(m["mib"])
            continue
        for rx, target in ((MODEL, out.model_buffer_bytes), (KV, out.kv_buffer_bytes), (RS, out.rs_buffer_bytes),
                           (COMPUTE, out.compute_buffer_bytes), (MODEL_OLD, out.model_buffer_bytes)):
            m = rx.search(line)
            if m:
                _add(target, m["name"], _mib(m["mib"]))
                out.lines += 1
                matched = True
                break
        if matched:
            continue
        m = OUTPUT.search(line)
        if m:
            out.output_buffer_bytes = (out.output_buffer_bytes or 0) + _mib(m["mib"])
            out.output_buffer = m["name"]
            out.lines += 1
            continue
        m = KV_SELF.search(line)
        if m:
            kv_self.append(_mib(m["mib"]))
        else:
            m = KV_SIZE.search(line)
            if m and "kv_cache" in line:
                out.kv_cells.append(int(m["cells"]))
                out.kv_layers.append(int(m["layers"]))
                kv_sizes.append(_mib(m["mib"]))
        m = KV_TYPES.search(line)
        if m:
            _first(out, "kv_types", (m["k"], m["v"]))
        if KV_SELF.search(line) or KV_SIZE.search(line):
            continue
        for rx, attr in ((N_CTX, "n_ctx"), (N_CTX_SEQ, "n_ctx_seq"), (N_BATCH, "n_batch"), (N_UBATCH, "n_ubatch"),
                         (N_SEQ_MAX, "n_seq_max")):
            m = rx.search(line)
            if m:
                _first(out, attr, int(m["n"]))
        m = FLASH.search(line)
        if m:
            _first(out, "flash_attn", m["v"])
        m = BUILD.search(line)
        if m:
            _first(out, "build", m["v"])
    if kv_sizes or kv_self:
        # one "size =" line per cache (a SWA model has two); "KV self size" is the total of all of them
        out.kv_size_bytes = sum(kv_sizes) if kv_sizes else sum(kv_self)
    return out
