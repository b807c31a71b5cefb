"""The command line of ``--engine llama.cpp`` (part of the command line, like :mod:`vramcal.cli`; nothing
else imports it): llama.cpp's own flag spellings (``llama-server --help``), so the flags of a
``llama-server`` / ``llama-cli`` command can be pasted, turned into
:class:`~vramcal.estimator.llamacpp.buffers.LlamaArgs`, and the estimate, fit, probe and check run on a
GGUF file (docs/llamacpp.md)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from .errors import UserError
from .workload import device_kind

# dest -> the flag as llama.cpp spells it; every one belongs to --engine llama.cpp only
LLAMACPP_FLAGS = {
    "ctx_size": "--ctx-size", "n_gpu_layers": "--n-gpu-layers", "tensor_split": "--tensor-split",
    "split_mode": "--split-mode", "main_gpu": "--main-gpu", "override_tensor": "--override-tensor",
    "n_cpu_moe": "--n-cpu-moe", "cpu_moe": "--cpu-moe", "no_mmap": "--no-mmap", "load_mode": "--load-mode",
    "parallel": "--parallel",
    "kv_unified": "--kv-unified", "cache_type_k": "--cache-type-k", "cache_type_v": "--cache-type-v",
    "flash_attn": "--flash-attn", "batch_size": "--batch-size", "ubatch_size": "--ubatch-size",
    "swa_full": "--swa-full", "no_kv_offload": "--no-kv-offload", "embedding": "--embedding",
    "gpu_count": "--gpu-count",
    "type_name": "--type", "imatrix": "--imatrix",
    "model_draft": "--model-draft", "n_gpu_layers_draft": "--gpu-layers-draft",
    "cache_type_k_draft": "--cache-type-k-draft", "cache_type_v_draft": "--cache-type-v-draft",
    "override_tensor_draft": "--override-tensor-draft", "cpu_moe_draft": "--cpu-moe-draft",
    "n_cpu_moe_draft": "--n-cpu-moe-draft", "mmproj": "--mmproj", "mmproj_offload": "--no-mmproj-offload",
    "ollama": "--ollama",
}
DRAFT_ONLY = ("n_gpu_layers_draft", "cache_type_k_draft", "cache_type_v_draft", "override_tensor_draft",
              "cpu_moe_draft", "n_cpu_moe_draft")


def add_flags(p, command: str) -> None:
    """llama.cpp's flags, in its spellings and with its defaults (common/common.h, common/arg.cpp)."""
    g = p.add_argument_group("--engine llama.cpp: the flags of your llama-server / llama-cli command, in "
                             "llama.cpp's spellings (docs/llamacpp.md)")
    g.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, default=None,
                   help="context size (default 0 = the model's n_ctx_train), padded to 256 as llama.cpp pads it")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", default=None, metavar="N",
                   help="layers in VRAM: a number (999 = all), all, or auto (llama.cpp's default: all here; "
                        "its --fit search is not modelled)")
    g.add_argument("-ts", "--tensor-split", dest="tensor_split", default=None, metavar="N0,N1,...",
                   help="share of the layers per GPU, e.g. 3,1")
    g.add_argument("-sm", "--split-mode", dest="split_mode", default=None, choices=("none", "layer", "row", "tensor"),
                   help="layer (default) | none (row: refused on CUDA, which llama.cpp dropped it from; tensor: not "
                        "modelled yet)")
    g.add_argument("-mg", "--main-gpu", dest="main_gpu", type=int, default=None, help="the GPU of -sm none (default 0)")
    g.add_argument("-ot", "--override-tensor", dest="override_tensor", action="append", default=None,
                   metavar="PATTERN=BUFFER,...", help="tensors whose name matches PATTERN go to BUFFER (CPU, CUDA0 ...)")
    g.add_argument("-ncmoe", "--n-cpu-moe", dest="n_cpu_moe", type=int, default=None, metavar="N",
                   help="the expert weights of the first N layers stay in the CPU")
    g.add_argument("-cmoe", "--cpu-moe", dest="cpu_moe", action="store_true", default=None,
                   help="every expert weight stays in the CPU")
    g.add_argument("--no-mmap", dest="no_mmap", action="store_true", default=None,
                   help="read the weights into a CPU buffer instead of mapping the file (CPU, not CPU_Mapped)")
    g.add_argument("-lm", "--load-mode", dest="load_mode", default=None,
                   choices=("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"),
                   help="llama.cpp's newer spelling: auto / mmap map the file (CPU_Mapped), none / dio read it "
                        "into a buffer (as --no-mmap)")
    g.add_argument("-np", "--parallel", dest="parallel", type=int, default=None, help="sequences / server slots "
                                                                                       "(default 1)")
    g.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=None,
                   help="one KV buffer shared by all sequences")
    g.add_argument("-ctk", "--cache-type-k", dest="cache_type_k", default=None, metavar="TYPE",
                   help="f16 (default) | bf16 | f32 | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | iq4_nl")
    g.add_argument("-ctv", "--cache-type-v", dest="cache_type_v", default=None, metavar="TYPE",
                   help="as -ctk; a quantized V cache needs flash attention")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", nargs="?", const="on", default=None,
                   choices=("on", "off", "auto"), help="on | off | auto (default auto: on where the device has it; "
                                                      "off on a CPU-only build)")
    g.add_argument("-b", "--batch-size", dest="batch_size", type=int, default=None, help="logical batch (default 2048)")
    g.add_argument("-ub", "--ubatch-size", dest="ubatch_size", type=int, default=None,
                   help="physical batch, the compute graph's width (default 512)")
    g.add_argument("--swa-full", dest="swa_full", action="store_true", default=None,
                   help="full-size sliding-window caches")
    g.add_argument("-nkvo", "--no-kv-offload", dest="no_kv_offload", action="store_true", default=None,
                   help="keep the KV cache in the CPU")
    g.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true", default=None,
                   help="an embeddings server: each output keeps its embedding too, and -b is lowered to -ub as "
                        "llama-server lowers it")
    g.add_argument("-md", "--model-draft", dest="model_draft", default=None, metavar="FILE.gguf",
                   help="a draft model for speculative decoding: its buffers and KV on the same devices, with the "
                        "target's -c, -np, -fa, -ts (llama-server's common_base_params_to_speculative)")
    g.add_argument("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", dest="n_gpu_layers_draft", default=None,
                   metavar="N", help="the draft's layers in VRAM (default auto: all here)")
    g.add_argument("-ctkd", "--cache-type-k-draft", dest="cache_type_k_draft", default=None, metavar="TYPE",
                   help="the draft's K cache type (default f16)")
    g.add_argument("-ctvd", "--cache-type-v-draft", dest="cache_type_v_draft", default=None, metavar="TYPE",
                   help="the draft's V cache type (default f16)")
    g.add_argument("-otd", "--override-tensor-draft", dest="override_tensor_draft", action="append", default=None,
                   metavar="PATTERN=BUFFER,...", help="as -ot, for the draft's tensors")
    g.add_argument("-cmoed", "--cpu-moe-draft", dest="cpu_moe_draft", action="store_true", default=None,
                   help="every expert weight of the draft in the CPU")
    g.add_argument("-ncmoed", "--n-cpu-moe-draft", dest="n_cpu_moe_draft", type=int, default=None, metavar="N",
                   help="the draft's expert weights of its first N layers in the CPU")
    g.add_argument("-mm", "--mmproj", dest="mmproj", action="append", default=None, metavar="FILE.gguf",
                   help="a multimodal projector (mmproj-*.gguf): its model buffer on the first GPU, from its header, "
                        "and its warm-up compute buffer where replayed (gemma3; tools/mtmd/clip.cpp)")
    g.add_argument("--mmproj-offload", "--no-mmproj-offload", dest="mmproj_offload", action=BooleanFlag,
                   default=None, help="--no-mmproj-offload keeps the projector in the CPU (default: on the GPU)")
    g.add_argument("--ollama", dest="ollama", action="append", default=None, metavar="KEY=VALUE,...",
                   help="the run as Ollama's: its options num_ctx, num_batch, num_gpu, main_gpu, use_mmap and its "
                        "environment OLLAMA_NUM_PARALLEL, OLLAMA_CONTEXT_LENGTH, OLLAMA_FLASH_ATTENTION, "
                        "OLLAMA_KV_CACHE_TYPE, priced as the llama-server flags Ollama launches (docs/llamacpp.md)")
    g.add_argument("--gpu-count", dest="gpu_count", type=int, default=None, metavar="N",
                   help="vramcal's: the GPUs llama.cpp would see (default: -ts's length, else this machine's, else 1)")
    if command in ("estimate", "fit", "probe", "check"):
        g.add_argument("--type", dest="type_name", default=None, metavar="TYPE",
                       help="vramcal's: price MODEL's HF config (a catalog name, a folder, a Hub id) as the GGUF of "
                            "this llama.cpp file type -- Q4_K_M, Q8_0, IQ4_XS, F16 ... -- before any download, each "
                            "tensor typed by llama-quantize's own rules")
        g.add_argument("--imatrix", dest="imatrix", action="store_true", default=None,
                       help="with --type: quantized with an importance matrix (as most published GGUFs are; it "
                            "changes IQ4_XS, IQ4_NL, Q4_0, Q5_0 and IQ3_XXS choices, and the IQ1/IQ2 types need it)")


