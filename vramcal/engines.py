"""The engines vramcal speaks for, as one registry (part of the command line, like :mod:`vramcal.cli`;
nothing below the command line imports it).

An :class:`Engine` names everything a command needs from an engine: its flags in the engine's own
spellings, the handler of each command (``estimate``, ``probe``, ``check``, ``fit``, ``plan``), its device
default, how it is launched, its probe child and log parser, what fit and plan search, and the key its
corrections are kept under. :data:`ENGINES` maps ``transformers``, ``vllm`` and ``llama.cpp`` to one each;
commands ask :func:`engine_for` and call the entry, never naming an engine (as transformers'
``quantizers/auto.py`` maps a ``quant_method`` to one class, and loading calls its hooks).

Handlers and flag builders are named ``"module:function"`` and imported when used, as transformers'
auto mappings name their classes: ``vramcal --help`` stays light, and an engine's heavy parts (vLLM's
layout, llama.cpp's GGUF reader) are imported only by the command that uses them. Each engine's code
lives in files named after it: ``cli_vllm.py``, ``estimator/vllm/``, ``probes/vllm_*``;
``cli_llamacpp.py``, ``estimator/llamacpp/``, ``probes/llamacpp_*``; transformers' handlers are the
command bodies of :mod:`vramcal.cli`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from .errors import UserError

COMMANDS = ("estimate", "probe", "check", "fit", "plan")


def _resolve(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module, __package__), name)


@dataclass(frozen=True)
class Io:
    """What a handler writes through: ``out(text)`` for stdout, ``progress()`` for the progress lines of a
    slow first estimate (None when nobody watches)."""

    out: Callable[[str], None]
    progress: Callable[[], object] = lambda: None


@dataclass(frozen=True)
class Engine:
    name: str
    aliases: tuple[str, ...]
    summary: str  # what --engine NAME predicts, for --help
    handlers: dict[str, str]  # command -> "module:function(args, io) -> int"
    add_flags: str | None  # "module:function(parser, command)": its own flags, in its own spellings
    flags_used: str | None  # "module:function(args) -> [flag, ...]": those given (refused under another engine)
    device_default: str  # the device an estimate is for when --device is not given
    launch: str  # what runs it: the command or code the estimate describes
    probe_child: str | None  # the module a probe runs as its child
    log_parser: str | None  # "module:function(text)": the engine's startup log, read back
    search_space: tuple[str, ...] = ()  # what fit / plan vary
    corrections_key: str = ""  # runs and corrections are kept per engine under this key
    notes: dict[str, str] = field(default_factory=dict)

    def handler(self, command: str) -> Callable:
        ref = self.handlers.get(command)
        if ref is None:
            raise UserError(f"`vramcal {command} --engine {self.name}` is not built yet: "
                            f"{', '.join(c for c in COMMANDS if c in self.handlers)} are")
        return _resolve(ref)

    def run(self, command: str, args, io: Io) -> int:
        return self.handler(command)(args, io)

    def given_flags(self, args) -> list[str]:
        return _resolve(self.flags_used)(args) if self.flags_used else []


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine(
        name="transformers", aliases=("hf",),
        summary="from_pretrained + generate, per stage (the default)",
        handlers={"estimate": ".cli:estimate_transformers", "probe": ".cli:probe_transformers",
                  "check": ".cli:check_transformers", "fit": ".cli:fit_transformers",
                  "plan": ".cli_plan:plan_transformers"},
        add_flags=None, flags_used=None,  # its flags are the commands' own (--quant, --ctx, --batch ...)
        device_default="cuda", launch="transformers AutoModelForCausalLM.from_pretrained(...) + generate",
        probe_child=".probes.child", log_parser=None,
        search_space=("quant", "batch", "ctx", "kv_dtype", "offload"), corrections_key="transformers"),
    Engine(
        name="vllm", aliases=(),
        summary="what `vllm serve` logs at startup (docs/vllm.md)",
        handlers={"estimate": ".engines:_vllm_estimate", "probe": ".engines:_vllm_probe",
                  "check": ".engines:_vllm_check", "fit": ".engines:_vllm_fit", "plan": ".cli_plan:plan_vllm_cmd"},
        add_flags=".engines:_vllm_flags", flags_used=".cli_vllm:vllm_flags_used",
        device_default="cuda", launch="vllm serve MODEL ...", probe_child=".probes.vllm_child",
        log_parser=".estimator.vllm.logparse:parse_log",
        search_space=("tensor_parallel_size", "max_model_len", "gpu_memory_utilization", "kv_cache_dtype"),
        corrections_key="vllm"),
    Engine(
        name="llama.cpp", aliases=("llamacpp", "llama-cpp", "gguf"),
        summary="the buffers llama.cpp logs loading a GGUF (docs/llamacpp.md)",
        handlers={"estimate": ".cli_llamacpp:cmd_estimate", "probe": ".cli_llamacpp:cmd_probe",
                  "check": ".cli_llamacpp:cmd_check", "fit": ".cli_llamacpp:cmd_fit", "plan": ".cli_llamacpp:cmd_plan"},
        add_flags=".cli_llamacpp:add_flags", flags_used=".cli_llamacpp:flags_used",
        device_default="cuda", launch="llama-server -m FILE.gguf ...", probe_child=".probes.llamacpp_child",
        log_parser=".estimator.llamacpp.logparse:parse_log",
        search_space=("file", "ctx_size", "n_gpu_layers", "n_cpu_moe", "tensor_split", "cache_type_k", "cache_type_v"),
        corrections_key="llama.cpp"),
)}


def engine_named(text: str | None) -> Engine:
    """The engine ``--engine TEXT`` names (its name or an alias, any case); one line on an unknown one."""
    key = (text or "transformers").lower()
    for e in ENGINES.values():
        if key == e.name or key in e.aliases:
            return e
    raise UserError(f"unknown --engine {text!r}: choose one of {', '.join(ENGINES)}")


def engine_for(args) -> Engine:
    """The engine of a parsed command line, with every other engine's flags refused: a flag that means
    nothing to the engine chosen is said, not ignored."""
    engine = engine_named(getattr(args, "engine", None))
    for other in ENGINES.values():
        if other is engine:
            continue
        used = other.given_flags(args)
        if used:
            raise UserError(f"{', '.join(used)} belong{'s' * (len(used) == 1)} to --engine {other.name}: add "
                            f"--engine {other.name}, or drop them")
    return engine


def add_engine_flags(p, command: str) -> None:
    """``--engine`` and every engine's own flags, for one command's parser."""
    names = " | ".join(ENGINES)
    p.add_argument("--engine", default="transformers",
                   help=f"{names}: " + "; ".join(f"{e.name}: {e.summary}" for e in ENGINES.values()))
    for e in ENGINES.values():
        if e.add_flags:
            _resolve(e.add_flags)(p, command)


# ---- vLLM: its handlers as they were, behind the entry (cli_vllm.py holds them)

def _vllm_flags(p, command: str) -> None:
    from .cli_vllm import add_vllm_args

    if command == "fit":
        p.add_argument("--dtype", default=None, help="--engine vllm: auto | bfloat16 | float16 | float32")
    add_vllm_args(p, fit=command == "fit")


def _vllm_estimate(args, io: Io) -> int:
    from .cli_vllm import cmd_estimate_vllm

    return cmd_estimate_vllm(args, io.out, io.progress())


def _vllm_probe(args, io: Io) -> int:
    from .cli_vllm import cmd_probe_vllm

    return cmd_probe_vllm(args, io.out, check=False)


def _vllm_check(args, io: Io) -> int:
    from .cli_vllm import cmd_probe_vllm

    return cmd_probe_vllm(args, io.out, check=True)


def _vllm_fit(args, io: Io) -> int:
    from .cli_vllm import cmd_fit_vllm

    return cmd_fit_vllm(args, io.out)
