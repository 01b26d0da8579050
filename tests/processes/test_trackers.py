"""Experiment trackers (``loggers:``): the Tracker base class with a recording tracker (in process,
fake trainer), then real MLflow on a sqlite store and real W&B offline, through ``cadence train``,
a resume, a named sidecar, a failing server, a missing extra and 2 ranks."""

from __future__ import annotations

import glob
import json
import logging
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from cli_run import ENV, run_cadence, run_python
from fakes import FakeTrainer

from cadence import Controller
from cadence.actions import BestCheckpointExporter
from cadence.checkpoint import CheckpointManager
from cadence.config import config_from_dict
from cadence.errors import ConfigError
from cadence.export_marker import MARKER_FILE
from cadence.trackers import Tracker, build_trackers, flatten_params

TESTS = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")  # MLflow's
TASK = f"{TESTS / 'tasks.py'}:TinyTask"


# -- the tracker as a callback, with a recording tracker --------------------------------------


class Recording(Tracker):
    """Records every call as ``(method, args...)``; ``fail_on`` raises from that method."""

    name = "recording"

    def __init__(self, fail_on: str | None = None, run_id: str = "run-a", **settings: Any) -> None:
        super().__init__(**settings)
        self.calls: list[tuple[Any, ...]] = []
        self.fail_on = fail_on
        self.run_id = run_id

    def _call(self, *call: Any) -> None:
        self.calls.append(call)
        if call[0] == self.fail_on:
            raise ConnectionError(f"{call[0]}: server down\nsecond line")

    def start(self, record):
        self._call("start", record)
        return dict(record) if record else {"run_id": self.run_id}

    def discard(self):
        self._call("discard")

    def log_params(self, params):
        self._call("params", dict(params))

    def log_metrics(self, step, metrics, prefix=""):
        self._call("metrics", prefix, step, dict(metrics))

    def log_summary(self, values):
        self._call("summary", dict(values))

    def log_artifact(self, path, name):
        self._call("artifact", name)

    def close(self, completed):
        self._call("close", completed)

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


class Evaluator:
    def __init__(self, trainer: FakeTrainer) -> None:
        self.trainer = trainer

    def evaluate(self, num_steps: int) -> dict[str, Any]:
        return {"value": float(self.trainer.value), "nested": {"a": 1}}


def _settings(model_dir: Path, steps: int) -> dict[str, Any]:
    return {"model_dir": str(model_dir), "params": {"trainer": {"train_steps": steps}}}


def _train(model_dir: Path, tracker: Tracker, steps: int) -> Controller:
    trainer = FakeTrainer()
    best = BestCheckpointExporter(str(model_dir / "best"), "value")
    with Controller(trainer, Evaluator(trainer), CheckpointManager(str(model_dir / "checkpoints")),
                    steps_per_loop=2, checkpoint_interval=4, summary_interval=4, eval_actions=[best],
                    callbacks=[tracker], progress=False) as controller:
        controller.train_and_evaluate(steps, eval_interval=4)
    return controller


def test_callback_logs_params_metrics_best_and_continues_the_recorded_run(tmp_path):
    tracker = Recording(**_settings(tmp_path, 8))
    _train(tmp_path, tracker, 8)
    assert tracker.calls[0] == ("start", None)
    assert tracker.calls[1] == ("params", {"trainer": {"train_steps": 8}})
    assert json.loads((tmp_path / "trackers" / "recording.json").read_text()) == {"run_id": "run-a"}
    # train summaries every summary_interval (4), not every loop (2); eval at each interval
    assert [(c[1], c[2]) for c in tracker.of("metrics") if c[1] == "train"] == [("train", 4), ("train", 8)]
    evals = [c for c in tracker.of("metrics") if c[1] == "eval"]
    assert evals == [("metrics", "eval", 4, {"value": 10.0, "nested/a": 1}),
                     ("metrics", "eval", 8, {"value": 36.0, "nested/a": 1})]
    best = [c for c in tracker.of("metrics") if c[1] == "best"]
    assert best == [("metrics", "best", 4, {"value": 10.0}), ("metrics", "best", 8, {"value": 36.0})]
    assert tracker.of("summary")[-1] == ("summary", {"best/step": 8, "best/metric": "value", "best/value": 36.0})
    assert tracker.calls[-1] == ("close", True)

    again = Recording(run_id="run-b", **_settings(tmp_path, 12))  # a resumed run: continues run-a
    _train(tmp_path, again, 12)
    assert again.calls[0] == ("start", {"run_id": "run-a"})
    assert [c[2] for c in again.of("metrics") if c[1] == "train"] == [12]