def flags_used(args) -> list[str]:
    return [flag for dest, flag in LLAMACPP_FLAGS.items() if getattr(args, dest, None) is not None]


def _gpu_count(args) -> tuple[int, str | None]:
    """The GPUs llama.cpp would see: --device cpu none; --gpu-count; -ts's length; this machine's (NVML);
    else one, said in a note."""
    if device_kind(getattr(args, "device", "cuda") or "cuda") == "cpu":
        return 0, None
    if args.gpu_count is not None:
        return args.gpu_count, None
    if args.tensor_split:
        return len(_split(args.tensor_split)), None
    from .probes import nvml

    ok, _ = nvml.available()
    if ok:
        n = nvml.query("nvmlDeviceGetCount")
        if not isinstance(n, nvml.NA) and n > 0:
            return int(n), None
    return 1, "no GPU seen here: priced for one CUDA GPU (--gpu-count N for more, --device cpu for a CPU-only build)"


def _split(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in re.split(r"[,/]+", text.strip()) if x != "")
    except ValueError:
        raise UserError(f"-ts/--tensor-split {text!r}: shares separated by commas, e.g. 3,1") from None


def _ngl(text) -> int:
    if text is None or text == "auto":
        return -1
    if text == "all":
        return -2
    try:
        n = int(text)
    except (TypeError, ValueError):
        raise UserError(f"-ngl/--n-gpu-layers {text!r}: a number of layers (999 = all), all, or auto") from None
    return n if n >= 0 else -1


