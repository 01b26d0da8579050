"""BestCheckpointExporter with the real Controller and the real CheckpointManager (no torch):
what lands in ``best/``, restarts that must never export a worse model (tensorflow#47396), the
copy path of a sidecar-like evaluator, retention, crash repair and misuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence import CheckpointError, Controller
from cadence.actions.best_checkpoint import BEST_JSON, BestCheckpointExporter, read_best_record
from cadence.checkpoint import CheckpointManager
from fakes import MODEL_FILE, FakeTrainer


class FakeEvaluator:
    """Returns ``{"accuracy": metrics[step], "loss": 1 - accuracy}``; ``step`` comes from the
    trainer, or (evaluator-only) from the checkpoint it was restored from."""

    def __init__(self, metrics: dict[int, float], trainer: FakeTrainer | None = None) -> None:
        self.metrics = metrics
        self.trainer = trainer
        self.loaded_step: int | None = None
        self.calls: list[int] = []

    def evaluate(self, num_steps: int):
        step = self.trainer.step if self.trainer is not None else self.loaded_step
        self.calls.append(step)
        accuracy = self.metrics[step]
        return {"accuracy": accuracy, "loss": round(1.0 - accuracy, 6)}

    def load_checkpoint(self, reader, state):
        self.loaded_step = json.loads(reader.read(MODEL_FILE))["step"]


class ExportSpy:
    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, step, record):
        self.calls.append((step, dict(record)))


def ckpt_manager(model_dir: Path, **kw) -> CheckpointManager:
    return CheckpointManager(str(model_dir / "checkpoints"), **kw)


def best_manager(model_dir: Path) -> CheckpointManager:
    return CheckpointManager(str(model_dir / "best"), writer=False)


def run(model_dir: Path, metrics: dict[int, float], train_steps: int, *, export_fn=None, max_to_keep=None):
    """One training process: train_and_evaluate every 5 steps, checkpoint every 5 steps."""
    trainer = FakeTrainer()
    exporter = BestCheckpointExporter(str(model_dir / "best"), "accuracy", export_fn=export_fn)
    controller = Controller(
        trainer=trainer,
        evaluator=FakeEvaluator(metrics, trainer),
        checkpoint_manager=ckpt_manager(model_dir, max_to_keep=max_to_keep),
        steps_per_loop=5,
        checkpoint_interval=5,
        eval_actions=[exporter],
        progress=False,
    )
    controller.train_and_evaluate(train_steps=train_steps, eval_interval=5)
    controller.close()
    return controller, trainer, exporter


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def trainer_bytes_at(step: int) -> bytes:
    t = FakeTrainer()
    t.train(step)
    return t.model_bytes()


# ------------------------------------------------------------------ one run


def test_best_holds_the_checkpoint_of_the_best_evaluation(tmp_path):
    spy = ExportSpy()
    controller, trainer, exporter = run(tmp_path, {5: 0.5, 10: 0.8, 15: 0.7}, 15, export_fn=spy)
    assert trainer.global_step == 15

    best = best_manager(tmp_path)
    assert best.steps() == [10]
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == [BEST_JSON, "ckpt-10"]

    record = json.loads((tmp_path / "best" / BEST_JSON).read_text())
    assert record["metric"] == "accuracy"
    assert record["value"] == 0.8
    assert record["step"] == 10
    assert record["higher_is_better"] is True
    assert record["metrics"] == {"accuracy": 0.8, "loss": 0.2}
    # the same record is inside the committed best checkpoint
    assert best.read_state(10)["state"]["best"] == record
    assert exporter.record == record and exporter.best_value == 0.8

    # the best checkpoint holds the model as it was at step 10, not at 15
    reader, state = best.read(10)
    assert reader.read(MODEL_FILE) == trainer_bytes_at(10)
    assert state["state"]["trainer"] == {"global_step": 10}
    assert state["state"]["controller"] == {"last_eval_step": 10}
    assert reader.read(MODEL_FILE) != trainer.model_bytes()

    # restorable like any checkpoint
    fresh = FakeTrainer()
    assert best.restore({"trainer": fresh}) == 10
    assert fresh.model_bytes() == trainer_bytes_at(10)

    # export_fn ran once per new best, after the commit
    assert [step for step, _ in spy.calls] == [5, 10]
    assert spy.calls[-1][1] == record

    # the regular checkpoints are unaffected, and the run is final
    checkpoints = ckpt_manager(tmp_path, writer=False)
    assert checkpoints.steps() == [5, 10, 15] and checkpoints.final_step() == 15


# ------------------------------------------------------------------ restarts


def test_restart_never_exports_a_worse_or_equal_model(tmp_path):
    run(tmp_path, {5: 0.5, 10: 0.8, 15: 0.7}, 15)
    before = tree_bytes(tmp_path / "best")

    # a restarted process: fresh controller and exporter on the same model dir
    metrics = {20: 0.75, 25: 0.8, 30: 0.9}
    spy = ExportSpy()
    trainer = FakeTrainer()
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy", export_fn=spy)
    assert exporter.best_value == 0.8  # read back from best/ at construction
    evaluator = FakeEvaluator(metrics, trainer)
    controller = Controller(
        trainer=trainer, evaluator=evaluator, checkpoint_manager=ckpt_manager(tmp_path),
        steps_per_loop=5, checkpoint_interval=5, eval_actions=[exporter], progress=False,
    )
    assert controller.restored_step == 15

    controller.train_and_evaluate(train_steps=25, eval_interval=5)
    assert evaluator.calls == [20, 25]  # 0.75 (worse) then 0.8 (equal)
    assert spy.calls == []
    assert tree_bytes(tmp_path / "best") == before  # byte-identical: nothing rewritten
    assert best_manager(tmp_path).steps() == [10]

    controller.train_and_evaluate(train_steps=30, eval_interval=5)
    assert evaluator.calls == [20, 25, 30]
    assert [step for step, _ in spy.calls] == [30]
    best = best_manager(tmp_path)
    assert best.steps() == [30]  # exactly one: the old best was pruned
    record = json.loads((tmp_path / "best" / BEST_JSON).read_text())
    assert (record["value"], record["step"]) == (0.9, 30)
    reader, _ = best.read(30)
    assert reader.read(MODEL_FILE) == trainer_bytes_at(30)
    controller.close()


def test_restart_after_a_crash_between_commit_and_best_json_repairs_it(tmp_path):
    run(tmp_path, {5: 0.5, 10: 0.8, 15: 0.7}, 15)
    best_json = tmp_path / "best" / BEST_JSON
    expected = best_json.read_bytes()
    best_json.unlink()  # as if the process died right after committing best/ckpt-10

    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    assert best_json.read_bytes() == expected
    assert exporter.best_value == 0.8 and exporter.record["step"] == 10


def test_restart_reads_the_best_from_the_checkpoint_not_best_json(tmp_path):
    """best.json is for people; the committed checkpoint is the truth (a stale or hand-edited
    best.json cannot make a worse model win)."""
    run(tmp_path, {5: 0.5, 10: 0.8, 15: 0.7}, 15)
    best_json = tmp_path / "best" / BEST_JSON
    record = json.loads(best_json.read_text())
    best_json.write_text(json.dumps({**record, "value": 0.1}))

    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    assert exporter.best_value == 0.8
    assert json.loads(best_json.read_text())["value"] == 0.8


# ------------------------------------------------------------------ copy path (sidecar-like)


def test_copy_path_reproduces_the_committed_checkpoint_byte_for_byte(tmp_path):
    trainer = FakeTrainer()
    writer = Controller(trainer=trainer, checkpoint_manager=ckpt_manager(tmp_path), steps_per_loop=5,
                        checkpoint_interval=5, progress=False)
    writer.train(15)
    source = ckpt_manager(tmp_path, writer=False)
    assert source.steps() == [5, 10, 15]

    evaluator = FakeEvaluator({10: 0.8})
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    sidecar = Controller(evaluator=evaluator, checkpoint_manager=source, eval_actions=[exporter],
                         restore_step=10, progress=False)
    assert sidecar.global_step == 10 and evaluator.loaded_step == 10
    sidecar.evaluate()

    best = best_manager(tmp_path)
    assert best.steps() == [10]
    src_reader, src_state = source.read(10)
    dst_reader, dst_state = best.read(10)
    assert dst_reader.read(MODEL_FILE) == src_reader.read(MODEL_FILE) == trainer_bytes_at(10)
    assert (tmp_path / "best" / "ckpt-10" / MODEL_FILE).read_bytes() == (
        tmp_path / "checkpoints" / "ckpt-10" / MODEL_FILE
    ).read_bytes()
    assert set(dst_reader.names()) == set(src_reader.names())
    copied = dst_state["state"]
    assert copied["copied_from"] == {"step": 10, "path": source.path(10)}
    # every entry of the source's state.json is carried over unchanged
    for name, value in src_state["state"].items():
        assert copied[name] == value
    assert copied["best"]["value"] == 0.8 and copied["best"]["step"] == 10
    # the copy restores a trainer exactly like the source does
    fresh = FakeTrainer()
    assert best.restore({"trainer": fresh}) == 10
    assert fresh.model_bytes() == trainer_bytes_at(10)


def test_in_process_evaluation_of_an_already_committed_step_takes_the_copy_path(tmp_path):
    """train() then evaluate(): the final checkpoint exists, so best/ is a copy of it."""
    trainer = FakeTrainer()
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    controller = Controller(trainer=trainer, evaluator=FakeEvaluator({15: 0.3}, trainer),
                            checkpoint_manager=ckpt_manager(tmp_path), steps_per_loop=5,
                            eval_actions=[exporter], progress=False)
    controller.train(15)
    controller.evaluate()
    state = best_manager(tmp_path).read_state(15)["state"]
    assert state["copied_from"]["step"] == 15


# ------------------------------------------------------------------ retention


def test_retention_of_checkpoints_never_touches_best(tmp_path):
    run(tmp_path, {5: 0.5, 10: 0.8, 15: 0.7, 20: 0.6, 25: 0.1}, 25, max_to_keep=1)
    assert ckpt_manager(tmp_path, writer=False).steps() == [25]
    assert not (tmp_path / "checkpoints" / "ckpt-10").exists()
    best = best_manager(tmp_path)
    assert best.steps() == [10]
    reader, _ = best.read(10)  # still complete and verified
    assert reader.read(MODEL_FILE) == trainer_bytes_at(10)


# ------------------------------------------------------------------ misuse


def test_unattached_call_is_a_runtime_error(tmp_path):
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    with pytest.raises(RuntimeError, match="attached to a Controller"):
        exporter({"accuracy": 1.0})
    assert best_manager(tmp_path).steps() == []


def test_evaluator_only_without_a_committed_checkpoint_is_a_clear_error(tmp_path):
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    evaluator = FakeEvaluator({None: 0.9})
    controller = Controller(evaluator=evaluator, checkpoint_manager=ckpt_manager(tmp_path),
                            eval_actions=[exporter], progress=False)
    assert controller.restored_step is None
    with pytest.raises(CheckpointError, match=r"no committed checkpoint at step 0 to copy to .*best"):
        controller.evaluate()
    assert best_manager(tmp_path).steps() == []
    assert not (tmp_path / "best" / BEST_JSON).exists()
    assert exporter.best_value is None  # nothing recorded: the next good evaluation still exports


def test_evaluator_only_whose_checkpoint_was_pruned_is_a_clear_error(tmp_path):
    """A sidecar restored at step 5 whose checkpoint the trainer's retention deleted since."""
    trainer = FakeTrainer()
    Controller(trainer=trainer, checkpoint_manager=ckpt_manager(tmp_path, max_to_keep=None),
               steps_per_loop=5, checkpoint_interval=5, progress=False).train(10)
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
    sidecar = Controller(evaluator=FakeEvaluator({5: 0.9}), checkpoint_manager=ckpt_manager(tmp_path, writer=False),
                         eval_actions=[exporter], restore_step=5, progress=False)
    ckpt_manager(tmp_path, max_to_keep=None)._delete(5)
    with pytest.raises(CheckpointError, match="no committed checkpoint at step 5"):
        sidecar.evaluate()
    assert best_manager(tmp_path).steps() == []


