"""``trainer.compile``: torch.compile in place, and checkpoints that are the same whether the run
that wrote them was compiled or not (no ``_orig_mod.`` / ``module.`` in any key); a compiled run
resumes eagerly and an eager one compiled, exactly; ``cadence evaluate``, the sidecar, ``best/`` and
the exports read them unchanged. The backend is ``aot_eager`` (traced by dynamo and AOTAutograd,
run by eager kernels: numerically eager, so runs compare bit for bit) except in one test, which
compiles a tiny model with inductor on CPU."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from cadence.config import load_config
from cadence.config.schema import CompileConfig, TrainerConfig
from cadence.errors import CheckpointError, ConfigError
from cadence.summaries.metrics_file import read_metrics
from cadence.torch import Context, build_runners, export_model, load_exported, run_training
from cadence.torch.components.compile import CompileError, compile_model, compile_module, eager_forward, is_compiled
from cadence.torch.checkpoint_io.sharded import _reader, read_model_state
from cadence.torch.checkpoint_io.state import load_model_safetensors
from cli_run import checkpoint_weights, run_cadence, same_weights

sys.path.insert(0, str(Path(__file__).parents[1]))
from compile_tasks import BlockModel, GraphBreakTask, PrecompiledTask  # noqa: E402
from tasks import TinyTask  # noqa: E402

HERE = Path(__file__).parents[1]
TINY = f"{HERE / 'tasks.py'}:TinyTask"
AOT = {"backend": "aot_eager"}
CHECKPOINT_FILES = ("model.safetensors", "optimizer.safetensors")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each in-process test compiles afresh (dynamo's caches are per process, and bounded)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def write_config(path: Path, *, task: str = TINY, export: bool = False, **trainer) -> Path:
    """16 steps, checkpoints and validation every 8; ``export``: keep the best checkpoint and
    export it (safetensors, torch.export, TorchScript)."""
    cfg: dict = {"task": {"class": task, "params": {"n": 256}},
                 "trainer": {"train_steps": 16, "steps_per_loop": 4, "checkpoint_interval": 8, "validation_interval": 8,
                             "max_to_keep": None, "seed": 1, **trainer}}
    if export:
        cfg["trainer"]["best_checkpoint"] = {"metric": "accuracy"}
        cfg["export"] = {"formats": ["safetensors", "torch_export", "torchscript"], "on": "best"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_here(config: Path, model_dir: Path, *overrides: str) -> None:
    """Train in this process (``run_training``: what ``cadence train`` runs), for the eager
    references: no interpreter to start."""
    run_training(load_config(config, list(overrides), model_dir=str(model_dir)), progress=False)


def train(config: Path, model_dir: Path, *sets: str, nproc: int = 1) -> str:
    args = [a for s in sets for a in ("--set", s)]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    proc = run_cadence("train", str(config), "--model-dir", str(model_dir), "--no-progress", *args, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def checkpoint(model_dir: Path, step: int) -> Path:
    return model_dir / "checkpoints" / f"ckpt-{step}"


def assert_portable_keys(directory: Path) -> None:
    """No key of the checkpoint's model or optimizer file names a wrapper."""
    for name in CHECKPOINT_FILES:
        with safe_open(str(directory / name), "pt") as f:
            keys, metadata = list(f.keys()), json.dumps(f.metadata())
        assert keys
        assert not [k for k in keys if "_orig_mod" in k or k.startswith("module.")], (name, keys)
        assert "_orig_mod" not in metadata and '"module.' not in metadata


def same_files(a: Path, b: Path, names=CHECKPOINT_FILES) -> bool:
    return all((a / name).read_bytes() == (b / name).read_bytes() for name in names)


# -- the setting --------------------------------------------------------------------------------


def test_the_compile_setting_takes_true_false_or_a_mapping():
    assert TrainerConfig().compile is None  # off by default
    assert TrainerConfig(compile=False).compile is None
    assert TrainerConfig(compile=True).compile == CompileConfig()
    assert CompileConfig() == CompileConfig(backend="inductor", mode="default", fullgraph=False, dynamic=None)
    c = TrainerConfig(compile={"mode": "max-autotune", "fullgraph": True, "dynamic": False}).compile
    assert (c.backend, c.mode, c.fullgraph, c.dynamic) == ("inductor", "max-autotune", True, False)
    assert TrainerConfig(compile={"backend": "aot_eager"}).compile.backend == "aot_eager"