def _overrides(values) -> tuple[tuple[str, str], ...]:
    out = []
    for value in values or ():
        for item in value.split(","):
            if not item.strip():
                continue
            pattern, sep, buf = item.partition("=")
            if not sep or not pattern or not buf:
                raise UserError(f"-ot/--override-tensor {item!r}: write PATTERN=BUFFER, e.g. '\\.ffn_.*_exps\\.=CPU'")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UserError(f"-ot/--override-tensor pattern {pattern!r} is not a regular expression ({exc})") \
                    from None
            out.append((pattern, buf))
    return tuple(out)


def _draft(args):
    """-md and the draft's own flags as :class:`DraftArgs` (None without -md; its flags alone are refused)."""
    from .estimator.llamacpp.buffers import DraftArgs

    if getattr(args, "model_draft", None) is None:
        given = [LLAMACPP_FLAGS[d] for d in DRAFT_ONLY if getattr(args, d, None) is not None]
        if given:
            raise UserError(f"{', '.join(given)} set{'s' * (len(given) == 1)} the draft model's flags: give the draft "
                            "with -md FILE.gguf, or drop them")
        return None
    return DraftArgs(path=args.model_draft, n_gpu_layers=_ngl(args.n_gpu_layers_draft),
                     cache_type_k=(args.cache_type_k_draft or "f16").lower(),
                     cache_type_v=(args.cache_type_v_draft or "f16").lower(),
                     overrides=_overrides(args.override_tensor_draft), n_cpu_moe=_or(args.n_cpu_moe_draft, 0),
                     cpu_moe=bool(args.cpu_moe_draft))