def test_a_run_recorded_meanwhile_by_another_process_is_joined(tmp_path):
    class Loser(Recording):
        def start(self, record):
            if record is None:  # another process records its run between our read and our create
                (tmp_path / "trackers").mkdir(exist_ok=True)
                (tmp_path / "trackers" / "recording.json").write_text('{"run_id": "winner"}')
            return super().start(record)

    tracker = Loser(**_settings(tmp_path, 4))
    _train(tmp_path, tracker, 4)
    assert [c for c in tracker.calls if c[0] in ("start", "discard")] == [
        ("start", None), ("discard",), ("start", {"run_id": "winner"})]


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path, caplog):
    failing, fine = Recording(fail_on="metrics", model_dir=str(tmp_path)), Recording(model_dir=str(tmp_path))
    fine.name = "fine"
    trainer = FakeTrainer()
    manager = CheckpointManager(str(tmp_path / "checkpoints"))
    with caplog.at_level(logging.WARNING, logger="cadence.trackers"):
        with Controller(trainer, Evaluator(trainer), manager, steps_per_loop=2, checkpoint_interval=2,
                        callbacks=[failing, fine], progress=False) as controller:
            controller.train_and_evaluate(8, eval_interval=4)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["tracker recording failed and logs nothing more from this process (training goes on): "
                        "ConnectionError: metrics: server down"]
    assert failing.failed and not fine.failed
    assert [c[0] for c in failing.calls] == ["start", "metrics"]  # nothing after the failure, not even close
    assert len(fine.of("metrics")) == 4 + 2 and fine.calls[-1] == ("close", True)
    assert manager.steps() == [2, 4, 6, 8]


def test_only_the_chief_logs():
    tracker = Recording(model_dir=None)
    run = SimpleNamespace(coordinator=SimpleNamespace(is_chief=False), global_step=2)
    tracker.attach(run)
    tracker.on_train_start(run)
    tracker.on_train_logs(run, {"loss": 1.0}, 2)
    tracker.on_eval_end(run, {"accuracy": 0.5}, 2)
    tracker.add_artifact(__file__, "x")
    tracker.on_close(run)
    assert tracker.calls == []


def test_flatten_params_and_missing_extras(monkeypatch, tmp_path):
    assert flatten_params({"trainer": {"train_steps": 5, "best": None}, "export": {"formats": ["a", "b"]},
                           "task": {"params": {}}}) == {
        "trainer.train_steps": 5, "trainer.best": None, "export.formats": '["a","b"]', "task.params": "{}"}
    cfg = config_from_dict({"model_dir": str(tmp_path), "task": {"class": TASK},
                            "loggers": {"mlflow": {}, "wandb": None}})
    assert cfg.loggers.wandb is None and cfg.loggers.mlflow is not None
    assert build_trackers(config_from_dict({"task": {"class": TASK}})) == []  # off by default
    for module in ("mlflow", "wandb"):
        cfg = config_from_dict({"model_dir": str(tmp_path), "task": {"class": TASK}, "loggers": {module: {}}})
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(ConfigError, match=rf"loggers\.{module}: .*pip install 'cadence\[{module}\]'"):
            build_trackers(cfg)


# -- real MLflow (sqlite) and W&B (offline) through the CLI -----------------------------------


def _env(tmp: Path) -> dict[str, str]:
    return {"COLUMNS": "250", "WANDB_DATA_DIR": str(tmp / "wandb-data"), "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
            "WANDB_CONFIG_DIR": str(tmp / "wandb-config")}