@pytest.mark.parametrize("override, message", [
    ("trainer.compile=1", "trainer.compile: expected true, false, a mapping {backend, mode, fullgraph, dynamic} or null, got 1"),
    ("trainer.compile=yes", "trainer.compile: expected true, false, a mapping"),
    ("trainer.compile={fullgraph: 1}", "trainer.compile.fullgraph: expected true or false, got 1"),
    ("trainer.compile={dynamic: 'no'}", "trainer.compile.dynamic: expected true or false or null, got 'no'"),
    ("trainer.compile={mode: fast}", "trainer.compile.mode: expected one of 'default', 'reduce-overhead'"),
    ("trainer.compile={backend: aot_eager, mode: max-autotune}",
     "mode 'max-autotune' is inductor's; backend 'aot_eager' takes no mode"),
    ("trainer.compile={backend: ''}", "trainer.compile.backend"),
    ("trainer.compile={full_graph: true}", "trainer.compile.full_graph: unknown field"),
])
def test_a_bad_compile_setting_is_a_one_line_config_error(tmp_path, override, message):
    config = write_config(tmp_path / "config.yaml")
    with pytest.raises(ConfigError) as caught:
        load_config(config, [override])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_an_unknown_backend_fails_before_anything_is_written(tmp_path):
    config = write_config(tmp_path / "config.yaml")
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress",
                       "--set", "trainer.compile={backend: no_such_backend}")
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "cadence: error" in line]
    assert errors == ["cadence: error: trainer.compile.backend: torch.compile has no backend 'no_such_backend' "
                      "(e.g. " + ", ".join(torch._dynamo.list_backends()) + ")"], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


# -- compiling in place -------------------------------------------------------------------------


def test_compiling_in_place_keeps_the_module_its_keys_and_its_numbers():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = TinyTask().build_model()
    model = copy.deepcopy(eager)
    compile_model(TinyTask(), model, CompileConfig(**AOT))
    assert type(model) is nn.Sequential and is_compiled(model)
    assert list(model.state_dict()) == list(eager.state_dict()) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    out = model(x)  # dropout: the same random numbers as eagerly
    torch.manual_seed(3)
    assert torch.equal(out, eager(x))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured the forward (nn.Sequential's own)
    # A copy (an export's CPU copy) runs its own parameters, not the original's.
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.zero_()
    clone.eval()
    assert is_compiled(clone) and torch.equal(clone(x), clone[3].bias.expand(4, 2))
    # the module's own forward for the duration, the compiled one after
    with eager_forward(model):
        assert not is_compiled(model)
    assert is_compiled(model)


class NestedUnitsTask(GraphBreakTask):
    def fsdp_units(self, model):
        return [model.blocks, model.blocks[0], model.blocks[2], model]  # nested units, and the root


def test_under_fsdp_each_innermost_unit_is_compiled_not_the_root():
    model = BlockModel()
    compile_model(NestedUnitsTask(), model, CompileConfig(**AOT), per_unit=True)
    assert [is_compiled(m) for m in (model, model.blocks, model.blocks[0], model.blocks[2])] == [False, False, True, True]


def test_a_compile_failure_names_the_model_and_how_to_turn_compilation_off():
    x = torch.randn(4, 8)
    model = BlockModel()  # its blocks break the graph
    compile_module(model, CompileConfig(backend="aot_eager", fullgraph=True))
    with pytest.raises(CompileError) as caught:
        model(x)  # training mode, with grad: the trainer's first step
    assert str(caught.value).startswith("compiling BlockModel failed (Unsupported: ")
    assert str(caught.value).endswith("): set trainer.compile: false to train eagerly")
    assert "\n" not in str(caught.value) and caught.value.exit_code == 2
    # a backend that fails to compile (torch's own test backend: it refuses torch.relu)
    model = ReluNet()
    compile_module(model, CompileConfig(backend="relu_compile_error_TESTING_ONLY"))
    with pytest.raises(CompileError, match=r"^compiling ReluNet failed \(ReluCompileError\): set trainer.compile"):
        model(x)


class ReluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def test_a_compile_failure_stops_cadence_train_with_one_line_and_exit_2(tmp_path):
    config = write_config(tmp_path / "config.yaml", task=f"{HERE / 'compile_tasks.py'}:GraphBreakTask",
                          compile={"backend": "aot_eager", "fullgraph": True})
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "cadence: error" in line]
    assert len(errors) == 1 and errors[0].startswith("cadence: error: compiling BlockModel failed (Unsupported: ")
    assert errors[0].endswith("set trainer.compile: false to train eagerly") and "Traceback" not in proc.stderr
    assert not list((tmp_path / "run" / "checkpoints").glob("ckpt-*"))