class BooleanFlag(argparse.Action):
    """llama.cpp's ``--X`` / ``--no-X`` pair as one flag (common/arg.cpp writes them as one option)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def _mmproj(args):
    """--mmproj and --no-mmproj-offload as :class:`MmprojArgs` (None without --mmproj); one line for the
    projector given twice (libmtmd loads one), or --no-mmproj-offload without it."""
    from .estimator.llamacpp.mmproj import MmprojArgs

    given = getattr(args, "mmproj", None) or []
    if len(given) > 1:
        raise UserError(f"--mmproj is given {len(given)} times ({', '.join(given)}): llama-server loads one projector; "
                        "give it once")
    if not given:
        if getattr(args, "mmproj_offload", None) is not None:
            raise UserError("--mmproj-offload / --no-mmproj-offload set where the projector goes: give it with "
                            "--mmproj FILE.gguf, or drop the flag")
        return None
    return MmprojArgs(path=given[0], offload=args.mmproj_offload is not False)


def _or(value, default):
    return default if value is None else value


def _as_ollama(args, header, gpu_total_bytes: int | None) -> list[str]:
    """``--ollama``: the llama-server flags Ollama would launch with (:mod:`.estimator.llamacpp.ollama`), parsed
    by the same flags as a llama.cpp command into ``args``; its notes. One line beside a flag Ollama sets."""
    import argparse as _argparse

    from .estimator.llamacpp.ollama import SET_BY_OLLAMA, llama_server_flags, parse_settings

    given = [LLAMACPP_FLAGS[d] for d in SET_BY_OLLAMA if getattr(args, d, None) is not None]
    if given:
        raise UserError(f"--ollama sets {', '.join(given)} as Ollama does: give them as Ollama's (num_ctx, num_batch, "
                        "num_gpu, OLLAMA_NUM_PARALLEL ...) in --ollama, or drop --ollama")
    settings = parse_settings(args.ollama)
    embedding = header is not None and header.get(".pooling_type") is not None
    run = llama_server_flags(settings, n_ctx_train=header.get(".context_length") if header is not None else None,
                             arch=header.arch if header is not None else None, embedding=embedding,
                             gpu_total_bytes=gpu_total_bytes)
    p = _argparse.ArgumentParser(add_help=False)
    add_flags(p, "estimate")
    ns = p.parse_args(list(run.argv))
    for dest in SET_BY_OLLAMA:
        setattr(args, dest, getattr(ns, dest))
    return list(run.notes) + [f"llama-server {' '.join(run.argv)}"]


def _gpu_total_bytes(n_gpus: int) -> int | None:
    """This machine's GPUs' memory in all (NVML), for Ollama's default num_ctx tier; None where unread."""
    from .probes import nvml

    ok, _ = nvml.available()
    if not ok or not n_gpus:
        return None
    sizes = [nvml.memory_total(nvml.device_handle(i)) for i in range(n_gpus)]
    return None if any(isinstance(s, nvml.NA) for s in sizes) else sum(sizes)


def llama_args(args, header=None, **over):
    """The command line's flags as :class:`LlamaArgs` (validated there; one line on bad input); with
    ``--ollama``, first turned into the llama-server flags Ollama launches (``header``: the model's, for its
    context_length and kind; ``gpu_total_bytes`` in ``over``: the GPUs' memory for Ollama's default num_ctx)."""
    from dataclasses import replace

    from .estimator.llamacpp.buffers import LlamaArgs

    gpu_total = over.pop("gpu_total_bytes", None)
    n_gpus, note = (over["n_gpus"], None) if "n_gpus" in over else _gpu_count(args)
    ollama_notes = []
    if getattr(args, "ollama", None):
        ollama_notes = _as_ollama(args, header, gpu_total if gpu_total is not None else _gpu_total_bytes(n_gpus))
    a = LlamaArgs(
        ctx_size=0 if args.ctx_size is None else args.ctx_size, n_gpu_layers=_ngl(args.n_gpu_layers),
        tensor_split=_split(args.tensor_split) if args.tensor_split else None, split_mode=args.split_mode or "layer",
        main_gpu=_or(args.main_gpu, 0), overrides=_overrides(args.override_tensor), n_cpu_moe=_or(args.n_cpu_moe, 0),
        cpu_moe=bool(args.cpu_moe),
        use_mmap=not args.no_mmap and (args.load_mode or "auto") in ("auto", "mmap", "mmap+mlock"),
        n_parallel=_or(args.parallel, 1),
        kv_unified=bool(args.kv_unified), cache_type_k=(args.cache_type_k or "f16").lower(),
        cache_type_v=(args.cache_type_v or "f16").lower(), flash_attn=args.flash_attn or "auto",
        n_batch=_or(args.batch_size, 2048), n_ubatch=_or(args.ubatch_size, 512), swa_full=bool(args.swa_full),
        offload_kqv=not args.no_kv_offload, embeddings=bool(args.embedding), n_gpus=n_gpus, draft=_draft(args),
        mmproj=_mmproj(args))
    if a.embeddings and a.n_batch > a.n_ubatch:  # llama-server (tools/server/server.cpp): one ubatch per request
        note = "; ".join(x for x in (note, f"--embedding: -b {a.n_batch} lowered to -ub {a.n_ubatch}, as llama-server "
                                     "does (embeddings need every token in one ubatch)") if x)
        a = replace(a, n_batch=a.n_ubatch)
    if ollama_notes:
        note = "; ".join([*ollama_notes, *([note] if note else [])])
    return replace(a, **over).validated(), note