def _config(tmp: Path, loggers: dict[str, Any], **trainer: Any) -> Path:
    cfg = {"task": {"class": TASK, "params": {"n": 64}},
           "trainer": {"train_steps": 16, "steps_per_loop": 4, "checkpoint_interval": 8, "validation_interval": 8,
                       "max_to_keep": None, **trainer},
           "loggers": loggers}
    if trainer.get("best_checkpoint"):
        cfg["export"] = {"on": "final"}
    path = tmp / f"config-{len(list(tmp.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Train to 16, resume to 24, then a sidecar named ``side`` evaluates every checkpoint; both
    trackers on, one model dir; each run from an empty working directory, ``tmp/cwd``."""
    tmp = tmp_path_factory.mktemp("trackers")
    cwd = tmp / "cwd"
    cwd.mkdir()
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    config = _config(tmp, {"mlflow": {"tracking_uri": uri, "experiment": "tests"}, "wandb": {"project": "tests"}},
                     best_checkpoint={"metric": "accuracy"})
    model_dir = tmp / "run"
    common = (str(config), "--model-dir", str(model_dir))
    outputs = []
    for args in (("train", *common, "--no-progress"),
                 ("train", *common, "--no-progress", "--set", "trainer.train_steps=24"),
                 ("evaluate", *common, "--continuous", "--set", "sidecar.name=side", "--set", "sidecar.timeout=60")):
        proc = run_cadence(*args, env=_env(tmp), cwd=cwd)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "failed and logs nothing more" not in proc.stdout + proc.stderr
        outputs.append(proc.stdout + proc.stderr)
    return SimpleNamespace(tmp=tmp, uri=uri, model_dir=model_dir, outputs=outputs)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_holds_params_metrics_best_and_exports_of_one_run(pipeline):
    from mlflow.tracking import MlflowClient

    record = json.loads((pipeline.model_dir / "trackers" / "mlflow.json").read_text())
    assert record["tracking_uri"] == pipeline.uri
    client = MlflowClient(tracking_uri=pipeline.uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert [r.info.run_id for r in runs] == [record["run_id"]]  # trainer, resume and sidecar: one run
    run = runs[0]
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["trainer.train_steps"] == "16"  # the first value (MLflow params cannot change)
    assert params["trainer.best_checkpoint.metric"] == "accuracy" and params["task.params.n"] == "64"
    assert params["sidecar.name"] == "None" and params["export.formats"] == '["safetensors"]'
    assert [s for s, _ in _history(client, run.info.run_id, "train/loss")] == [4, 8, 12, 16, 20, 24]
    assert [s for s, _ in _history(client, run.info.run_id, "train/steps_per_second")] == [4, 8, 12, 16, 20, 24]
    evals = _history(client, run.info.run_id, "eval/accuracy")
    assert [s for s, _ in evals] == [8, 16, 24]
    side = _history(client, run.info.run_id, "eval_side/accuracy")
    assert side == evals  # the sidecar's evaluations of the same checkpoints, into the same run
    best = json.loads((pipeline.model_dir / "best" / "best.json").read_text())
    assert run.data.tags["best/step"] == str(best["step"]) and run.data.tags["best/metric"] == "accuracy"
    assert float(run.data.tags["best/value"]) == best["value"]
    assert (best["step"], best["value"]) in _history(client, run.info.run_id, "best/accuracy")
    for step in (16, 24):  # the final export of each training process
        names = {a.path for a in client.list_artifacts(run.info.run_id, f"export/final/{step}")}
        assert names == {f"export/final/{step}/{name}" for name in ("model.safetensors", "metadata.json", MARKER_FILE)}
    # the artifacts are under the model dir (loggers.mlflow.artifact_location's default), not ./mlruns
    artifacts = pipeline.model_dir / "trackers" / "mlflow" / run.info.run_id / "artifacts"
    assert run.info.artifact_uri in (str(artifacts), artifacts.as_uri())
    assert (artifacts / "export" / "final" / "24" / "model.safetensors").is_file()
    assert list((pipeline.tmp / "cwd").iterdir()) == []  # the working directory is left untouched


def wandb_records(path: str) -> list[Any]:
    """The records of an offline run's ``.wandb`` file (W&B's LevelDB-style log: a 7-byte header,
    then 32 KiB blocks of chunks, each a 7-byte header -- CRC, length, type -- and its data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # block trailer
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_run(directory: str) -> dict[str, Any]:
    """What an offline run directory holds: run id, config, history rows, summary, artifacts."""
    out: dict[str, Any] = {"config": {}, "history": [], "summary": {}, "artifacts": []}
    (wandb_file,) = glob.glob(f"{directory}/run-*.wandb")
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run_id"] = record.run.run_id
            out["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            out["history"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                   for i in record.history.item})
        elif kind == "summary":
            out["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json)
                                   for u in record.summary.update})
        elif kind == "artifact":
            out["artifacts"].append((record.artifact.name, sorted(c.path for c in record.artifact.manifest.contents)))
    return out


