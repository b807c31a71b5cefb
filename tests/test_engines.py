"""The engine registry (vramcal/engines.py): every entry's parts resolve, commands reach an engine only
through it, and each engine's flags are refused under another."""

from __future__ import annotations

import pytest

from vramcal.cli import build_parser, main
from vramcal.engines import COMMANDS, ENGINES, _resolve, engine_named


def test_every_entry_names_parts_that_exist():
    assert set(ENGINES) == {"transformers", "vllm", "llama.cpp"}
    for e in ENGINES.values():
        for command, ref in e.handlers.items():
            assert command in COMMANDS and callable(_resolve(ref)), (e.name, command)
        for ref in (e.add_flags, e.flags_used, e.log_parser):
            if ref:
                assert callable(_resolve(ref)), (e.name, ref)
        assert e.corrections_key and e.device_default and e.launch


def test_aliases_and_unknown_names():
    assert engine_named("LLAMACPP").name == "llama.cpp" and engine_named(None).name == "transformers"
    with pytest.raises(Exception, match="unknown --engine 'sglang'"):
        engine_named("sglang")


def test_commands_do_not_name_an_engine():
    """cli.py's command bodies dispatch through the registry: no `== "vllm"` branch is left."""
    import inspect

    import vramcal.cli as cli
    import vramcal.cli_plan as cli_plan

    for mod in (cli, cli_plan):
        src = inspect.getsource(mod)
        assert 'engine_choice' not in src and '== "vllm"' not in src


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "x.gguf", "-ngl", "99"], "belongs to --engine llama.cpp"),
    (["estimate", "x.gguf", "--engine", "llama.cpp", "--max-num-seqs", "4"], "belongs to --engine vllm"),
    (["estimate", "x.gguf", "--engine", "llama.cpp", "--quant", "nf4"], "--engine llama.cpp does not use --quant"),
    (["plan", "x.gguf", "-ngl", "99", "--hardware", "cuda:0=24GiB"], "belongs to --engine llama.cpp"),
])
def test_flags_of_another_engine_are_one_line_and_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err, err


def test_llamacpp_flags_in_llamas_spellings():
    a = build_parser().parse_args(["estimate", "m.gguf", "--engine", "llama.cpp", "-c", "8192", "-ngl", "99",
                                   "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-np", "4", "-kvu", "-ub", "256",
                                   "-ts", "3,1", "-ot", "exps=CPU", "--n-cpu-moe", "2", "--no-mmap"])
    assert (a.ctx_size, a.n_gpu_layers, a.cache_type_k, a.flash_attn, a.parallel, a.kv_unified, a.ubatch_size,
            a.tensor_split, a.override_tensor, a.n_cpu_moe, a.no_mmap) == \
        (8192, "99", "q8_0", "on", 4, True, 256, "3,1", ["exps=CPU"], 2, True)


@pytest.mark.parametrize("raised,status", [(RuntimeError("the child could not start"), "error"),
                                           (KeyboardInterrupt(), "interrupted")])
def test_an_engine_probe_that_raises_still_closes_its_run(tmp_path, raised, status):
    """Every engine probe goes record -> child -> record through one step (calibrate/runs.py): a probe that
    raises instead of returning a result leaves its run closed with the error, not open forever."""
    from vramcal.calibrate.runs import recorded_engine_probe
    from vramcal.records.store import RunContext, Store

    db = str(tmp_path / "runs.db")
    ctx = RunContext(model="m", quant="Q4_K_M", ctx=256, batch=1, device="cpu", command="vramcal probe m")

    def probe():
        raise raised

    with pytest.raises(type(raised)):
        recorded_engine_probe(db, "cpu", ctx, probe, lambda result: pytest.fail("no result to record"))
    with Store(db) as store:
        (row,) = store.runs()
        run = store.run(row["id"])
    assert run.status == status and run.outcome is not None
    assert status == "interrupted" or "RuntimeError: the child could not start" in run.outcome.error