def cmd_plan(args, io) -> int:
    """``plan --engine llama.cpp``: the llama-server flags (file, -ngl, --n-cpu-moe, -ts, -ctk/-ctv, -c) for
    the machine of --hardware (or this one); calibrate/plan_llamacpp.py searches, present.py says it."""
    from . import present
    from .calibrate.check import DEFAULT_BUFFER
    from .calibrate.plan_llamacpp import plan_llamacpp
    from .cli import _progress, hub_options
    from .cli_plan import machine
    from .units import size_option
    from .workload import GOALS, choice

    choice(args.goal, GOALS, "--goal")
    if args.model is None:
        raise UserError("plan --engine llama.cpp needs a GGUF file or a folder of them")
    others = [f for f, given in (("--ctx", args.ctx is not None), ("--prompt", args.prompt is not None),
                                 ("--new-tokens", args.new_tokens is not None), ("--batch", args.batch != 1),
                                 ("--attn", args.attn != "auto"),
                                 ("--images", bool(getattr(args, "images", 0))),
                                 ("--image-size", getattr(args, "image_size", None) is not None),
                                 ("--gpu-count", args.gpu_count is not None)) if given]
    if others:
        raise UserError(f"--engine llama.cpp does not use {', '.join(others)} in plan: its context is -c/--ctx-size, "
                        "its parallel sequences -np, and its GPUs those of --hardware (or this machine's)")
    hardware = machine(args, cpu_bandwidth=True)
    buffer = DEFAULT_BUFFER if args.buffer is None else size_option(args.buffer, "--buffer")
    # Ollama's default num_ctx tier: a described GPU's whole size (less its reserve is the run's, not the tier's)
    tier = sum((g.total_bytes or g.memory_bytes) if args.hardware is not None else g.memory_bytes
               for g in hardware.gpus)
    a, _ = llama_args(args, n_gpus=len(hardware.gpus), gpu_total_bytes=tier)
    pinned = frozenset(k for k, on in (("ctx", args.ctx_size is not None),
                                       ("ngl", args.n_gpu_layers not in (None, "auto")),  # auto: llama.cpp's --fit
                                       ("moe", args.n_cpu_moe is not None or bool(args.cpu_moe)),
                                       ("split", args.tensor_split is not None)) if on)
    beyond = learned_beyond(args) if args.hardware is None else _default_beyond(
        "no runs applied: a described machine (--hardware) has none of its own")
    result = plan_llamacpp(args.model, hardware, buffer=buffer, goal=args.goal, args=a, pinned=pinned,
                           kv_pinned=args.cache_type_k is not None or args.cache_type_v is not None,
                           progress=_progress(args), beyond=beyond, hub=hub_options(args, io.progress()))
    io.out(json.dumps(result.to_dict()) if args.json else present.llamacpp_plan_text(result))
    return 0 if result.plans else 1


def _refuse_others(args, command: str) -> None:
    from .cli_vllm import refuse_transformers_flags

    allowed = ("--device cpu",) + (("--budget", "--buffer") if command in ("fit", "check") else ())
    refuse_transformers_flags(args, command, engine="llama.cpp", allowed=allowed,
                              instead="-c, -ngl, -ts, -ctk, -ctv, -fa, -np, -ub ...")