def test_exports_trace_the_eager_forward_of_a_compiled_model(tmp_path):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).eval()
    compile_module(model, CompileConfig(**AOT))
    x = torch.randn(4, 8)
    files = export_model(model, str(tmp_path / "export"), ["torch_export", "torchscript", "safetensors"],
                         example_inputs=(x,))
    assert is_compiled(model)  # given back its compiled forward
    with torch.no_grad():
        expected = model(x)
    assert torch.equal(load_exported(str(tmp_path / "export"), "torch_export")(x), expected)
    assert torch.equal(load_exported(str(tmp_path / "export"), "torchscript")(x), expected)
    assert same_weights(load_exported(str(tmp_path / "export"), "safetensors"), model.state_dict())
    assert set(files) == {"torch_export", "torchscript", "safetensors"}


# -- keys written through wrappers ----------------------------------------------------------------


def test_weights_saved_through_a_wrapper_by_another_tool_load_into_the_plain_model(tmp_path):
    torch.manual_seed(0)
    source = TinyTask().build_model()
    compiled = torch.compile(source, backend="aot_eager")  # keys: _orig_mod.0.weight, ...
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    for name, state in [("compiled", compiled.state_dict()),
                        ("ddp", {f"module.{k}": v for k, v in source.state_dict().items()}),
                        ("ddp-compiled", {f"module._orig_mod.{k}": v for k, v in source.state_dict().items()})]:
        path = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        target = TinyTask().build_model()
        load_model_safetensors(target, path.read_bytes())
        assert same_weights(target.state_dict(), source.state_dict()), name
    # a key that is not a wrapper's is still reported
    path = tmp_path / "other.safetensors"
    save_file({f"module.{k}": v for k, v in source.state_dict().items()} | {"extra": torch.zeros(1)}, str(path))
    with pytest.raises(CheckpointError, match="unexpected keys: extra"):
        load_model_safetensors(TinyTask().build_model(), path.read_bytes())


def test_a_task_that_returns_a_compiled_model_checkpoints_plain_keys(tmp_path):
    config = write_config(tmp_path / "config.yaml", task=f"{HERE / 'compile_tasks.py'}:PrecompiledTask", train_steps=4,
                          checkpoint_interval=4, validation_interval=4)
    run = tmp_path / "run"
    train_here(config, run)
    assert_portable_keys(checkpoint(run, 4))
    load_model_safetensors(TinyTask().build_model(), (checkpoint(run, 4) / "model.safetensors").read_bytes())  # strict
    # and trainer.compile on top of it is refused: compile in one place
    with pytest.raises(ConfigError, match="PrecompiledTask.build_model\\(\\) returns a torch.compile'd model"):
        build_runners(PrecompiledTask(), Context(), compile_config=CompileConfig(**AOT))


# -- end to end through the CLI ------------------------------------------------------------------

