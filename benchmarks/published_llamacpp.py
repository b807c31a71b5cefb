"""Hold vramcal's llama.cpp buffers against llama.cpp startup logs others published.

    python benchmarks/published_llamacpp.py [--corpus benchmarks/published/llamacpp/corpus.csv]
                                            [--out-dir docs/validation/published]

Every row of the corpus (benchmarks/published/llamacpp/sources.md) is one llama.cpp startup: its log
excerpt (``logs/<id>.log``, the lines copied verbatim), its source, its flags and its device. The GGUF
itself is not here, so the header vramcal reads is rebuilt from what the log printed -- the loader's
metadata dump and ``print_info`` / ``llm_load_print_meta`` lines (read by
:func:`vramcal.estimator.llamacpp.logparse.parse_log`), and where an excerpt printed none, the model's
published config, named in the row. vramcal's own ``estimate_llamacpp`` then prices that header with the
row's flags, and every buffer the log printed is compared, device by device:

| term | llama.cpp's line | what the log must give |
| --- | --- | --- |
| n_ctx | ``n_ctx = 65536`` | the flags |
| KV | ``CUDA0 KV buffer size`` (``llama_kv_cache_init``, ``_unified``, ``llama_kv_cache``) | layers, KV heads, head |
| output | ``CUDA_Host output buffer size`` | n_vocab |
| compute | ``CUDA0 compute buffer size`` (the graph reservation) | every width of the graph |
| model | ``CUDA0 model buffer size`` | every tensor's type (below) |

Model buffers need every tensor's type, which a log prints only as counts ("type q8_0: 338 tensors"): they
are compared for a file of one type (every matrix Q8_0 or Q6_K, F32 norms) whose tensor list, rebuilt from
the hyper-parameters, has the loader's own count per type.

A buffer is keyed by its device: a GPU by its index (``CUDA0``, ``MTL0_Mapped``, ``Vulkan0`` -> GPU0) and
every host buffer (``CPU``, ``CPU_Mapped``, ``CPU_REPACK``, ``CUDA_Host`` ...) as ``host``. A model buffer in
host memory (``CPU_Mapped``) is compared only where no repeating layer is on the CPU (the mapped range
then is the token embeddings alone; with layers on the CPU it spans the file's order, which a rebuilt
header does not know).

Writes ``published-llamacpp.csv`` (one line per log, term and device) and ``published-llamacpp.md`` into
--out-dir; ``benchmarks/report.py`` puts the section into docs/validation.md.
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT / "benchmarks" / "published" / "llamacpp" / "corpus.csv"
MIB = 1024**2
TERMS = ("n_ctx", "KV", "output", "compute", "model")
# print_info's names -> the GGUF keys llama-model.cpp read them from (load_hparams)
PRINT_INFO_KEYS = {"n_layer": ".block_count", "n_embd": ".embedding_length", "n_head": ".attention.head_count",
                   "n_head_kv": ".attention.head_count_kv", "n_embd_head_k": ".attention.key_length",
                   "n_embd_head_v": ".attention.value_length", "n_ctx_train": ".context_length",
                   "n_ff": ".feed_forward_length", "n_expert": ".expert_count",
                   "n_expert_used": ".expert_used_count", "n_swa": ".attention.sliding_window",
                   "n_ff_exp": ".expert_feed_forward_length"}
NEEDED = (".block_count", ".embedding_length", ".attention.head_count")


@dataclass
class Compared:
    """One buffer of one log: what llama.cpp printed beside what vramcal predicts (bytes; n_ctx in cells)."""

    id: str
    term: str
    device: str
    logged: int
    predicted: int | None
    why: str = ""  # why a prediction is missing, or what differs

    @property
    def within_rounding(self) -> bool:
        """Equal to the log's last digit: llama.cpp prints MiB with two decimals, so a byte count is known
        only to half of 0.01 MiB (5,243 bytes) either way."""
        from vramcal.estimator.llamacpp.logparse import HALF_CENT_MIB

        return self.predicted is not None and self.term != "n_ctx" and \
            abs(self.predicted - self.logged) <= HALF_CENT_MIB

    @property
    def err_pct(self) -> float | None:
        """(vramcal - logged) / logged; 0 where the two agree to the log's 0.01 MiB."""
        if self.predicted is None or not self.logged:
            return None
        if self.within_rounding:
            return 0.0
        return 100.0 * (self.predicted - self.logged) / self.logged