def cmd_estimate(args, io) -> int:
    from . import present
    from .estimator.llamacpp.buffers import estimate_llamacpp

    if args.model is None:
        raise UserError("--engine llama.cpp needs a GGUF file: `vramcal estimate --engine llama.cpp FILE.gguf -c 8192 "
                        "-ngl 99`")
    _refuse_others(args, "estimate")
    m = model_header(args, io)
    a, note = llama_args(args, m)
    e = estimate_llamacpp(m, a)
    if note:
        e.notes.append(note)
    beyond = learned_beyond(args)
    io.out(json.dumps(present.llamacpp_json(e, beyond)) if args.json else present.llamacpp_table(e, beyond))
    return 0


def learned_beyond(args):
    """What llama.cpp holds beyond its buffers on this machine: learned from its recorded llama.cpp runs
    (:mod:`vramcal.calibrate.llamacpp_corrections`) unless --no-correction, else the defaults."""
    if getattr(args, "no_correction", False):
        return _default_beyond("no runs applied (--no-correction)")
    from .calibrate.llamacpp_corrections import machine_beyond

    beyond, why = machine_beyond(getattr(args, "db", None))
    return _default_beyond(why) if why else beyond


def _default_beyond(why: str):
    """The defaults, saying why no run of this machine was applied."""
    from dataclasses import replace

    from .estimator.llamacpp.fit import DEFAULT_BEYOND as D

    return replace(D, gpu_source=f"{D.gpu_source}; {why}", host_source=f"{D.host_source}; {why}")


def _is_gguf(spec: str) -> bool:
    """A path to a GGUF file (by its name, or its first bytes), or a folder holding GGUFs and no config.json."""
    p = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        return True
    try:
        if p.is_file():
            with open(p, "rb") as fh:
                return fh.read(4) == b"GGUF"
        return p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf"))
    except OSError:
        return False


def model_header(args, io=None):
    """MODEL's GGUF header: read from the file, or -- with --type -- derived from its HF config as
    convert_hf_to_gguf.py + llama-quantize TYPE would write it (:func:`~.estimator.llamacpp.from_config.header_for`)."""
    from .cli import hub_options
    from .estimator.llamacpp.gguf_file import read_gguf

    progress = io.progress() if io is not None else None
    type_name = getattr(args, "type_name", None)
    if args.model is None:
        raise UserError("--engine llama.cpp needs a GGUF file, or an HF config with --type: `vramcal estimate --engine "
                        "llama.cpp FILE.gguf -c 8192 -ngl 99`, `... llama-3.1-8b --type Q4_K_M`")
    if type_name is None:
        if getattr(args, "imatrix", None):
            raise UserError("--imatrix goes with --type (a model priced from its config as a GGUF of that type)")
        try:
            return read_gguf(args.model, getattr(args, "file", None), hub_options(args, progress))
        except UserError as exc:
            from .estimator.resolve import catalog_names

            p = Path(args.model).expanduser()
            if args.model in catalog_names() or (p / "config.json").is_file() or p.name == "config.json":
                raise UserError(f"{exc}; {args.model} is an HF config: add --type Q4_K_M (or Q8_0, IQ4_XS, F16 ...) "
                                "to price it as that GGUF before download") from None
            raise
    from .estimator.llamacpp.from_config import file_type, header_for
    from .estimator.resolve import resolve_model

    file_type(type_name)  # an unknown type is said before anything is resolved
    if getattr(args, "file", None) is not None or _is_gguf(args.model):
        raise UserError(f"--type prices a model from its HF config; {getattr(args, 'file', None) or args.model} is a "
                        "GGUF file, whose header already gives each tensor's type: drop --type")
    source = resolve_model(args.model, hub_options(args, progress))
    return header_for(source.config, type_name, name=source.name, imatrix=bool(getattr(args, "imatrix", False)),
                      revision=f"{source.name}@{source.revision}" if source.origin == "hub" else None)