# ------------------------------------------------------------------ a new best at an already-used step


class ScriptedEvaluator:
    """Returns the scripted accuracies in call order, whatever the step (an evaluation that is
    not bit-reproducible: another eval subset, or a GPU run resumed with different numerics)."""

    def __init__(self, values: list[float], controller_step) -> None:
        self.values = list(values)
        self.step = controller_step
        self.calls: list[int] = []

    def evaluate(self, num_steps: int):
        self.calls.append(self.step())
        return {"accuracy": self.values.pop(0)}

    def load_checkpoint(self, reader, state):
        pass


def test_a_better_re_evaluation_of_the_best_step_keeps_its_committed_record(tmp_path):
    Controller(trainer=FakeTrainer(), checkpoint_manager=ckpt_manager(tmp_path), steps_per_loop=5,
               progress=False).train(10)
    holder: dict = {}
    evaluator = ScriptedEvaluator([0.6, 0.8, 0.7], lambda: holder["c"].global_step)
    calls = []
    exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy", export_fn=lambda s, r: calls.append(s))
    holder["c"] = sidecar = Controller(evaluator=evaluator, checkpoint_manager=ckpt_manager(tmp_path, writer=False),
                                       eval_actions=[exporter], restore_step=10, progress=False)
    sidecar.evaluate(steps=1)  # a quick look: 0.6, the first best
    before = {p.name: p.read_bytes() for p in (tmp_path / "best" / "ckpt-10").iterdir()}
    sidecar.evaluate()  # the same model scored 0.8: best/ already holds it, its record stays
    assert calls == [10]
    assert json.loads((tmp_path / "best" / BEST_JSON).read_text())["value"] == 0.6
    assert best_manager(tmp_path).read_state(10)["state"]["best"]["value"] == 0.6
    assert {p.name: p.read_bytes() for p in (tmp_path / "best" / "ckpt-10").iterdir()} == before
    # memory, disk and a restart agree
    assert exporter.best_value == 0.6
    assert BestCheckpointExporter(str(tmp_path / "best"), "accuracy").best_value == 0.6