@dataclass
class RowResult:
    row: dict
    compared: list[Compared] = field(default_factory=list)
    hparams_from: str = ""
    model_compared: str = ""  # why model buffers are, or are not, compared
    notes: list[str] = field(default_factory=list)
    error: str = ""


def _num(text: str):
    text = text.strip()
    if text.startswith("["):
        return [int(x) for x in re.findall(r"-?\d+", text)]
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def header_of(row: dict, logged) -> tuple[dict, str, str]:
    """The GGUF metadata llama.cpp's loader read, rebuilt from the log (its dump first, then print_info),
    then from the row's ``hparams`` (the model's config, cited in ``hparams_from``) for what the excerpt did
    not print. Returns (metadata, arch, where the hyper-parameters came from)."""
    meta = dict(logged.metadata)
    arch = meta.get("general.architecture") or logged.hparams.get("arch") or ""
    if not arch:
        arch = "llama"  # every row without a printed arch is a llama-architecture model (the corpus says which)
    meta["general.architecture"] = arch
    from_log = bool(logged.metadata) or bool(logged.hparams)
    for name, key in PRINT_INFO_KEYS.items():
        if name in logged.hparams:
            meta.setdefault(arch + key, _num(logged.hparams[name]))
    if "n_vocab" in logged.hparams:
        meta.setdefault("tokenizer.ggml.tokens", ("array", int(logged.hparams["n_vocab"])))
    given = [kv.split("=", 1) for kv in (row.get("hparams") or "").split(";") if kv.strip()]
    for key, value in given:
        if key == "n_vocab":
            meta.setdefault("tokenizer.ggml.tokens", ("array", int(value)))
        else:
            meta.setdefault(f"{arch}.{key}", _num(value))
    missing = [k for k in NEEDED if arch + k not in meta]
    if missing or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{row['id']}: the log and the row give no {', '.join(missing) or 'n_vocab'}")
    src = row.get("hparams_from") or "log"
    if given and from_log and src == "log":
        src = "log + row"
    return meta, arch, src


