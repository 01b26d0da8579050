"""``trainer.ema``: an exponential moving average of the weights (cadence.torch.components.ema.ModelEMA).

The average against a hand computation and torch.optim.swa_utils; the swap in and out of the
model; the EMA in every checkpoint (``ema.safetensors``; DCP shards under FSDP) and its exact
resume, also through an asynchronous save and a SIGKILL; evaluations (in-process, the sidecar,
``cadence evaluate``) reporting the EMA model's metrics under the plain names and the raw model's
as ``raw/<name>``; ``best/``'s export and ``cadence export`` of the EMA weights; a 2-rank FSDP run
whose EMA is sharded like the parameters; the config's errors.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from cadence import Callback, Controller
from cadence.checkpoint.files import MemoryWriter
from cadence.config import config_from_dict
from cadence.errors import ConfigError, SanityCheckError
from cadence.summaries.metrics_file import read_metrics
from cadence.torch import Context, TorchEvaluator, build_runners, run_evaluation, run_sidecar, run_training
from cadence.torch.runtime.rng import seed_everything
from cadence.torch.experiments.experiment import run_export
from cadence.config.components.ema import EMAConfig
from cadence.torch.components.ema import ModelEMA
from cadence.torch.checkpoint_io.safetensors_io import safetensors_metadata, state_dict_from_safetensors
from cadence.torch.checkpoint_io.sharded import read_model_state
from cli_run import popen, run_cadence, run_torchrun, same_weights
from tasks import TinyTask
from in_memory import save

HERE = Path(__file__).resolve().parents[1]
TASKS = HERE / "tasks.py"
WORKER = HERE / "ema_fsdp_worker.py"
STEPS = 24  # checkpoints (and evaluations) at 8, 16, 24
EMA = {"decay": 0.9}


# -- a model with tied weights and BatchNorm buffers ---------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight  # tied: one tensor under two names
        self.bn = nn.BatchNorm1d(8)  # float buffers (averaged) and num_batches_tracked (the model's)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.b(torch.relu(self.a(x)))))


class TiedTask(TinyTask):
    def build_model(self) -> nn.Module:
        return Tied()


def runners(task: TinyTask, *callbacks: Callback, **settings):
    """A trainer with an EMA and its evaluator; the EMA (then ``callbacks``) registered with a
    controller, so that each ``trainer.train`` updates it."""
    seed_everything(0)
    trainer, evaluator = build_runners(task, Context.create("cpu", seed=0), ema=EMAConfig(**settings))
    assert trainer is not None and evaluator is not None and trainer.ema is not None
    trainer.initialize()
    Controller(trainer, callbacks=[trainer.ema, *callbacks], steps_per_loop=1, restore=False, progress=False)
    return trainer, evaluator


def float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.is_floating_point()}


# -- the average ---------------------------------------------------------------------------------


@pytest.mark.parametrize("decay, start_step, every_n_steps", [(0.9, 0, 1), (0.8, 3, 1), (0.7, 4, 3)],
                         ids=["every-step", "start-3", "every-3-start-4"])
def test_the_ema_is_the_hand_computed_average_of_the_weights(decay, start_step, every_n_steps):
    weights: list[dict[str, torch.Tensor]] = []  # the initial weights, then after each step
    averages = []

    class Record(Callback):
        def on_train_step_end(self, run, step: int) -> None:  # runs after the EMA's update (registered first)
            assert run.trainer is trainer and step == len(weights)
            weights.append(float_state(trainer.model))
            averages.append({k: v.clone() for k, v in ema.averaged_state().items() if v.is_floating_point()})

    trainer, _ = runners(TiedTask(), Record(), decay=decay, start_step=start_step, every_n_steps=every_n_steps)
    assert trainer.ema is not None
    ema = trainer.ema
    weights.append(float_state(trainer.model))
    trainer.train(10)
    expected = {k: v.double() for k, v in weights[0].items()}
    for step in range(1, 11):
        w = weights[step]
        if step % every_n_steps == 0:
            if step <= start_step:  # a copy, exactly
                assert all(torch.equal(averages[step - 1][k], w[k]) for k in w), step
                expected = {k: v.double() for k, v in w.items()}
            else:
                expected = {k: decay * expected[k] + (1 - decay) * w[k].double() for k in w}
        for k in w:
            assert torch.allclose(averages[step - 1][k].double(), expected[k], rtol=1e-6, atol=1e-7), (step, k)
    # the EMA is not the weights (it lags them), and the tied names share one tensor
    assert any(not torch.equal(averages[-1][k], weights[-1][k]) for k in weights[-1])
    state = ema.averaged_state()
    assert state["a.weight"] is state["b.weight"]
    counter = trainer.model.bn.num_batches_tracked  # not averaged: the model's own tensor
    assert state["bn.num_batches_tracked"].data_ptr() == counter.data_ptr() and int(counter) == 10


def test_the_update_is_bit_identical_to_swa_utils_averaged_model():
    trainer, _ = runners(TiedTask(), decay=0.95)
    reference = AveragedModel(copy.deepcopy(trainer.model), multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=True)
    reference.update_parameters(trainer.model)  # its first update copies: W_0 = the initial weights
    for _ in range(6):
        trainer.train(1)
        reference.update_parameters(trainer.model)
    averaged = trainer.ema.averaged_state()
    for key, value in float_state(reference.module).items():
        assert torch.equal(averaged[key], value), key


def test_applied_swaps_the_ema_in_and_the_raw_weights_back_bit_for_bit_even_on_an_error():
    trainer, _ = runners(TiedTask(), decay=0.5)
    trainer.train(4)
    model, ema = trainer.model, trainer.ema
    raw = float_state(model)
    averaged = {k: v.clone() for k, v in ema.averaged_state().items() if v.is_floating_point()}
    with ema.applied():
        assert all(torch.equal(model.state_dict()[k], averaged[k]) for k in averaged)
        assert model.b.weight is model.a.weight  # the same parameters, their values swapped
    assert all(torch.equal(model.state_dict()[k], raw[k]) for k in raw)
    with pytest.raises(RuntimeError, match="boom"), ema.applied():
        raise RuntimeError("boom")
    assert all(torch.equal(model.state_dict()[k], raw[k]) for k in raw)
    assert all(torch.equal(ema.averaged_state()[k], averaged[k]) for k in averaged)


def test_an_ema_that_no_controller_updates_is_refused_by_the_trainer():
    seed_everything(0)
    trainer, _ = build_runners(TinyTask(), Context.create("cpu", seed=0), ema=EMAConfig(decay=0.9), evaluate=False)
    assert trainer is not None
    with pytest.raises(RuntimeError, match=r"pass trainer.ema in the controller's callbacks"):
        trainer.train(1)
    Controller(trainer, callbacks=[trainer.ema], steps_per_loop=1, restore=False, progress=False)
    trainer.train(1)
    assert trainer.global_step == 1


def test_bad_settings_are_value_errors():
    model = nn.Linear(2, 2)
    for kwargs, message in [({"decay": 1.0}, "decay must be > 0 and < 1"), ({"decay": 0.0}, "decay"),
                            ({"start_step": -1}, "start_step must be >= 0"),
                            ({"every_n_steps": 0}, "every_n_steps must be >= 1")]:
        with pytest.raises(ValueError, match=message):
            ModelEMA(model, EMAConfig(**kwargs))


# -- checkpoints, in memory ----------------------------------------------------------------------


def test_the_checkpoint_holds_the_ema_beside_the_model_with_the_same_keys_and_restores_it():
    trainer, _ = runners(TiedTask(), decay=0.8)
    trainer.train(5)
    reader, state = save(trainer)
    assert sorted(reader.files) == ["ema.safetensors", "model.safetensors", "optimizer.safetensors"]
    ema_file = state_dict_from_safetensors(reader.files["ema.safetensors"])  # aliases filled in
    model_file = state_dict_from_safetensors(reader.files["model.safetensors"])
    assert ema_file.keys() == model_file.keys() == trainer.model.state_dict().keys()
    assert json.loads(safetensors_metadata(reader.files["ema.safetensors"])["cadence.aliases"]) == {"b.weight": "a.weight"}
    restored, _ = runners(TiedTask(), decay=0.8)
    restored.train(1)  # moved away: the load must put everything back
    restored.load_checkpoint(reader, state)
    for key, value in trainer.ema.averaged_state().items():
        assert torch.equal(restored.ema.averaged_state()[key], value), key
    assert restored.ema.averaged_state()["a.weight"] is restored.ema.averaged_state()["b.weight"]
    # both go on exactly as the original
    trainer.train(3)
    restored.train(3)
    assert save(trainer)[0].files == save(restored)[0].files


def test_an_asynchronous_snapshot_holds_the_ema_of_its_step():
    trainer, _ = runners(TiedTask(), decay=0.8)
    trainer.train(2)
    expected, _ = save(trainer)
    snapshot = trainer.snapshot_checkpoint()
    trainer.train(3)  # the EMA moves on
    writer = MemoryWriter(2)
    snapshot.save_checkpoint(writer)
    assert writer.files["ema.safetensors"] == expected.files["ema.safetensors"]
    assert writer.files["ema.safetensors"] != save(trainer)[0].files["ema.safetensors"]


def test_a_checkpoint_without_an_ema_starts_it_from_its_weights_and_ema_off_ignores_one(caplog):
    plain_trainer, _ = build_runners(TiedTask(), Context.create("cpu", seed=0))
    plain_trainer.initialize()
    plain_trainer.train(3)
    reader, state = save(plain_trainer)
    assert "ema.safetensors" not in reader.files
    trainer, _ = runners(TiedTask(), decay=0.8)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        trainer.load_checkpoint(reader, state)
    assert "holds no EMA of the weights" in caplog.text
    model_state = plain_trainer.model.state_dict()
    for key, value in trainer.ema.averaged_state().items():
        assert torch.equal(value, model_state[key]), key
    # EMA off: a checkpoint with one loads (its EMA is not read)
    with_ema, _ = save(trainer)
    off, _ = build_runners(TiedTask(), Context.create("cpu", seed=0))
    off.load_checkpoint(with_ema, state)
    assert same_weights(off.model.state_dict(), trainer.model.state_dict())


def test_an_export_with_signatures_holds_the_ema_weights_under_the_same_names(tmp_path):
    from cadence.torch import load_exported
    from cadence.torch.experiments.exporting import ModelExporter
    from cadence.torch.experiments.task_loader import load_task_class

    task = load_task_class(f"{HERE / 'signature_tasks.py'}:SignatureTask")()
    model = task.build_model()
    ema = ModelEMA(model, EMAConfig(decay=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the raw weights move away from the EMA
    raw, averaged = float_state(model), {k: v.clone() for k, v in ema.averaged_state().items()}
    cfg = config_from_dict({"task": {"class": f"{HERE / 'signature_tasks.py'}:SignatureTask"},
                            "export": {"formats": ["safetensors", "torchscript"], "on": "every_eval"}},
                           model_dir=str(tmp_path / "run"))
    plain_dir = Path(ModelExporter(cfg, task, model, "plain")(10, {}))
    directory = Path(ModelExporter(cfg, task, model, "every_eval", ema=ema)(10, {}))
    assert sorted(os.listdir(directory)) == sorted(os.listdir(plain_dir))  # the same signatures, files and names
    for name in ("logits", "probs", "margin"):
        state = load_exported(str(directory / name), "safetensors")
        assert state.keys() == load_exported(str(plain_dir / name), "safetensors").keys()
        assert same_weights(state, averaged)
    assert same_weights(load_exported(str(directory / "features"), "safetensors"),
                        {k: v for k, v in averaged.items() if k.startswith("0.")})
    x = task.val_set.tensors[0][:4]
    scripted = load_exported(str(directory / "logits"), "torchscript")
    with torch.no_grad(), ema.applied():
        expected = model.eval()(x)
    torch.testing.assert_close(scripted(x), expected, rtol=0, atol=0)
    assert same_weights(float_state(model), raw)  # the live model keeps its raw weights


# -- whole runs ----------------------------------------------------------------------------------


def config(model_dir: Path, *overrides: str, ema: dict | None = EMA, **trainer):
    data = {"task": {"class": f"{TASKS}:TinyTask", "params": {"n": 256}},
            "trainer": {"train_steps": STEPS, "steps_per_loop": 4, "checkpoint_interval": 8, "validation_interval": 8,
                        "max_to_keep": None, "seed": 1, "ema": ema,
                        "best_checkpoint": {"metric": "loss", "higher_is_better": False},
                        # the raw model's metric, checked by the sanity check before training
                        "early_stopping": {"metric": "raw/loss", "patience": 100, "higher_is_better": False},
                        **trainer},
            "export": {"formats": ["safetensors"], "on": "best"}}
    return config_from_dict(data, overrides, model_dir=str(model_dir))


def write_config(tmp_path: Path, *overrides: str, **trainer) -> Path:
    import yaml

    cfg = config(tmp_path / "unused", *overrides, **trainer)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True, exclude={"model_dir"})))
    return path


def ckpt(model_dir: Path, step: int) -> Path:
    return model_dir / "checkpoints" / f"ckpt-{step}"


def evals(model_dir: Path, name: str = "eval") -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k not in ("step", "time")} for r in read_metrics(model_dir / name)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The model dir of an uninterrupted run with an EMA (decay 0.9) to step 24; not changed by tests."""
    model_dir = tmp_path_factory.mktemp("reference") / "run"
    run_training(config(model_dir), progress=False)
    assert sorted(evals(model_dir)) == [8, 16, 24]
    return model_dir