class Interrupt:
    def __init__(self, controller_step, at: int) -> None:
        self.step, self.at = controller_step, at

    def __call__(self, output):
        if self.step() == self.at:
            raise KeyboardInterrupt


def test_a_new_best_at_a_lower_step_replaces_the_old_best_after_a_resume(tmp_path):
    def build(values, interrupt_at=None):
        trainer = FakeTrainer()
        step = lambda: trainer.global_step  # noqa: E731
        exporter = BestCheckpointExporter(str(tmp_path / "best"), "accuracy")
        actions = [Interrupt(step, interrupt_at)] if interrupt_at else []
        controller = Controller(
            trainer=trainer, evaluator=ScriptedEvaluator(values, step), checkpoint_manager=ckpt_manager(tmp_path),
            steps_per_loop=5, checkpoint_interval=20, train_actions=actions, eval_actions=[exporter], progress=False,
        )
        return controller, exporter

    # evaluations at 5..30, checkpoint at 20 only; best/ at 25 then 30; killed at 35
    first, _ = build([0.1, 0.2, 0.3, 0.4, 0.6, 0.7], interrupt_at=35)
    with pytest.raises(KeyboardInterrupt):
        first.train_and_evaluate(train_steps=40, eval_interval=5)
    assert best_manager(tmp_path).steps() == [30]

    # resumed from 20; the re-evaluation of step 25 now scores best of all
    second, exporter = build([0.9, 0.75])
    assert second.restored_step == 20
    second.train_and_evaluate(train_steps=30, eval_interval=5)
    assert exporter.best_value == 0.9
    assert json.loads((tmp_path / "best" / BEST_JSON).read_text())["step"] == 25
    assert best_manager(tmp_path).steps() == [25]  # exactly one, the best
    assert BestCheckpointExporter(str(tmp_path / "best"), "accuracy").best_value == 0.9


def test_read_best_record_is_the_one_reader_of_best_json(tmp_path):
    """``read_best_record`` (what ``cadence ls``, ``cadence report`` and the trackers read): the
    record, None without a file, ValueError for a file that is not JSON or has no integer step."""
    best = tmp_path / "best"
    assert read_best_record(str(best)) is None  # no best/ at all
    best.mkdir()
    assert read_best_record(str(best)) is None
    record = {"metric": "accuracy", "value": 0.9, "step": 40, "metrics": {"accuracy": 0.9}}
    (best / BEST_JSON).write_text(json.dumps(record))
    assert read_best_record(str(best)) == record
    for text in ("{not json", "[1, 2]", '{"step": "40"}', '{"step": true}', '{"value": 1.0}'):
        (best / BEST_JSON).write_text(text)
        with pytest.raises(ValueError):
            read_best_record(str(best))