COMPILED = "trainer.compile={backend: aot_eager}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same config, 16 steps, checkpoints at 8 and 16: an eager run evaluating in process,
    keeping the best checkpoint and exporting it; a compiled (aot_eager) run that only trains, and
    a sidecar (``cadence evaluate --continuous``, compiled too) that evaluates its checkpoints,
    keeps the best and exports it."""
    root = tmp_path_factory.mktemp("compile-runs")
    config = write_config(root / "config.yaml", export=True)
    train_here(config, root / "eager")
    log = train(config, root / "compiled", COMPILED, "trainer.in_process_validation=false")
    proc = run_cadence("evaluate", str(config), "--model-dir", str(root / "compiled"), "--continuous",
                       "--set", COMPILED, "--set", "sidecar.timeout=60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return config, root / "eager", root / "compiled", log


def test_a_compiled_runs_checkpoints_are_an_eager_runs_and_the_sidecar_keeps_and_exports_the_best(runs):
    config, eager, compiled, log = runs
    assert "compiling Sequential with torch.compile (aot_eager)" in log
    assert load_config(compiled / "config.yaml").trainer.compile == CompileConfig(**AOT)
    for step in (8, 16):
        assert_portable_keys(checkpoint(compiled, step))
        assert same_files(checkpoint(compiled, step), checkpoint(eager, step))  # bit-identical
    # the sidecar's evaluations are the in-process ones of the eager run
    evaluated, in_process = read_metrics(compiled / "eval"), read_metrics(eager / "eval")
    assert [r["step"] for r in evaluated] == [8, 16]
    assert [(r["loss"], r["accuracy"]) for r in evaluated] == [(r["loss"], r["accuracy"]) for r in in_process]
    best = json.loads((compiled / "best" / "best.json").read_text())
    assert best["step"] == json.loads((eager / "best" / "best.json").read_text())["step"]
    assert same_files(compiled / "best" / f"ckpt-{best['step']}", checkpoint(eager, best["step"]))
    export, eager_export = (d / "export" / "best" / str(best["step"]) for d in (compiled, eager))
    assert (export / "model.safetensors").read_bytes() == (eager_export / "model.safetensors").read_bytes()
    model = TinyTask().build_model().eval()
    model.load_state_dict(load_exported(str(export), "safetensors"))
    x = TinyTask().example_inputs()[0]
    with torch.no_grad():
        expected = model(x)
    for fmt in ("torch_export", "torchscript"):  # traced from the eager forward, by the sidecar and the trainer
        assert torch.equal(load_exported(str(export), fmt)(x), expected)
        assert torch.equal(load_exported(str(eager_export), fmt)(x), expected)


def test_checkpoints_resume_exactly_compiled_to_eager_and_eager_to_compiled(runs, tmp_path):
    eager = runs[1]
    config = write_config(tmp_path / "config.yaml")  # the same training, without best/ and exports
    run = tmp_path / "run"  # compiled to 8, eager to 12, compiled to 16 (validating in process, compiled)
    train(config, run, "trainer.train_steps=8", COMPILED)
    train_here(config, run, "trainer.train_steps=12")  # eager, resumed from step 8
    assert json.loads((checkpoint(run, 12) / "state.json").read_text())["step"] == 12
    assert "restored checkpoint" in train(config, run, COMPILED)
    assert same_files(checkpoint(run, 16), checkpoint(eager, 16))  # as the uninterrupted eager run
    assert_portable_keys(checkpoint(run, 16))


def test_cadence_evaluate_reads_a_compiled_runs_checkpoint_eagerly(runs):
    config, _, compiled, _ = runs
    proc = run_cadence("evaluate", str(config), "--model-dir", str(compiled), "--checkpoint", "8",
                       "--set", "trainer.compile=false")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    evaluated = read_metrics(compiled / "eval")[0]
    assert evaluated["step"] == 8
    assert f"accuracy={evaluated['accuracy']:.4g}" in proc.stdout + proc.stderr


def test_inductor_compiles_a_tiny_model_on_cpu_and_its_checkpoint_resumes_eagerly(tmp_path):
    """One real inductor compile: C++ kernels generated and built on this machine. Their
    floating-point sums may round otherwise than ATen's, so the weights are compared closely, not
    bit for bit."""
    config = write_config(tmp_path / "config.yaml", task=f"{HERE / 'compile_tasks.py'}:PlainTask", train_steps=8,
                          steps_per_loop=4, checkpoint_interval=4, validation_interval=4)
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}  # a cold cache: really compiled here
    run, straight = tmp_path / "run", tmp_path / "straight"
    proc = run_cadence("train", str(config), "--model-dir", str(run), "--no-progress", "--set", "trainer.train_steps=4",
                       "--set", "trainer.compile=true", env=cache, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list((tmp_path / "inductor-cache").rglob("*.so"))  # kernels were built
    assert_portable_keys(checkpoint(run, 4))
    train_here(config, run)  # resumed eagerly
    train_here(config, straight)
    compiled_then_eager, eager = checkpoint_weights(checkpoint(run, 8)), checkpoint_weights(checkpoint(straight, 8))
    assert compiled_then_eager.keys() == eager.keys()
    for key, value in eager.items():
        assert torch.allclose(compiled_then_eager[key], value, rtol=1e-4, atol=1e-6), key


def test_on_two_ranks_ddp_compiles_the_model_and_fsdp_each_unit_and_their_checkpoints_are_eager_ones(tmp_path):
    """2 ranks (aot_eager): FSDP2 with each unit compiled before it is sharded, DDP with the model
    compiled before the wrap. The sharded checkpoint's keys are the plain model's, every rank's
    shard file is the eager FSDP run's, bit for bit, and so are the DDP run's weights (FSDP
    reduce-scatters the gradients DDP all-reduces: the same numbers on CPU, see test_fsdp.py); an
    eager run resumes from the sharded one (in one process: resharded)."""
    config = write_config(tmp_path / "config.yaml", strategy="fsdp", train_steps=8, validation_interval=None)
    run, eager, ddp = tmp_path / "run", tmp_path / "eager", tmp_path / "ddp"
    log = train(config, run, COMPILED, nproc=2)
    shown = " ".join(re.sub(r"\[rank\d+\]:", "", log).split())  # one line, whatever the console's width
    assert "compiling Sequential with torch.compile (aot_eager): its 2 FSDP units (Linear)" in shown, log
    train(config, eager, nproc=2)
    metadata = _reader(str(checkpoint(run, 8)), None).read_metadata()
    keys = list(metadata.state_dict_metadata)
    assert any(k.startswith("model.") for k in keys) and any(k.startswith("optimizer.") for k in keys)
    assert not [k for k in keys if "_orig_mod" in k or ".module." in k], keys
    assert sorted(read_model_state(str(checkpoint(run, 8)))) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    for shard in ("__0_0.distcp", "__1_0.distcp"):  # model and optimizer shards
        assert (checkpoint(run, 8) / shard).read_bytes() == (checkpoint(eager, 8) / shard).read_bytes()
    log = train(config, ddp, COMPILED, "trainer.strategy=ddp", nproc=2)
    shown = " ".join(re.sub(r"\[rank\d+\]:", "", log).split())
    assert "compiling Sequential with torch.compile (aot_eager): at its first forward" in shown, log
    assert_portable_keys(checkpoint(ddp, 8))
    assert same_weights(checkpoint_weights(checkpoint(ddp, 8)), checkpoint_weights(checkpoint(eager, 8)))
    train_here(config, run, "trainer.train_steps=12")  # eager, one process
    assert [r["step"] for r in read_metrics(run / "train")] == [4, 8, 12]  # continued from step 8
    assert sorted(checkpoint_weights(checkpoint(run, 12))) == sorted(read_model_state(str(checkpoint(run, 8))))


def test_the_compile_benchmark_runs_in_its_quick_mode(tmp_path, monkeypatch):
    """``benchmarks/loop/compile_speed.py --quick`` (aot_eager) end to end: eager and compiled train from
    the same weights on the same batches to the same loss, and the table renders. No timing is checked."""
    monkeypatch.syspath_prepend(str(HERE.parent))  # the checkout: the package `benchmarks`
    from benchmarks.loop import compile_speed

    result = compile_speed.run(quick=True, root=str(tmp_path))
    (process,) = result["processes"]
    assert process["eager"]["loss"] == process["compiled"]["loss"]  # aot_eager is numerically eager
    assert len(process["ratios"]) == result["windows"] and result["speedup"] > 0
    text = "\n".join(compile_speed.markdown_lines(result))
    assert "| 1 | aot_eager, cold cache |" in text and "Compiled / eager steps/s" in text
    assert result["warm_first_step"] is None and "warm cache" not in text  # aot_eager keeps no cache to warm
    assert list(tmp_path.iterdir()) == []