def evaluate_by_hand(weights: Path) -> dict:
    """TinyTask's validation metrics of a plain model loaded with the file ``weights`` (no EMA)."""
    task = TinyTask(n=256)
    model = task.build_model()
    model.load_state_dict(load_file(weights))
    return TorchEvaluator(task, model, ctx=Context.create("cpu", seed=1)).evaluate()


def test_evaluations_report_the_ema_models_metrics_and_the_raw_models_under_raw(reference):
    for step, metrics in evals(reference).items():
        assert sorted(metrics) == ["accuracy", "loss", "raw/accuracy", "raw/loss"]
        ema_metrics = evaluate_by_hand(ckpt(reference, step) / "ema.safetensors")
        raw_metrics = evaluate_by_hand(ckpt(reference, step) / "model.safetensors")
        assert {k: metrics[k] for k in ("loss", "accuracy")} == ema_metrics, step
        assert {k: metrics[f"raw/{k}"] for k in ("loss", "accuracy")} == raw_metrics, step
        assert metrics["loss"] != metrics["raw/loss"]  # the two models differ
    # best/ chose by the EMA model's loss (the plain name)
    best = json.loads((reference / "best" / "best.json").read_text())
    assert best["value"] == min(m["loss"] for m in evals(reference).values())


def test_best_and_its_export_hold_the_ema_weights_under_the_models_names(reference):
    step = json.loads((reference / "best" / "best.json").read_text())["step"]
    best = reference / "best" / f"ckpt-{step}"
    assert (best / "ema.safetensors").read_bytes() == (ckpt(reference, step) / "ema.safetensors").read_bytes()
    exported = load_file(reference / "export" / "best" / str(step) / "model.safetensors")
    ema, raw = load_file(best / "ema.safetensors"), load_file(best / "model.safetensors")
    assert exported.keys() == raw.keys()
    assert same_weights(exported, ema) and not same_weights(exported, raw)