def _layer_tensors(arch: str, h, il: int, n_ff_exp: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, ggml shape, quantized) of one repeating layer, as llama-model.cpp creates them (create_tensor
    in load_tensors for LLM_ARCH_QWEN2 and LLM_ARCH_QWEN3MOE): ne0 is the input width."""
    E, hd_k, hd_v = h.n_embd, h.n_embd_head_k, h.n_embd_head_v
    q, k, v = h.n_head[il] * hd_k, h.n_head_kv[il] * hd_k, h.n_head_kv[il] * hd_v
    b = f"blk.{il}."
    out = [(b + "attn_norm.weight", (E,), False), (b + "attn_q.weight", (E, q), True),
           (b + "attn_k.weight", (E, k), True), (b + "attn_v.weight", (E, v), True),
           (b + "attn_output.weight", (q, E), True), (b + "ffn_norm.weight", (E,), False)]
    if arch == "qwen2":
        out += [(b + "attn_q.bias", (q,), False), (b + "attn_k.bias", (k,), False), (b + "attn_v.bias", (v,), False),
                (b + "ffn_gate.weight", (E, h.n_ff[il]), True), (b + "ffn_down.weight", (h.n_ff[il], E), True),
                (b + "ffn_up.weight", (E, h.n_ff[il]), True)]
    elif arch == "gemma3":
        F = h.n_ff[il]
        out[5:5] = [(b + "attn_q_norm.weight", (hd_k,), False), (b + "attn_k_norm.weight", (hd_k,), False),
                    (b + "post_attention_norm.weight", (E,), False)]
        out += [(b + "ffn_gate.weight", (E, F), True), (b + "ffn_up.weight", (E, F), True),
                (b + "ffn_down.weight", (F, E), True), (b + "post_ffw_norm.weight", (E,), False)]
    elif arch == "qwen3moe":
        f, n = n_ff_exp, h.n_expert
        out += [(b + "attn_q_norm.weight", (hd_k,), False), (b + "attn_k_norm.weight", (hd_k,), False),
                (b + "ffn_gate_inp.weight", (E, n), False),  # llama-quant.cpp never quantizes the router
                (b + "ffn_gate_exps.weight", (E, f, n), True), (b + "ffn_down_exps.weight", (f, E, n), True),
                (b + "ffn_up_exps.weight", (E, f, n), True)]
    else:
        raise KeyError(arch)
    return out


def rebuilt_tensors(arch: str, meta: dict, logged) -> tuple[tuple, str]:
    """Every tensor of a single-type file (all matrices one ggml type, the rest F32), rebuilt from the
    hyper-parameters and checked against the loader's "type X: N tensors" lines; else () and why not."""
    from vramcal.estimator.llamacpp.buffers import hparams_of
    from vramcal.estimator.llamacpp.ggml_buffers import row_size
    from vramcal.estimator.llamacpp.gguf_file import GgufModel, GgufTensor

    types = {t.upper(): n for t, n in logged.tensor_types.items()}
    quant = [t for t in types if t != "F32"]
    if not types:
        return (), "the excerpt prints no tensor types"
    if len(quant) != 1:
        return (), f"a mixed file ({', '.join(f'{n} {t}' for t, n in logged.tensor_types.items())}): which tensor " \
                   "has which type is llama.cpp's quantize choice, not in the log"
    if arch not in ("qwen2", "qwen3moe", "gemma3"):
        return (), f"no tensor list for {arch} here"
    qtype = quant[0]
    h = hparams_of(GgufModel(path="log", files=("log",), file_bytes=(0,), arch=arch, metadata=meta))
    n_ff_exp = int(meta.get(f"{arch}.expert_feed_forward_length", 0) or 0)
    specs = [("token_embd.weight", (h.n_embd, h.n_vocab), True)]
    for il in range(h.n_layer):
        specs += _layer_tensors(arch, h, il, n_ff_exp)
    specs.append(("output_norm.weight", (h.n_embd,), False))
    # an output matrix of its own, or a tied one (token_embd used again): the loader's counts say which
    for tail, how in (([("output.weight", (h.n_embd, h.n_vocab), True)], "an output matrix"), ([], "a tied output")):
        tensors, offset = [], 0
        for name, shape, quantized in specs + tail:
            tname = qtype if quantized else "F32"
            rows = 1
            for d in shape[1:]:
                rows *= d
            nbytes = rows * row_size(tname, shape[0])
            tensors.append(GgufTensor(name, tname, 0, shape, nbytes, 0, offset))
            offset += -(-nbytes // 32) * 32  # GGUF's default data alignment
        counts = {"F32": sum(t.type_name == "F32" for t in tensors),
                  qtype: sum(t.type_name == qtype for t in tensors)}
        if counts == types and (logged.n_tensors is None or logged.n_tensors == len(tensors)):
            return tuple(tensors), (f"rebuilt: {len(tensors)} tensors ({how}), {counts[qtype]} {qtype} + "
                                    f"{counts['F32']} F32, as the loader counts them")
    return (), f"the rebuilt tensor list ({counts}) is not the loader's ({types})"


def args_of(row: dict):
    from vramcal.estimator.llamacpp.buffers import LlamaArgs

    overrides = tuple(tuple(o.split("=", 1)) for o in (row.get("overrides") or "").split("|") if o)
    ts = tuple(float(x) for x in row["tensor_split"].split(";")) if row.get("tensor_split") else None
    return LlamaArgs(ctx_size=int(row["ctx_size"]), n_gpu_layers=int(row["n_gpu_layers"]),
                     n_parallel=int(row["n_parallel"]), kv_unified=row["kv_unified"] == "True",
                     flash_attn=row["flash_attn"], cache_type_k=row["cache_type_k"], cache_type_v=row["cache_type_v"],
                     n_batch=int(row["n_batch"]), n_ubatch=int(row["n_ubatch"]), tensor_split=ts,
                     overrides=overrides, n_gpus=int(row["n_gpus"]), use_mmap=row.get("use_mmap", "True") == "True",
                     embeddings=row.get("embeddings") == "True",
                     gpu_backend=row["backend"] if row["backend"] != "CPU" else "CUDA")


GPU_NAME = re.compile(r"^(?!CPU)[A-Za-z]+?(?P<i>\d+)(?:_Mapped)?$")


def device_of(name: str, rpc: tuple[str, ...] = ()) -> str:
    """GPU<i> for a device's own buffer (CUDA0, MTL0_Mapped, Vulkan0; an RPC server, named by its address,
    by its place in ``rpc``, the order the log names them), host for every host buffer."""
    if name in rpc:
        return f"GPU{rpc.index(name)}"
    m = GPU_NAME.match(name)
    return f"GPU{m['i']}" if m else "host"


def by_device(buffers: dict[str, int], rpc: tuple[str, ...] = ()) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, b in buffers.items():
        out[device_of(name, rpc)] = out.get(device_of(name, rpc), 0) + b
    return out


def run_row(row: dict, corpus_dir: Path) -> RowResult:
    from vramcal.errors import UserError
    from vramcal.estimator.llamacpp.buffers import estimate_llamacpp
    from vramcal.estimator.llamacpp.gguf_file import GgufModel
    from vramcal.estimator.llamacpp.logparse import parse_log

    res = RowResult(row=row)
    logged = parse_log((corpus_dir / "logs" / f"{row['id']}.log").read_text())
    try:
        meta, arch, res.hparams_from = header_of(row, logged)
    except ValueError as exc:
        res.error = str(exc)
        return res
    tensors, res.model_compared = rebuilt_tensors(arch, meta, logged)
    m = GgufModel(path=f"{row['id']}.gguf", files=(f"{row['id']}.gguf",), file_bytes=(0,), arch=arch,
                  metadata=meta, tensors=tensors)
    try:
        est = estimate_llamacpp(m, args_of(row))
    except UserError as exc:
        res.error = str(exc)
        return res
    res.notes = list(est.notes)
    rid = row["id"]
    rpc = tuple(dict.fromkeys(n for d in (logged.model_buffer_bytes, logged.kv_buffer_bytes,
                                          logged.compute_buffer_bytes) for n in d if n.startswith("RPC[")))
    if logged.n_ctx is not None:
        res.compared.append(Compared(rid, "n_ctx", "all", logged.n_ctx, est.n_ctx))
    kv_logged, kv_pred = by_device(logged.kv_buffer_bytes, rpc), by_device(est.kv_buffer_bytes)
    for dev in sorted(kv_logged):
        res.compared.append(Compared(rid, "KV", dev, kv_logged[dev], kv_pred.get(dev, 0)))
    if not logged.kv_buffer_bytes and logged.kv_size_bytes:
        res.compared.append(Compared(rid, "KV", "all", logged.kv_size_bytes, sum(est.kv_buffer_bytes.values())))
    if logged.output_buffer_bytes is not None:
        res.compared.append(Compared(rid, "output", device_of(logged.output_buffer, rpc), logged.output_buffer_bytes,
                                     est.output_buffer_bytes))
    c_logged, c_pred = by_device(logged.compute_buffer_bytes, rpc), by_device(est.compute_buffer_bytes)
    for dev in sorted(c_logged):
        res.compared.append(Compared(rid, "compute", dev, c_logged[dev], c_pred.get(dev, 0),
                                     "" if dev in c_pred else "vramcal prices no compute buffer on this device"))
    m_logged, m_pred = by_device(logged.model_buffer_bytes, rpc), by_device(est.model_buffer_bytes)
    full_offload = est.n_gpu_layers == est.n_layer + 1 and not est.kv_buffer_bytes.get("CPU")
    for dev in sorted(m_logged):
        if not tensors:
            why = res.model_compared
        elif dev == "host" and not full_offload and args_of(row).n_gpus:
            why = "layers on the CPU: the mapped range follows the file's order"
        else:
            why = ""
        res.compared.append(Compared(rid, "model", dev, m_logged[dev], None if why else m_pred.get(dev, 0), why))
    return res


def _stats(values) -> tuple[float | None, float | None, int]:
    v = sorted(abs(x) for x in values if x is not None)
    if not v:
        return None, None, 0
    return statistics.median(v), max(v), len(v)


def medians(results: list[RowResult]) -> dict[str, tuple[float | None, float | None, int]]:
    """Per term: (median abs error %, worst abs error %, how many buffers) over every compared buffer."""
    comps = [c for r in results for c in r.compared]
    return {t: _stats(c.err_pct for c in comps if c.term == t) for t in TERMS}


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.2f} %"