def cmd_fit(args, io) -> int:
    """``fit --engine llama.cpp``: the most -ngl, then the largest -c, whose buffers fit each GPU's budget."""
    from . import present
    from .estimator.llamacpp.fit import fit_llamacpp
    from .units import size_option

    _refuse_others(args, "fit")
    if args.budget is None or args.budget == "auto":
        raise UserError("fit --engine llama.cpp needs --budget (each GPU's memory to fit in, e.g. 24GiB)")
    budget = size_option(args.budget, "--budget", above_zero=True)
    from .calibrate.check import DEFAULT_BUFFER

    buffer = DEFAULT_BUFFER if args.buffer is None else size_option(args.buffer, "--buffer")
    if buffer >= budget:
        raise UserError(f"--buffer ({buffer:,} B) must be below --budget ({budget:,} B)")
    m = model_header(args, io)
    a, note = llama_args(args, m, gpu_total_bytes=budget * max(_gpu_count(args)[0], 1))
    if a.n_gpus == 0:
        raise UserError("fit --engine llama.cpp searches what fits the GPUs: drop --device cpu")
    f = fit_llamacpp(m, a, budget - buffer, ctx_given=args.ctx_size is not None,
                     ngl_given=args.n_gpu_layers not in (None, "auto"), moe_given=args.n_cpu_moe is not None,
                     beyond=learned_beyond(args))
    if note:
        f.notes.append(note)
    io.out(json.dumps(f.to_dict()) if args.json else present.llamacpp_fit_table(f, budget, buffer))
    return 0 if f.fits else 1


def _probe(args, io, *, check: bool) -> int:
    """``probe`` / ``check --engine llama.cpp``: llama.cpp loads the GGUF in a child and generates 16
    tokens; its buffer lines are read back and recorded beside the prediction (docs/llamacpp.md)."""
    from . import present
    from .estimator.llamacpp.buffers import estimate_llamacpp
    from .estimator.llamacpp.gguf_file import read_gguf
    from .probes.llamacpp_probe import child_spec, preflight, run_llamacpp_probe

    verb = "check" if check else "probe"
    _refuse_others(args, verb)
    a, note = llama_args(args)
    if a.draft is not None:
        raise UserError(f"a {verb} loads the target model only: -md is priced by `vramcal estimate --engine llama.cpp`"
                        ", not run yet; drop -md to probe the target")
    if a.mmproj is not None:
        raise UserError(f"a {verb} loads the model only: --mmproj is priced by `vramcal estimate --engine llama.cpp`, "
                        "not run yet; drop --mmproj to probe the model")
    if (a.overrides or a.n_cpu_moe or a.cpu_moe) and a.n_gpus and a.n_gpu_layers != 0:
        raise UserError(f"a {verb} cannot pass -ot / --n-cpu-moe / --cpu-moe to llama.cpp yet (its child sets no "
                        "tensor overrides), so it would measure another placement than the one asked: drop them "
                        "here, or price them with `vramcal estimate --engine llama.cpp`")
    preflight(a.n_gpus if a.n_gpu_layers != 0 else 0)
    if getattr(args, "synthetic", False):
        raise UserError("--synthetic belongs to transformers' probes: a llama.cpp probe loads the GGUF itself")
    if getattr(args, "type_name", None) is not None or getattr(args, "imatrix", None):
        raise UserError(f"--type prices a GGUF before download; a {verb} loads the file itself: convert and quantize "
                        "the model, then give the .gguf (or use `vramcal estimate --engine llama.cpp ... --type`)")
    m = read_gguf(args.model)
    if m.revision is not None:  # only its header is here
        raise UserError(f"{args.model} is on the Hub, not on this machine: a probe loads the file; "
                        f"`hf download {m.revision.split('@')[0]} {Path(m.path).name}` first, then probe the file")
    est = estimate_llamacpp(m, a)
    if note:
        est.notes.append(note)
    gpus = [] if a.n_gpus == 0 or a.n_gpu_layers == 0 else list(range(a.n_gpus))
    beyond = learned_beyond(args) if check else None  # from the runs before this one
    from .calibrate.runs import end_engine_probe, recorded_engine_probe
    from .cli_vllm import command_of

    device = "cuda:0" if gpus else "cpu"
    run_id, result = recorded_engine_probe(
        args.db, device, run_context(m, est, device, command_of(args, verb)),
        lambda: run_llamacpp_probe(m.path, m.name, child_spec(m.path, a), est, gpus=gpus,
                                   interval_ms=getattr(args, "interval_ms", 5.0) or 5.0,
                                   new_tokens=getattr(args, "new_tokens", 16) or 16),
        lambda result: outcome_of(est, result))
    verdict = _verdict(args, est, result, beyond) if check else None
    if verdict:
        result.notes.append(verdict[1])
    io.out(json.dumps({**result.to_dict(), "run_id": run_id, "fits": verdict[0] if verdict else None})
           if args.json else present.llamacpp_probe_table(result, run_id))
    end_engine_probe(result)
    return 0 if result.status == "ok" and (verdict is None or verdict[0]) else 1