def test_wandb_offline_runs_share_one_run_id_and_hold_the_same_content(pipeline):
    record = json.loads((pipeline.model_dir / "trackers" / "wandb.json").read_text())
    dirs = sorted(glob.glob(str(pipeline.model_dir / "trackers" / "wandb" / "offline-run-*")))
    assert len(dirs) == 3 and all(d.endswith(f"-{record['run_id']}") for d in dirs)  # train, resume, sidecar
    runs = [_wandb_run(d) for d in dirs]
    assert {r["run_id"] for r in runs} == {record["run_id"]}
    first, resumed, sidecar = runs
    assert first["config"]["trainer"]["train_steps"] == 16 and resumed["config"]["trainer"]["train_steps"] == 24

    def series(run: dict[str, Any], key: str) -> list[int]:
        return [row["global_step"] for row in run["history"] if key in row]

    assert series(first, "train/loss") == [4, 8, 12, 16] and series(resumed, "train/loss") == [20, 24]
    assert series(first, "eval/accuracy") == [8, 16] and series(resumed, "eval/accuracy") == [24]
    assert series(sidecar, "eval_side/accuracy") == [8, 16, 24] and not series(sidecar, "train/loss")
    best = json.loads((pipeline.model_dir / "best" / "best.json").read_text())
    summaries = [r["summary"] for r in runs if "best/step" in r["summary"]]
    assert summaries and summaries[-1]["best/step"] == best["step"] and summaries[-1]["best/metric"] == "accuracy"
    assert first["artifacts"] == [("export-final", [MARKER_FILE, "metadata.json", "model.safetensors"])]
    assert resumed["artifacts"] == [("export-final", [MARKER_FILE, "metadata.json", "model.safetensors"])]


def test_an_unreachable_mlflow_server_warns_once_and_loses_no_checkpoint(tmp_path, closed_port):
    config = _config(tmp_path, {"mlflow": {"tracking_uri": f"http://127.0.0.1:{closed_port}"}})
    # MLflow's own retries left at their defaults: the tracker's first look at the server fails at once
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--no-progress",
                       env=_env(tmp_path), cwd=tmp_path, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("tracker mlflow failed and logs nothing more from this process (training goes on)") == 1, out
    assert "Traceback" not in out and "Retrying" not in out and "still busy" not in out
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("ckpt-*") if (p / "MANIFEST.json").exists()) == ["ckpt-16", "ckpt-8"]
    assert json.loads((ckpts / "FINAL").read_text())["step"] == 16
    assert not (tmp_path / "run" / "trackers" / "mlflow.json").exists()


def test_a_missing_extra_is_one_line_naming_it(tmp_path):
    config = _config(tmp_path, {"mlflow": {}})
    code = ("import sys; sys.modules['mlflow'] = None; from cadence.cli.main import main; "
            f"sys.exit(main(['train', {str(config)!r}, '--model-dir', {str(tmp_path / 'run')!r}, '--no-progress']))")
    proc = run_python(["-c", code], timeout=180, env={**ENV, **_env(tmp_path)}, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "cadence[mlflow]" in line]
    assert lines == ["cadence: error: loggers.mlflow: the mlflow package is not installed: pip install 'cadence[mlflow]'"]
    assert not list((tmp_path / "run").glob("checkpoints/ckpt-*"))


def test_two_ranks_only_the_chief_logs(tmp_path, pipeline):
    uri = pipeline.uri  # the module's store, already created (an experiment of its own here)
    config = _config(tmp_path, {"mlflow": {"tracking_uri": uri, "experiment": "ranks"}}, seed=1)
    proc = run_cadence("train", str(config), "--model-dir", str(tmp_path / "run"), "--nproc", "2", "--no-progress",
                       env=_env(tmp_path), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ranks").experiment_id])
    assert [s for s, _ in _history(client, run.info.run_id, "train/loss")] == [4, 8, 12, 16]  # once per step
    assert [s for s, _ in _history(client, run.info.run_id, "eval/accuracy")] == [8, 16]
    assert json.loads((tmp_path / "run" / "trackers" / "mlflow.json").read_text())["run_id"] == run.info.run_id