def _cell(cs: list[Compared], term: str) -> str:
    got = [c for c in cs if c.term == term]
    if not got:
        return "—"
    parts = []
    for c in got:
        dev = "" if c.device == "all" else f"{c.device} "
        if term == "n_ctx":
            parts.append(f"{c.logged} → {c.predicted}")
        elif c.predicted is None:
            parts.append(f"{dev}{c.logged / MIB:,.2f} → n/a")
        elif c.within_rounding:
            parts.append(f"{dev}{c.logged / MIB:,.2f} (equal)")
        else:
            parts.append(f"{dev}{c.logged / MIB:,.2f} → {c.predicted / MIB:,.2f} ({c.err_pct:+.1f} %)")
    return "<br>".join(parts)


def _flags(row: dict) -> str:
    a = [f"-c {row['ctx_size']}"]
    if row["backend"] != "CPU":
        a.append(f"-ngl {'all' if row['n_gpu_layers'] == '-1' else row['n_gpu_layers']}")
    if row["n_parallel"] != "1":
        a.append(f"-np {row['n_parallel']}")
    if row["kv_unified"] == "True":
        a.append("-kvu")
    a.append(f"-fa {row['flash_attn']}")
    if row["cache_type_k"] != "f16":
        a.append(f"-ctk {row['cache_type_k']} -ctv {row['cache_type_v']}")
    a.append(f"-b {row['n_batch']} -ub {row['n_ubatch']}")
    if row.get("tensor_split"):
        a.append(f"-ts {row['tensor_split'].replace(';', ',')}")
    if row.get("overrides"):
        a.append(f"-ot {row['overrides']}")
    if row.get("use_mmap") == "False":
        a.append("--no-mmap")
    if row.get("embeddings") == "True":
        a.append("--embedding")
    return " ".join(a)