def _verdict(args, est, result, beyond) -> tuple[bool, str] | None:
    """``check --budget``: does the fullest device (each GPU's buffers and what llama.cpp holds beyond them; on a
    CPU-only run the host's) stay within the budget less --buffer? Without --budget, the run's own end decides."""
    from .calibrate.check import DEFAULT_BUFFER
    from .estimator.llamacpp.fit import gpu_totals, host_total
    from .units import fmt_gib_gb, size_option

    if getattr(args, "budget", None) in (None, "auto"):
        return None
    budget = size_option(args.budget, "--budget", above_zero=True)
    buffer = DEFAULT_BUFFER if args.buffer is None else size_option(args.buffer, "--buffer")
    totals = gpu_totals(est, beyond=beyond) if result.series != "rss" else {"CPU": host_total(est, beyond)}
    dev, need = max(totals.items(), key=lambda kv: kv[1], default=("-", 0))
    ok = need + buffer <= budget
    return ok, (f"{dev} needs {fmt_gib_gb(need)} + {fmt_gib_gb(buffer)} kept free: "
                f"{'fits' if ok else 'does not fit'} {fmt_gib_gb(budget)}")


def cmd_probe(args, io) -> int:
    return _probe(args, io, check=False)


def cmd_check(args, io) -> int:
    return _probe(args, io, check=True)


def _predicted(est, base: int | None) -> dict[str, int | None]:
    """Each stage as predicted: the buffers over the run's own baseline (on a CPU-only run, the child's
    resident set before loading; on a GPU, NVML's used memory, whose baseline the sampler subtracts)."""
    model_b = sum(est.model_buffer_bytes.values())
    context_b = model_b + sum(est.kv_buffer_bytes.values()) + sum(est.rs_buffer_bytes.values()) + \
        sum(est.compute_buffer_bytes.values()) + est.output_buffer_bytes
    predicted = {"baseline": base, "post_load": None if base is None else base + model_b}
    for k in ("context", "first_token", "end"):
        predicted[k] = None if base is None else base + context_b
    return predicted


def run_context(m, est, device: str, command: str):
    """The run as recorded before it starts, kept under the llama.cpp engine (``attn``/``quant_impl`` say
    llama.cpp, the estimator model is llama.cpp's)."""
    from .records.store import RunContext
    from .versions import VRAMCAL_VERSION

    quant = max(est.weight_types, key=est.weight_types.get) if est.weight_types else "gguf"
    estimate = {"mode": "llama.cpp", "stages": _predicted(est, None if device == "cpu" else 0),
                "llama_cpp": est.to_dict(), "model": est.model}
    return RunContext(model=m.name, quant=quant, ctx=est.n_ctx, batch=est.n_seq_max, device=device,
                      command=command, config_hash=None, quant_impl="llama.cpp", dtype=None, kv_dtype=None,
                      attn="llama.cpp", estimate=estimate, estimator_model=est.estimator_model,
                      vramcal_version=VRAMCAL_VERSION)


def outcome_of(est, result):
    """The probe's outcome: the buffers predicted and logged in its result, the sampled stages beside the
    prediction (on a CPU-only run, over the child's own baseline plus the buffers its pages touched)."""
    from .records.store import Outcome, StageRow

    base = (result.stages.get("baseline") or {}).get("used_bytes") if result.series == "rss" else 0
    predicted = _predicted(est, base)
    rows = [StageRow(name, predicted.get(name), r.get("peak_bytes"), r.get("used_bytes"))
            for name, r in result.stages.items()]
    return Outcome(status=result.status, last_stage=result.last_stage, error=result.error, series=result.series,
                   wall_s=result.wall_s, sampler_overhead=result.sampler_overhead, result=result.to_dict(),
                   stages=rows, samples=result.sample_rows())