def test_cadence_export_and_evaluate_use_the_ema(reference, tmp_path):
    run_export(str(reference), ["safetensors"], checkpoint="16", out=str(tmp_path / "out"))  # cadence export's
    assert same_weights(load_file(tmp_path / "out" / "model.safetensors"), load_file(ckpt(reference, 16) / "ema.safetensors"))
    proc = run_cadence("evaluate", str(write_config(tmp_path)), "--model-dir", str(reference), "--checkpoint", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == {"step": 16, **evals(reference)[16]}


def test_the_sidecar_reports_the_same_metrics(reference, tmp_path):
    model_dir = tmp_path / "run"
    shutil.copytree(reference, model_dir)
    result = run_sidecar(config(model_dir, "sidecar.name=side", "sidecar.timeout=5", early_stopping=None))
    assert result.evaluated == [8, 16, STEPS] and result.stop_reason == "final", result
    assert evals(model_dir, "eval_side") == evals(reference)


def test_an_ema_run_resumed_from_a_checkpoint_ends_bit_identical(reference, tmp_path):
    model_dir = tmp_path / "run"
    run_training(config(model_dir, "trainer.train_steps=12"), progress=False)
    run_training(config(model_dir), progress=False)  # from the final checkpoint at 12
    for name in ("model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        assert (ckpt(model_dir, STEPS) / name).read_bytes() == (ckpt(reference, STEPS) / name).read_bytes(), name
    assert evals(model_dir)[STEPS] == evals(reference)[STEPS]


def test_a_run_killed_with_sigkill_during_a_pipelined_save_resumes_bit_identical(reference, tmp_path):
    """Pipelined asynchronous saves whose copy is slowed down (each tensor's copy waits 30 ms first:
    the copy of step 8's state is still in flight at the next optimizer steps, training waits for it
    there); the run is killed while step 16's copy is in flight."""
    config_file = write_config(tmp_path, "checkpoint.async_save=true", f"task.class={TASKS}:SlowStagingTask",
                               "task.params.staging_delay=0.3")
    model_dir = tmp_path / "run"
    job = popen(
        ["-m", "cadence", "train", str(config_file), "--model-dir", str(model_dir), "--no-progress",
         "--set", "task.params.step_sleep=0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not list((model_dir / "checkpoints").glob("ckpt-16.tmp-*")):  # step 16's commit has begun
            assert job.poll() is None and time.monotonic() < deadline, "no save at step 16"
            time.sleep(0.005)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert (ckpt(model_dir, 8) / "MANIFEST.json").exists() and not ckpt(model_dir, 16).exists()
    # the asynchronous save captured the EMA of its step
    assert (ckpt(model_dir, 8) / "ema.safetensors").read_bytes() == (ckpt(reference, 8) / "ema.safetensors").read_bytes()
    run_training(config(model_dir, "checkpoint.async_save=true"), progress=False)
    for name in ("model.safetensors", "ema.safetensors"):
        assert (ckpt(model_dir, STEPS) / name).read_bytes() == (ckpt(reference, STEPS) / name).read_bytes(), name


def test_an_ema_checkpoint_resumed_with_ema_off_ignores_it_and_training_is_unchanged(reference, tmp_path):
    model_dir = tmp_path / "run"
    run_training(config(model_dir, "trainer.train_steps=8"), progress=False)
    run_training(config(model_dir, ema=None, early_stopping=None), progress=False)
    assert not (ckpt(model_dir, STEPS) / "ema.safetensors").exists()
    assert sorted(evals(model_dir)[STEPS]) == ["accuracy", "loss"]  # the raw model's, under the plain names
    # the EMA never changed the training: the weights are the EMA run's
    final = "model.safetensors"
    assert (ckpt(model_dir, STEPS) / final).read_bytes() == (ckpt(reference, STEPS) / final).read_bytes()
    raw = {k[len("raw/"):]: v for k, v in evals(reference)[STEPS].items() if k.startswith("raw/")}
    assert evals(model_dir)[STEPS] == raw


def test_a_checkpoint_without_an_ema_resumed_with_one_starts_it_from_its_weights(tmp_path, caplog):
    model_dir = tmp_path / "run"
    run_training(config(model_dir, "trainer.train_steps=8", ema=None, early_stopping=None), progress=False)
    with caplog.at_level(logging.WARNING, logger="cadence"):
        run_training(config(model_dir, ema={"decay": 0.9, "every_n_steps": 1000}), progress=False)
    assert "holds no EMA of the weights" in caplog.text
    # no update since (every 1000 steps): the EMA is still the weights of step 8
    ema, weights = load_file(ckpt(model_dir, STEPS) / "ema.safetensors"), load_file(ckpt(model_dir, 8) / "model.safetensors")
    assert same_weights(ema, weights)


# -- the config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("trainer.ema.decay=1.0", "trainer.ema.decay"),
    ("trainer.ema.decay=0", "trainer.ema.decay"),
    ("trainer.ema.start_step=-1", "trainer.ema.start_step"),
    ("trainer.ema.every_n_steps=0", "trainer.ema.every_n_steps"),
    ("trainer.ema.evaluate_raw=yes", "trainer.ema.evaluate_raw"),
    ("trainer.ema.bogus=1", "trainer.ema.bogus"),
])
def test_bad_ema_settings_are_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        config(tmp_path, override)


def test_a_bad_ema_setting_exits_2_with_one_line_and_nothing_written(tmp_path):
    proc = run_cadence("train", str(write_config(tmp_path)), "--model-dir", str(tmp_path / "run"),
                       "--set", "trainer.ema.decay=1.5")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trainer.ema.decay" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_sanity_check_names_a_raw_metric_that_is_not_evaluated(tmp_path):
    cfg = config(tmp_path / "run", ema={"decay": 0.9, "evaluate_raw": False})
    expected = "metric 'raw/loss' is not in the evaluation outputs; available: 'accuracy', 'loss'"
    with pytest.raises(SanityCheckError, match=expected):
        run_training(cfg, progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/ckpt-*"))  # not a step trained


# -- FSDP on 2 ranks -----------------------------------------------------------------------------


def test_under_fsdp_each_ranks_ema_is_sharded_like_the_parameters(tmp_path):
    proc = run_torchrun(2, str(WORKER), str(tmp_path), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["params_are_dtensors"] and res["placed_as_params"], res
        assert res["local_numel"] * 2 == res["full_numel"]  # half of every parameter on each rank
        assert "1.running_mean" in res["ema_keys"] and "1.num_batches_tracked" in res["ema_keys"]
        assert res["ema_max_diff"] == 0.0 and res["ema_differs_from_weights"]  # the unsharded model's EMA
        assert res["applied_is_ema"] and res["raw_back"] and res["ema_back"] and res["raw_back_after_eval"]
        sharded, plain = res["eval"]
        assert sharded == plain and sharded["loss"] != sharded["raw/loss"]


def test_an_fsdp_ema_run_checkpoints_its_shards_and_resumes_bit_identical(tmp_path):
    config_file = write_config(tmp_path, "trainer.strategy=fsdp")

    def train(model_dir: Path, *sets: str) -> None:
        args = [a for s in sets for a in ("--set", s)]
        proc = run_cadence("train", str(config_file), "--model-dir", str(model_dir), "--nproc", "2", "--no-progress",
                           *args, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight)
    # the run as a crash right after its first checkpoint leaves it, resumed with asynchronous saves
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("ckpt-16", "ckpt-24", "FINAL", "best", "export"))
    train(resumed, "checkpoint.async_save=true")
    final = ckpt(straight, STEPS)
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "MANIFEST.json", "__0_0.distcp", "__1_0.distcp",
                                                       "state.json"]
    ema, model = read_model_state(str(final), key="ema"), read_model_state(str(final))
    assert ema.keys() == model.keys() and not same_weights(ema, model)
    assert same_weights(read_model_state(str(ckpt(resumed, STEPS)), key="ema"), ema)
    assert same_weights(read_model_state(str(ckpt(resumed, STEPS))), model)
    # one process without a process group loads the sharded EMA (cadence evaluate's run_evaluation): what the
    # run reported, to float32 rounding (the 2 ranks averaged their batches' losses over other batches)
    step, metrics = run_evaluation(config(straight, "trainer.strategy=fsdp"))
    assert step == STEPS and metrics == pytest.approx(evals(straight)[STEPS], rel=1e-6)
    assert metrics["loss"] != pytest.approx(metrics["raw/loss"], rel=1e-3)
    # and the best export holds the EMA
    step = json.loads((straight / "best" / "best.json").read_text())["step"]
    exported = load_file(straight / "export" / "best" / str(step) / "model.safetensors")
    assert same_weights(exported, read_model_state(str(straight / "best" / f"ckpt-{step}"), key="ema"))


def test_the_ema_reads_the_configs_own_settings():
    """`trainer.ema` is the model ModelEMA takes (one set of defaults and bounds, the schema's)."""
    cfg = config_from_dict({"model_dir": "m", "task": {"class": "a:B"},
                            "trainer": {"ema": {"decay": 0.9, "every_n_steps": 2}}})
    assert isinstance(cfg.trainer.ema, EMAConfig)
    ema = ModelEMA(nn.Linear(2, 2), cfg.trainer.ema)
    assert ema.settings is cfg.trainer.ema
    assert (ema.decay, ema.start_step, ema.every_n_steps, ema.evaluate_raw) == (0.9, 0, 2, True)
    default = ModelEMA(nn.Linear(2, 2))
    assert default.settings == EMAConfig() == config_from_dict(
        {"model_dir": "m", "task": {"class": "a:B"}, "trainer": {"ema": {}}}).trainer.ema
    assert (default.decay, default.start_step, default.every_n_steps, default.evaluate_raw) == (0.999, 0, 1, True)
    trainer, _ = build_runners(TinyTask(), Context.create("cpu", seed=0), ema=cfg.trainer.ema)
    assert trainer.ema is not None and trainer.ema.settings is cfg.trainer.ema