def _source(row: dict) -> str:
    url = row["source_url"]
    return f"[{url.rsplit('/', 2)[-2]}#{url.rsplit('/', 1)[-1]}]({url})" if url.startswith("http") else url


def render(results: list[RowResult], sources_md: str) -> str:
    ok = [r for r in results if not r.error]
    med = medians(ok)
    builds = sorted({r.row["build"] for r in ok})
    lines = ["## llama.cpp: startup logs others published", "",
             f"{len(results)} llama.cpp startups whose logs people pasted publicly "
             f"(`benchmarks/published/llamacpp/corpus.csv`, the verbatim excerpts in `logs/`, sources in "
             f"`{sources_md}`), builds from early 2024 to 2026, on CUDA, Metal, Vulkan, RPC and the CPU. The GGUF "
             "files are not here: each header is rebuilt from what the log printed (the loader's metadata dump, "
             "`print_info`), or where an excerpt printed no hyper-parameters, from the model's config named in the "
             "row; vramcal's `estimate_llamacpp` prices it with the run's flags, and every buffer the log printed "
             "is compared device by device (GPU0, GPU1 ..., host). Generated by "
             "`python benchmarks/published_llamacpp.py`. Nothing is fitted to these rows.", "",
             "| term | buffers compared | equal (to the log's 0.01 MiB) | within 3 % | median abs error | worst |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    comps = [c for r in ok for c in r.compared if c.err_pct is not None]
    for t in TERMS:
        m, w, n = med[t]
        eq = sum(1 for c in comps if c.term == t and c.err_pct == 0)
        close = sum(1 for c in comps if c.term == t and abs(c.err_pct) <= 3.0)
        lines.append(f"| {t} | {n} | {eq} | {close} | {_pct(m)} | {_pct(w)} |")
    not_model = sum(1 for r in ok for c in r.compared if c.term == "model" and c.predicted is None)
    lines += ["", f"Model buffers are compared only where the file is of one type (every matrix Q8_0 or Q6_K, F32 "
              f"norms) and its tensor list, rebuilt from the hyper-parameters, has the loader's own count per type; "
              f"{not_model} logged model buffers are not compared (mixed K-quant files: which tensor got which type "
              "is llama.cpp's quantize choice, which the log does not print).", "",
              "### Every log", "",
              "MiB, logged → vramcal (error). *hparams*: from the log, or from the config the row names.", "",
              "| id | model | quant | device | llama.cpp | flags | hparams | n_ctx | KV | output | compute | model | "
              "source |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        row = r.row
        if r.error:
            lines.append(f"| {row['id']} | {row['model']} | {row['quant']} | {row['gpu']} | {row['build']} | "
                         f"{_flags(row)} | — | not estimated: {r.error} | | | | | {_source(row)} |")
            continue
        hp = "log" if r.hparams_from == "log" else "config" if r.hparams_from.startswith("config") else "log + config"
        lines.append(f"| {row['id']} | {row['model']} | {row['quant']} | {row['backend']}: {row['gpu']} | "
                     f"{row['build']} | `{_flags(row)}` | {hp} | {_cell(r.compared, 'n_ctx')} | "
                     f"{_cell(r.compared, 'KV')} | {_cell(r.compared, 'output')} | {_cell(r.compared, 'compute')} | "
                     f"{_cell(r.compared, 'model')} | {_source(row)} |")
    lines += ["", "### What differs, and why", ""]
    lines += MISSES
    return "\n".join(lines) + "\n"


# What the rows show, written from the table above and kept beside the code that prints it, so that a change
# of the figures that contradicts a sentence shows in the same diff (tests/test_published_llamacpp.py pins them).
MISSES = [
    "- **n_ctx and KV**: every logged n_ctx, and 23 of the 26 KV buffers, equal to the log's 0.01 MiB -- "
    "sliding-window caches (gemma2 on the CPU, gpt-oss on Metal), q8_0 caches over two GPUs at `-ts 10,6` "
    "(lc15) and half on the CPU (lc20), splits by free memory over two GPUs (lc13) and two RPC servers (lc18), "
    "a partial offload (lc03). "
    "The misses are versions: lc02 (early 2024), where `-ngl 25` put 25 *repeating* layers on the GPU and the "
    "output layer only past n_layer, where today the output layer counts first (24 repeating layers + the "
    "output), so one layer's KV sits on the other side of its two buffers (-4.0 % / +14.3 %); and lc17 (early "
    "2025), whose build kept a full-size cache for gemma3's sliding-window layers, where today's keeps "
    "`n_swa + n_ubatch` cells (-74 %).",
    "- **Output**: 18 of 19 equal. Three of them ask for embeddings beside the logits, `(n_vocab + n_embd)` "
    "floats per output, priced by `--embedding` (the `embeddings` column, read from each log: Ollama's runner, "
    "lc04: 4 x (128256 + 4096) x 4 bytes = 2.02 MiB; lc20: 0.60 MiB; `--embedding`, lc05: 0.59 MiB). The miss "
    "is GritLM, whose 2024 build reserved a whole batch of outputs ((32000 + 4096) x 512 x 4 = 70.50 MiB). "
    "lc06's build printed an *input* buffer instead.",
    "- **Model**: compared for the three single-type files only. Qwen3-Coder-30B Q8_0 on CUDA (lc01): "
    "30,658.12 and 315.30 MiB, equal; on Vulkan, gemma-3-1b Q8_0 with its tied output (lc17) 75 KiB over "
    "(0.007 %) and DeepSeek-R1-Distill-Qwen-1.5B Q6_K (lc14) 11 KiB over (0.001 %): vramcal applies CUDA's "
    "512-value row padding, which the Vulkan backend does not. The other logs' model buffers (mixed K-quant "
    "files) are not compared: which tensor got which type is llama.cpp's quantize choice, not in the log.",
    "- **Compute, within 3 %**: the CPU (lc07 gemma2 with two caches and lc11, a 2026 llama-cpp-python: equal; "
    "lc08 +2.1 %), two RPC servers and their host (lc18: +2.7 %, +2.7 %, equal), and a full GPU offload on "
    "builds that lay the cache out as today's (lc01 qwen3moe +1.3 %, lc05 -1.3 %, lc10 +2.0 %, lc13 +0.6 % on "
    "both GPUs, lc14 Vulkan +2.0 %, lc16 +1.6 %, lc17 +0.4 %). The replay follows ggml-alloc's rule that no "
    "op runs in place on a view, the rule of every build here (ggml-alloc v3, February 2024, on); replaying "
    "view reuse instead, which no build here does, met some rows closer (lc18 to the 0.01 MiB, lc09 +1.4 %, "
    "lc12 -2.7 %): other differences of those builds' graphs, not written down, must account for that. "
    "The GPU host's buffer is "
    "the graph's inputs (the f32 KQ mask above all): equal where the build has today's inputs (lc01 132.01 "
    "MiB, lc18, lc05 -0.1 %, lc12 -2.1 %); builds before `set_rows` (mid-2025) show no KV index inputs (their "
    "host buffers are the other inputs' sum to the 0.01 MiB), so without flash attention vramcal is over by "
    "`n_ubatch x n_embd_v_gqa` int64 (lc10 +86 %, lc16 +19 %, lc13 +5.6 %, lc14 +5.3 %).",
    "- **Compute, misses**: lc09 (build 5581, the CPU) +4.1 % and lc12 (gpt-oss on Metal, whose sinks and "
    "biases the llama family's graph leaves out) -4.0 %; 2024 builds (lc02 +66 % / +29 %, with the old `-ngl` "
    "placement; lc06 +15 %, and +250 % on the host, where that build kept a separate 13.02 MiB input buffer); "
    "lc17's full-size sliding "
    "window (both of its KQ masks 8192 cells wide: host -35 %); a shared cache (lc04 -52 %: that build kept one "
    "cache of 8192 cells for its 4 sequences, so each ubatch's KQ spans 8192 cells, where vramcal prices "
    "today's 4 streams of 2048); pipeline parallelism (lc15, `n_copies=4`, not modelled: -52 % / -31 % / "
    "-72 %, where vramcal also prices the q8_0 cache's Hadamard rotations, which that build predates); and "
    "op offload: with a GPU present, llama.cpp runs the matrix products of the layers left on the "
    "CPU on the GPU for a ubatch of 32 tokens or more, copying their weights into the GPU's compute buffer, so "
    "its CPU split is small and its GPU buffer bigger, where vramcal replays the CPU layers' graph on the host "
    "(lc03: GPU +7.5 %, host +208 %; lc20, whose output matrix stayed on the CPU: GPU -65 %, host +669 %; "
    "lc19, no layer offloaded: 24 MiB on the GPU that vramcal prices as none, host -44 %). These are "
    "left as misses.",
]


FIELDS = ["id", "term", "device", "logged_bytes", "predicted_bytes", "err_pct", "why"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "validation" / "published"))
    args = ap.parse_args(argv)
    corpus = Path(args.corpus)
    with open(corpus, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        if not r.get("source_url"):
            raise SystemExit(f"row {r.get('id')}: no source_url: every log needs its source")
        if not (corpus.parent / "logs" / f"{r['id']}.log").is_file():
            raise SystemExit(f"row {r['id']}: no logs/{r['id']}.log beside the corpus")
    results = [run_row(r, corpus.parent) for r in rows]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "published-llamacpp.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=FIELDS)
        w.writeheader()
        for r in results:
            for c in r.compared:
                w.writerow({"id": c.id, "term": c.term, "device": c.device, "logged_bytes": c.logged,
                            "predicted_bytes": "" if c.predicted is None else c.predicted,
                            "err_pct": "" if c.err_pct is None else f"{c.err_pct:.3f}", "why": c.why})
    try:
        sources_md = str((corpus.parent / "sources.md").resolve().relative_to(ROOT))
    except ValueError:
        sources_md = str(corpus.parent / "sources.md")
    (out / "published-llamacpp.md").write_text(render(results, sources_md))
    med = medians([r for r in results if not r.error])
    print(f"{sum(not r.error for r in results)} of {len(results)} llama.cpp logs: "
          + "; ".join(f"{t} median {_pct(med[t][0])} over {med[t][2]}" for t in TERMS), file=sys.stderr)
    for r in results:
        if r.error:
            print(f"  {r.row['id']}: not estimated: {r.error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
