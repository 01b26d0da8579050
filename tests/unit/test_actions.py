"""Tests of cadence.actions: metric lookup, persisted values, best metric, export file retention,
conditional / periodic actions and early stopping. No torch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import fsspec
import numpy as np
import pytest

from cadence.actions import (
    ConditionalAction,
    EarlyStopping,
    ExportFileManager,
    JSONPersistedValue,
    MetricNotFoundError,
    NewBestMetric,
    PeriodicAction,
    PersistedValueError,
    get_metric,
)
from cadence.loop.controller import Controller
from cadence.errors import StopTraining
from fakes import FakeTrainer

NAN = float("nan")
INF = float("inf")


class FakeController:
    """What these actions read of the run (a RunContext): the global and the restored step."""

    def __init__(self, step: int = 0) -> None:
        self.global_step = step
        self.restored_step: int | None = None


class Recorder:
    def __init__(self) -> None:
        self.outputs: list[dict] = []
        self.attached: list[object] = []

    def __call__(self, output):
        self.outputs.append(dict(output))

    def attach(self, controller) -> None:
        self.attached.append(controller)


class FakeScalar:
    """Something with ``.item()``, like a 0-d tensor."""

    def __init__(self, value: float) -> None:
        self.value = value

    def item(self) -> float:
        return self.value


@pytest.fixture(params=["local", "memory"])
def anydir(request, tmp_path: Path, memdir: str) -> str:
    return str(tmp_path) if request.param == "local" else memdir


def listing(url: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url)
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))


def make_file(url: str, data: bytes = b"x") -> None:
    fs, path = fsspec.core.url_to_fs(url)
    fs.makedirs(os.path.dirname(path), exist_ok=True)
    fs.pipe_file(path, data)


def make_dir(url: str) -> None:
    make_file(url + "/saved_model.bin")


def read_bytes(url: str) -> bytes:
    fs, path = fsspec.core.url_to_fs(url)
    return bytes(fs.cat_file(path))


def read_text(url: str) -> str:
    return read_bytes(url).decode()


# ================================================================== get_metric


def test_get_metric_flat_nested_and_callable() -> None:
    output = {"loss": 0.5, "eval": {"acc": 0.9, "deep": {"f1": 0.7}}, "count": 3}
    assert get_metric(output, "loss") == 0.5
    assert get_metric(output, "eval/acc") == 0.9
    assert get_metric(output, "eval/deep/f1") == 0.7
    assert get_metric(output, lambda o: o["eval"]["acc"] * 2) == 1.8
    value = get_metric(output, "count")
    assert value == 3.0 and type(value) is float


def test_get_metric_flat_key_wins_over_nested() -> None:
    output = {"eval/acc": 0.1, "eval": {"acc": 0.9}}
    assert get_metric(output, "eval/acc") == 0.1


def test_get_metric_converts_items_to_python_floats() -> None:
    for value in (np.float32(0.25), np.array(0.25), np.int64(2), FakeScalar(0.25)):
        got = get_metric({"m": value}, "m")
        assert type(got) is float
    assert get_metric({"m": FakeScalar(0.25)}, lambda o: o["m"]) == 0.25


def test_get_metric_missing_key_lists_available_keys() -> None:
    output = {"loss": 1.0, "eval": {"acc": 0.9}}
    with pytest.raises(KeyError) as info:
        get_metric(output, "accuracy")
    assert isinstance(info.value, MetricNotFoundError)
    message = str(info.value)
    assert "'accuracy'" in message
    assert "'loss'" in message and "'eval/acc'" in message
    with pytest.raises(MetricNotFoundError, match="eval/f1"):
        get_metric(output, "eval/f1")
    with pytest.raises(MetricNotFoundError, match="loss/x"):
        get_metric(output, "loss/x")  # a number has no children
    with pytest.raises(MetricNotFoundError, match="empty"):
        get_metric({}, "loss")


def test_get_metric_non_numbers_raise_type_error() -> None:
    with pytest.raises(TypeError, match="eval/<key>"):
        get_metric({"eval": {"acc": 1.0}}, "eval")
    with pytest.raises(TypeError, match="name"):
        get_metric({"name": "resnet"}, "name")
    with pytest.raises(TypeError):
        get_metric({"m": None}, "m")


# ================================================================== JSONPersistedValue


def test_persisted_value_written_at_construction_and_read_back(anydir: str) -> None:
    url = f"{anydir}/sub/dir/value.json"
    value = JSONPersistedValue({"a": [1, 2]}, url)
    assert value.read() == {"a": [1, 2]}
    assert json.loads(read_text(url)) == {"a": [1, 2]}
    value.write({"a": [3]})
    again = JSONPersistedValue("ignored initial value", url)
    assert again.read() == {"a": [3]}
    assert listing(f"{anydir}/sub/dir") == ["value.json"]


def test_persisted_value_write_value_false_only_reads(tmp_path: Path) -> None:
    url = str(tmp_path / "value.json")
    reader = JSONPersistedValue(1, url, write_value=False)
    assert reader.read() == 1 and not os.path.exists(url)
    reader.write(2)
    assert reader.read() == 2 and not os.path.exists(url)
    JSONPersistedValue(7, url)  # a writer creates it
    assert JSONPersistedValue(1, url, write_value=False).read() == 7


def test_persisted_value_atomic_write_leaves_no_temp_file(tmp_path: Path) -> None:
    url = str(tmp_path / "value.json")
    value = JSONPersistedValue(0, url)
    for i in range(1, 5):
        value.write(i)
        assert os.listdir(tmp_path) == ["value.json"]
        assert json.loads(Path(url).read_text()) == i


def test_persisted_value_failed_rename_keeps_old_value(tmp_path: Path, monkeypatch) -> None:
    url = str(tmp_path / "value.json")
    value = JSONPersistedValue(1.5, url)

    def broken_replace(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk on fire"):
        value.write(2.5)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["value.json"]  # the temp file was removed
    assert value.read() == 1.5  # memory matches the file
    assert JSONPersistedValue(0, url).read() == 1.5


@pytest.mark.parametrize("content", [b"{not json", b"", b"  \n", b"\xff\xfe"])
def test_persisted_value_corrupt_file_is_an_error_naming_it(anydir: str, content: bytes) -> None:
    url = f"{anydir}/best.json"
    make_file(url, content)
    with pytest.raises(PersistedValueError, match="best.json") as info:
        JSONPersistedValue(0, url)
    assert isinstance(info.value, ValueError)
    assert read_bytes(url) == content  # left as it was, not reset


def test_persisted_value_memory_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    value = JSONPersistedValue([1], None)
    assert value.read() == [1] and value.filename is None
    value.write((2, 3))
    assert value.read() == [2, 3]  # as JSON would hold it
    assert os.listdir(tmp_path) == []


def test_persisted_value_refuses_non_json_and_changes_nothing(tmp_path: Path) -> None:
    url = str(tmp_path / "v.json")
    value = JSONPersistedValue(1.0, url)
    with pytest.raises(ValueError):
        value.write(NAN)
    with pytest.raises(TypeError):
        value.write(object())
    assert value.read() == 1.0 and json.loads(Path(url).read_text()) == 1.0


def test_persisted_null_is_a_value(tmp_path: Path) -> None:
    url = str(tmp_path / "v.json")
    JSONPersistedValue(None, url)
    assert JSONPersistedValue(5, url).read() is None


# ================================================================== NewBestMetric


def test_new_best_higher_is_better() -> None:
    best = NewBestMetric("acc")
    assert best.best_value is None
    results = [best.commit({"acc": v}) for v in (0.5, 0.4, 0.6, 0.6, 0.7)]
    assert results == [True, False, True, False, True]
    assert best.best_value == 0.7
    assert best({"acc": 0.8}) is True  # __call__ is commit
    assert best.best_value == 0.8


def test_new_best_lower_is_better() -> None:
    best = NewBestMetric("loss", higher_is_better=False)
    results = [best.commit({"loss": v}) for v in (2.0, 3.0, 1.0, 1.0, 0.5)]
    assert results == [True, False, True, False, True]
    assert best.best_value == 0.5


def test_new_best_test_does_not_record() -> None:
    best = NewBestMetric("acc")
    assert best.test({"acc": 0.5}) and best.test({"acc": 0.5})
    assert best.best_value is None
    assert best.commit({"acc": 0.5})
    assert not best.test({"acc": 0.5}) and not best.commit({"acc": 0.5})
    assert best.test({"acc": 0.51}) and best.best_value == 0.5


def test_new_best_first_finite_value_is_always_best() -> None:
    best = NewBestMetric("acc")
    assert best.commit({"acc": -1e308})  # Orbit's -float_max start would refuse this
    low = NewBestMetric("loss", higher_is_better=False)
    assert low.commit({"loss": 1e308})


def test_new_best_nan_and_infinities_are_never_best() -> None:
    for higher in (True, False):
        best = NewBestMetric("m", higher_is_better=higher)
        assert not best.commit({"m": NAN})
        assert not best.commit({"m": INF}) and not best.commit({"m": -INF})
        assert best.best_value is None
        assert best.commit({"m": 1.0})
        assert not best.test({"m": NAN}) and not best.commit({"m": NAN})
        assert not best.commit({"m": INF if higher else -INF})
        assert best.best_value == 1.0


def test_new_best_nested_key_callable_and_items() -> None:
    best = NewBestMetric("eval/acc")
    assert best.commit({"eval": {"acc": 0.5}})
    assert best.commit({"eval/acc": 0.6})  # the flattened form
    assert not best.commit({"eval": {"acc": np.float64(0.6)}})
    fn = NewBestMetric(lambda o: o["a"] - o["b"], higher_is_better=False)
    assert fn.commit({"a": 3, "b": 1}) and fn.commit({"a": 1.0, "b": 0})
    assert fn.best_value == 1.0


def test_new_best_missing_metric_lists_keys() -> None:
    best = NewBestMetric("accuracy")
    with pytest.raises(KeyError, match=r"'accuracy'.*'acc'.*'loss'"):
        best.commit({"loss": 1.0, "acc": 0.5})


def test_new_best_survives_restart(anydir: str) -> None:
    url = f"{anydir}/best/best_metric.json"
    best = NewBestMetric("acc", filename=url)
    assert best.commit({"acc": 0.5}) and best.commit({"acc": 0.7})
    assert json.loads(read_text(url)) == 0.7

    restarted = NewBestMetric("acc", filename=url)  # a new process, same file
    assert restarted.best_value == 0.7
    assert not restarted.test({"acc": 0.6}) and not restarted.commit({"acc": 0.6})  # worse
    assert not restarted.commit({"acc": 0.7})  # equal
    assert restarted.commit({"acc": 0.71})
    assert NewBestMetric("acc", filename=url).best_value == 0.71


def test_new_best_file_before_any_value_holds_null(tmp_path: Path) -> None:
    url = str(tmp_path / "best.json")
    NewBestMetric("acc", filename=url)
    assert json.loads(Path(url).read_text()) is None
    reader = NewBestMetric("acc", filename=str(tmp_path / "other.json"), write_metric=False)
    assert reader.commit({"acc": 1.0}) and not (tmp_path / "other.json").exists()


def test_new_best_rejects_a_file_that_is_not_a_number(tmp_path: Path) -> None:
    url = tmp_path / "best.json"
    url.write_text('"high"')
    with pytest.raises(PersistedValueError, match="best.json"):
        NewBestMetric("acc", filename=str(url))
    url.write_text("0.8 garbage")
    with pytest.raises(PersistedValueError, match="best.json"):
        NewBestMetric("acc", filename=str(url))


def test_new_best_state_dict_round_trip_without_file() -> None:
    best = NewBestMetric("acc")
    best.commit({"acc": 0.7})
    state = json.loads(json.dumps(best.state_dict()))
    assert state == {"best_value": 0.7, "metric": "acc", "higher_is_better": True}
    resumed = NewBestMetric("acc")
    resumed.load_state_dict(state)
    assert resumed.best_value == 0.7
    assert not resumed.commit({"acc": 0.7}) and not resumed.commit({"acc": 0.6})
    assert resumed.commit({"acc": 0.8})
    empty = NewBestMetric("acc")
    empty.load_state_dict(NewBestMetric("acc").state_dict())
    assert empty.best_value is None


def test_new_best_file_wins_over_a_worse_checkpoint(tmp_path: Path) -> None:
    """The run committed 0.9 (file), then crashed; its last checkpoint recorded 0.6."""
    url = str(tmp_path / "best.json")
    run = NewBestMetric("acc", filename=url)
    run.commit({"acc": 0.6})
    checkpointed = run.state_dict()
    run.commit({"acc": 0.9})  # after the checkpoint, before the crash

    resumed = NewBestMetric("acc", filename=url)
    resumed.load_state_dict(checkpointed)
    assert resumed.best_value == 0.9
    assert json.loads(Path(url).read_text()) == 0.9
    assert not resumed.commit({"acc": 0.8})  # not "better" than the exported best


def test_new_best_file_is_the_source_of_truth_even_when_worse(tmp_path: Path) -> None:
    url = str(tmp_path / "best.json")
    Path(url).write_text("0.5")
    resumed = NewBestMetric("acc", filename=url)
    resumed.load_state_dict({"best_value": 0.9, "metric": "acc", "higher_is_better": True})
    assert resumed.best_value == 0.5
    assert json.loads(Path(url).read_text()) == 0.5


def test_new_best_adopts_the_checkpoint_when_the_file_has_no_value(tmp_path: Path) -> None:
    url = str(tmp_path / "best.json")  # e.g. a filename added on resume
    resumed = NewBestMetric("acc", filename=url)
    resumed.load_state_dict({"best_value": 0.9, "metric": "acc", "higher_is_better": True})
    assert resumed.best_value == 0.9
    assert json.loads(Path(url).read_text()) == 0.9
    assert NewBestMetric("acc", filename=url).best_value == 0.9


def test_new_best_ignores_state_of_another_metric_or_direction(caplog) -> None:
    best = NewBestMetric("acc")
    best.load_state_dict({"best_value": 0.1, "metric": "loss", "higher_is_better": False})
    assert best.best_value is None
    best.load_state_dict({"best_value": 0.1, "metric": "acc", "higher_is_better": False})
    assert best.best_value is None
    assert "ignoring" in caplog.text
    with pytest.raises(ValueError):
        best.load_state_dict({"best_value": "high"})
    with pytest.raises(ValueError):
        best.load_state_dict({})


def test_new_best_guarding_an_export_that_fails(tmp_path: Path) -> None:
    """Orbit's pattern: the best is committed only after the export succeeded."""
    best = NewBestMetric("acc", filename=str(tmp_path / "best.json"))
    exported: list[float] = []
    fail = {"now": False}

    def export(output):
        if fail["now"]:
            raise OSError("export failed")
        exported.append(output["acc"])

    action = ConditionalAction(best.test, [export, best.commit])
    action({"acc": 0.5})
    fail["now"] = True
    with pytest.raises(OSError):
        action({"acc": 0.7})
    assert best.best_value == 0.5
    fail["now"] = False
    action({"acc": 0.6})
    action({"acc": 0.4})
    assert exported == [0.5, 0.6] and best.best_value == 0.6


# ================================================================== ExportFileManager


def test_export_numbering_from_zero(anydir: str) -> None:
    base = f"{anydir}/export/model"
    manager = ExportFileManager(base, max_to_keep=None)
    assert manager.managed_files == []
    names = []
    for _ in range(3):
        name = manager.next_name()
        make_file(name)
        names.append(name)
    assert names == [f"{base}-0", f"{base}-1", f"{base}-2"]
    assert manager.managed_files == names
    assert manager.managed_ids == [0, 1, 2]


def test_export_next_name_never_repeats_before_the_file_exists(tmp_path: Path) -> None:
    manager = ExportFileManager(str(tmp_path / "m"))
    assert [manager.next_name() for _ in range(3)] == [str(tmp_path / f"m-{i}") for i in range(3)]


def test_export_numbering_resumes_after_restart_with_gaps(anydir: str) -> None:
    base = f"{anydir}/export/model"
    for i in (0, 3, 11):
        make_file(f"{base}-{i}")
    make_file(f"{base}-99.tmp")  # not managed: must not push the numbering
    restarted = ExportFileManager(base)
    assert restarted.managed_ids == [0, 3, 11]  # by id, not by name (11 sorts before 3)
    assert restarted.next_name() == f"{base}-12"


def test_export_next_id_fn(tmp_path: Path) -> None:
    step = {"value": 200}
    manager = ExportFileManager(str(tmp_path / "m"), next_id_fn=lambda: step["value"])
    assert manager.next_name() == str(tmp_path / "m-200")
    step["value"] = 400
    assert manager.next_name() == str(tmp_path / "m-400")
    assert ExportFileManager(str(tmp_path / "m"), next_id_fn=lambda: np.int64(7)).next_name().endswith("m-7")
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="next_id_fn"):
            ExportFileManager(str(tmp_path / "m"), next_id_fn=lambda bad=bad: bad).next_name()


@pytest.mark.parametrize("kind", ["files", "dirs"])
@pytest.mark.parametrize(
    "max_to_keep, kept",
    [(None, [0, 1, 2, 10, 20]), (0, []), (2, [10, 20]), (5, [0, 1, 2, 10, 20]), (9, [0, 1, 2, 10, 20])],
)
def test_export_clean_up(anydir: str, kind: str, max_to_keep, kept) -> None:
    base = f"{anydir}/export/model"
    create = make_file if kind == "files" else make_dir
    ids = [0, 1, 2, 10, 20]
    for i in ids:
        create(f"{base}-{i}")
    manager = ExportFileManager(base, max_to_keep=max_to_keep)
    deleted = manager.clean_up()
    assert manager.managed_ids == kept
    assert deleted == [f"{base}-{i}" for i in ids if i not in kept]
    assert listing(f"{anydir}/export") == sorted(f"model-{i}" for i in kept)
    assert manager.clean_up() == []


def test_export_clean_up_leaves_unmanaged_names_alone(anydir: str) -> None:
    base = f"{anydir}/export/model"
    unmanaged = ["model-1.tmp", "model-x", "modelfoo-1", "model-01", "model-", "model", "model--1", "other-3"]
    for name in unmanaged:
        make_file(f"{anydir}/export/{name}")
    make_dir(f"{anydir}/export/model-2.tmp-abc")
    for i in (1, 2, 3):
        make_file(f"{base}-{i}")
    manager = ExportFileManager(base, max_to_keep=0)
    assert manager.managed_ids == [1, 2, 3]
    manager.clean_up()
    assert listing(f"{anydir}/export") == sorted(unmanaged + ["model-2.tmp-abc"])


def test_export_slash_separator_manages_a_directory(anydir: str) -> None:
    base = f"{anydir}/export/best"
    for step in (200, 400, 600):
        make_dir(f"{base}/{step}")
    make_file(f"{base}/best.json")
    make_dir(f"{base}/800.tmp-123")
    make_file(f"{anydir}/export/best-5")  # a sibling, not a child
    manager = ExportFileManager(base + "/", max_to_keep=2, separator="/")
    assert manager.managed_files == [f"{base}/200", f"{base}/400", f"{base}/600"]
    assert manager.next_name() == f"{base}/601"
    assert manager.clean_up() == [f"{base}/200"]
    assert listing(base) == ["400", "600", "800.tmp-123", "best.json"]
    assert listing(f"{anydir}/export") == ["best", "best-5"]
    stepped = ExportFileManager(base, separator="/", next_id_fn=lambda: 1000)
    assert stepped.next_name() == f"{base}/1000"


def test_export_missing_directory_is_empty(anydir: str) -> None:
    manager = ExportFileManager(f"{anydir}/nothing/here", separator="/")
    assert manager.managed_files == [] and manager.clean_up() == []
    assert manager.next_name() == f"{anydir}/nothing/here/0"


def test_export_validates_arguments(tmp_path: Path) -> None:
    base = str(tmp_path / "m")
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_to_keep"):
            ExportFileManager(base, max_to_keep=bad)
    with pytest.raises(ValueError, match="separator"):
        ExportFileManager(base, separator="")
    with pytest.raises(ValueError, match="base_name"):
        ExportFileManager("")


# ================================================================== ConditionalAction


def test_conditional_action_runs_when_condition_holds() -> None:
    first, second = Recorder(), Recorder()
    action = ConditionalAction(lambda o: o["loss"] < 1, [first, second])
    action({"loss": 2.0})
    action({"loss": 0.5})
    assert first.outputs == second.outputs == [{"loss": 0.5}]
    single = Recorder()
    ConditionalAction(lambda o: True, single)({"x": 1})
    assert single.outputs == [{"x": 1}]


def test_conditional_action_declares_what_it_wraps_and_the_controller_attaches_it() -> None:
    inner, condition_owner = Recorder(), NewBestMetric("acc")
    stopper = EarlyStopping("acc", patience=1)
    action = ConditionalAction(condition_owner.test, [inner, stopper.__call__])
    assert action.wrapped() == [condition_owner, inner, stopper]  # owners of bound methods
    assert not hasattr(action, "attach")  # it forwards nothing by hand
    nested = PeriodicAction(action, every_n_steps=2)
    controller = Controller(trainer=FakeTrainer(), steps_per_loop=1, train_actions=[nested], progress=False)
    assert inner.attached == [controller]  # reached through two wrappers
    assert stopper._run is controller  # reached through the bound method
    assert nested._run is controller


def test_wrapped_actions_run_in_a_controller_loop() -> None:
    inner = Recorder()
    controller = Controller(trainer=FakeTrainer(), steps_per_loop=1, progress=False,
                            train_actions=[PeriodicAction(ConditionalAction(lambda o: True, inner), every_n_steps=2)])
    controller.train(4)
    assert [o["loss"] for o in inner.outputs] == [0.5, 0.25]  # steps 2 and 4


def test_conditional_action_stop_training_does_not_skip_later_actions() -> None:
    def stop(output):
        raise StopTraining("enough")

    after = Recorder()
    action = ConditionalAction(lambda o: True, [stop, after])
    with pytest.raises(StopTraining, match="enough"):
        action({"x": 1})
    assert after.outputs == [{"x": 1}]


def test_conditional_action_carries_inner_state() -> None:
    best = NewBestMetric("acc")
    action = ConditionalAction(best.test, [Recorder(), best.commit])
    action({"acc": 0.8})
    state = json.loads(json.dumps(action.state_dict()))
    assert state == {"0/NewBestMetric": {"best_value": 0.8, "metric": "acc", "higher_is_better": True}}

    best2, recorder2 = NewBestMetric("acc"), Recorder()
    resumed = ConditionalAction(best2.test, [recorder2, best2.commit])
    resumed.load_state_dict(state)
    assert best2.best_value == 0.8
    resumed({"acc": 0.7})
    assert recorder2.outputs == []
    resumed.load_state_dict({})  # nothing saved for it: left as is
    assert best2.best_value == 0.8


def test_conditional_action_rejects_non_callables() -> None:
    with pytest.raises(TypeError):
        ConditionalAction("acc", Recorder())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ConditionalAction(lambda o: True, [Recorder(), 3])  # type: ignore[list-item]


# ================================================================== PeriodicAction


def drive(action, controller: FakeController, steps, output=None) -> None:
    for step in steps:
        controller.global_step = step
        action(output if output is not None else {"step": step})


def test_periodic_action_fires_on_crossing_not_only_landing() -> None:
    recorder = Recorder()
    action = PeriodicAction(recorder, every_n_steps=5)
    controller = FakeController(0)
    action.attach(controller)
    drive(action, controller, [3, 6, 9, 12])
    assert [o["step"] for o in recorder.outputs] == [6, 12]


def test_periodic_action_landing_and_multiple_crossings() -> None:
    recorder = Recorder()
    action = PeriodicAction(recorder, every_n_steps=5)
    controller = FakeController(0)
    action.attach(controller)
    drive(action, controller, [5, 10, 11, 14, 15, 40, 41])
    assert [o["step"] for o in recorder.outputs] == [5, 10, 15, 40]  # 20..40 crossed: once
    every = Recorder()
    each = PeriodicAction(every, every_n_steps=1)
    each.attach(FakeController(0))
    drive(each, each._run, [1, 2, 3])
    assert len(every.outputs) == 3


def test_periodic_action_counts_from_the_step_at_attach() -> None:
    """Resumed at step 6 (after the run acted at 6 for multiple 5): no action at 9."""
    recorder = Recorder()
    action = PeriodicAction(recorder, every_n_steps=5)
    controller = FakeController(6)
    action.attach(controller)
    drive(action, controller, [9, 12])
    assert [o["step"] for o in recorder.outputs] == [12]


def test_periodic_action_counts_from_the_controllers_restored_step() -> None:
    """The Controller attaches before restoring: the restored step is read at the first call."""
    recorder = Recorder()
    action = PeriodicAction(recorder, every_n_steps=5)
    controller = FakeController(0)
    action.attach(controller)  # before the restore
    controller.global_step = controller.restored_step = 6  # the restore (no state for the action)
    drive(action, controller, [9, 12])
    assert [o["step"] for o in recorder.outputs] == [12]


def test_periodic_action_state_survives_restart_as_an_eval_action() -> None:
    """Evaluations at 4, 8 (every_n=6 acts at 8); checkpoint at 10; the next eval at 12 acts in an
    uninterrupted run, so it must after the resume too (the reference is 8, not 10)."""
    uninterrupted, rec_a = FakeController(0), Recorder()
    a = PeriodicAction(rec_a, every_n_steps=6)
    a.attach(uninterrupted)
    drive(a, uninterrupted, [4, 8])
    uninterrupted.global_step = 10
    state = json.loads(json.dumps(a.state_dict()))
    drive(a, uninterrupted, [12, 16])

    rec_b = Recorder()
    b = PeriodicAction(rec_b, every_n_steps=6)
    b.load_state_dict(state)  # restored, then attached at the restored step 10
    resumed = FakeController(10)
    b.attach(resumed)
    drive(b, resumed, [12, 16])
    assert [o["step"] for o in rec_a.outputs] == [8, 12]
    assert [o["step"] for o in rec_b.outputs] == [12]

    c = PeriodicAction(Recorder(), every_n_steps=6)  # attached first, then restored
    c.attach(FakeController(0))
    c.load_state_dict(state)
    assert c.last_step == 8


def test_periodic_action_after_a_rollback_acts_again() -> None:
    recorder = Recorder()
    action = PeriodicAction(recorder, every_n_steps=5)
    controller = FakeController(0)
    action.attach(controller)
    drive(action, controller, [3, 6, 3, 6])
    assert [o["step"] for o in recorder.outputs] == [6, 6]


def test_periodic_action_unattached_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="attach"):
        PeriodicAction(Recorder(), every_n_steps=5)({"x": 1})


def test_periodic_action_declares_what_it_wraps_and_carries_state() -> None:
    inner, best = Recorder(), NewBestMetric("acc")
    action = PeriodicAction([inner, best.commit], every_n_steps=2)
    assert action.wrapped() == [inner, best]  # the Controller attaches them, not the wrapper
    controller = FakeController(0)
    action.attach(controller)
    assert inner.attached == []
    drive(action, controller, [2], output={"acc": 0.5})
    assert best.best_value == 0.5
    state = json.loads(json.dumps(action.state_dict()))
    assert state["last_step"] == 2 and state["actions"]["1/NewBestMetric"]["best_value"] == 0.5


@pytest.mark.parametrize("bad", [0, -5, 2.5, True, None])
def test_periodic_action_validates_every_n_steps(bad) -> None:
    with pytest.raises(ValueError, match="every_n_steps"):
        PeriodicAction(Recorder(), every_n_steps=bad)


def test_periodic_action_wrapping_a_conditional_action() -> None:
    recorder = Recorder()
    inner = ConditionalAction(lambda o: o["acc"] > 0.5, recorder)
    action = PeriodicAction(inner, every_n_steps=4)
    controller = FakeController(0)
    action.attach(controller)
    for step, acc in [(2, 0.9), (4, 0.4), (6, 0.9), (8, 0.9)]:
        controller.global_step = step
        action({"acc": acc, "step": step})
    assert [o["step"] for o in recorder.outputs] == [8]


# ================================================================== EarlyStopping


def stop_index(stopper: EarlyStopping, values, controller: FakeController | None = None, start: int = 0):
    """Feed values from ``start``; the index of the evaluation that raised StopTraining, or None."""
    for i in range(start, len(values)):
        if controller is not None:
            controller.global_step = (i + 1) * 100
        try:
            stopper({"acc": values[i]})
        except StopTraining:
            return i
    return None


def test_early_stopping_plateau_stops_at_exactly_patience() -> None:
    values = [0.1, 0.2, 0.3, 0.3, 0.29, 0.3, 0.35]
    stopper = EarlyStopping("acc", patience=3)
    assert stop_index(stopper, values) == 5  # 3 evaluations (3, 4, 5) without a strict improvement
    assert stopper.best_value == 0.3 and stopper.wait == 3
    assert stop_index(EarlyStopping("acc", patience=4), values) is None


def test_early_stopping_improvement_resets_the_count() -> None:
    values = [1.0, 0.9, 0.9, 1.1, 1.0, 1.0, 1.0]
    assert stop_index(EarlyStopping("acc", patience=3), values) == 6


def test_early_stopping_reason_names_metric_best_and_step() -> None:
    stopper = EarlyStopping("acc", patience=2)
    controller = FakeController()
    stopper.attach(controller)
    with pytest.raises(StopTraining) as info:
        for step, value in [(100, 0.5), (200, 0.7), (300, 0.6), (400, 0.7)]:
            controller.global_step = step
            stopper({"acc": value})
    reason = info.value.reason
    assert "acc" in reason and "0.7" in reason and "step 200" in reason and "2 evaluations" in reason
    assert stopper.best_step == 200
    with pytest.raises(StopTraining):  # still no improvement: stops again
        stopper({"acc": 0.7})


def test_early_stopping_min_delta() -> None:
    # Creeping by 0.05 < min_delta never moves the best: patience runs out.
    creeping = [1.0, 1.04, 1.08, 1.09]
    stopper = EarlyStopping("acc", patience=3, min_delta=0.1)
    assert stop_index(stopper, creeping) == 3 and stopper.best_value == 1.0
    # An improvement by more than min_delta resets; exactly min_delta does not count.
    stopper = EarlyStopping("acc", patience=2, min_delta=0.5)
    assert stop_index(stopper, [1.0, 1.5, 2.01, 2.5, 2.51]) == 4
    assert stopper.best_value == 2.01


def test_early_stopping_lower_is_better() -> None:
    values = [3.0, 2.0, 2.5, 1.9, 1.95, 1.9, 2.0]
    stopper = EarlyStopping("loss", patience=3, higher_is_better=False)
    with pytest.raises(StopTraining, match="decreased"):
        for v in values:
            stopper({"loss": v})
    assert stopper.best_value == 1.9 and stopper.wait == 3
    assert stop_index(EarlyStopping("acc", patience=2, min_delta=0.2, higher_is_better=False), [1.0, 0.9, 0.85]) == 2


def test_early_stopping_nan_is_no_improvement() -> None:
    stopper = EarlyStopping("acc", patience=2)
    assert stop_index(stopper, [NAN, 0.5, NAN, INF]) == 3
    assert stopper.best_value == 0.5
    assert stop_index(EarlyStopping("acc", patience=2), [NAN, NAN]) == 1


def test_early_stopping_baseline() -> None:
    stopper = EarlyStopping("acc", patience=2, baseline=0.8)
    assert stop_index(stopper, [0.5, 0.79, 0.9]) == 1
    stopper = EarlyStopping("acc", patience=2, baseline=0.8)
    assert stop_index(stopper, [0.5, 0.81, 0.7, 0.81, 0.82]) == 3
    with pytest.raises(StopTraining, match="baseline"):
        EarlyStopping("acc", patience=1, baseline=0.8)({"acc": 0.1})


@pytest.mark.parametrize(
    "values, patience, min_delta",
    [
        ([0.1, 0.2, 0.3, 0.3, 0.29, 0.3, 0.35, 0.2], 3, 0.0),
        ([1.0, 1.05, 1.2, 1.21, 1.5, 1.5, 1.5, 1.5, 1.5], 2, 0.1),
        ([NAN, 0.5, 0.4, NAN, 0.6, 0.6, 0.6, 0.6], 3, 0.0),
    ],
)
def test_early_stopping_resume_stops_at_the_same_evaluation(values, patience, min_delta) -> None:
    uninterrupted = stop_index(EarlyStopping("acc", patience, min_delta), values)
    assert uninterrupted is not None
    for cut in range(1, uninterrupted + 1):  # killed after `cut` evaluations, resumed from then
        first = EarlyStopping("acc", patience, min_delta)
        assert stop_index(first, values[:cut]) is None
        state = json.loads(json.dumps(first.state_dict()))
        resumed = EarlyStopping("acc", patience, min_delta)
        resumed.load_state_dict(state)
        assert stop_index(resumed, values, start=cut) == uninterrupted, cut


def test_early_stopping_state_dict_contents_and_mismatch(caplog) -> None:
    stopper = EarlyStopping("acc", patience=5)
    controller = FakeController(100)
    stopper.attach(controller)
    stopper({"acc": 0.5})
    controller.global_step = 200
    stopper({"acc": 0.4})
    state = stopper.state_dict()
    assert state == {"best_value": 0.5, "best_step": 100, "wait": 1, "metric": "acc", "higher_is_better": True}
    other = EarlyStopping("loss", patience=5)
    other.load_state_dict(state)
    assert other.best_value is None and other.wait == 0 and "ignoring" in caplog.text
    with pytest.raises(ValueError):
        EarlyStopping("acc", patience=5).load_state_dict({"wait": -1})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"patience": 0},
        {"patience": 1.5},
        {"patience": True},
        {"patience": 2, "min_delta": -0.1},
        {"patience": 2, "min_delta": NAN},
        {"patience": 2, "baseline": NAN},
    ],
)
def test_early_stopping_validates_arguments(kwargs) -> None:
    with pytest.raises(ValueError):
        EarlyStopping("acc", **kwargs)


def test_early_stopping_missing_metric_is_an_error() -> None:
    with pytest.raises(MetricNotFoundError, match="'acc'.*'loss'"):
        EarlyStopping("acc", patience=1)({"loss": 1.0})


# ================================================================== with the real Controller


class CountingTrainer:
    def __init__(self) -> None:
        self.step = 0

    @property
    def global_step(self) -> int:
        return self.step

    def train(self, num_steps: int):
        self.step += num_steps
        return {"loss": 1.0}

    def save_checkpoint(self, writer):
        return {"global_step": self.step}

    def load_checkpoint(self, reader, state):
        self.step = state["global_step"]


class ScriptedEvaluator:
    def __init__(self, trainer: CountingTrainer, values: dict[int, float]) -> None:
        self.trainer = trainer
        self.values = values

    def evaluate(self, num_steps: int):
        return {"acc": self.values[self.trainer.step]}


def test_controller_checkpoints_early_stopping_and_best_metric(tmp_path: Path) -> None:
    from cadence import Controller
    from cadence.checkpoint import CheckpointManager

    values = {10: 0.5, 20: 0.6, 30: 0.6, 40: 0.55, 50: 0.6, 60: 0.9}

    def build() -> tuple[Controller, EarlyStopping, NewBestMetric]:
        trainer = CountingTrainer()
        stopper, best = EarlyStopping("acc", patience=3), NewBestMetric("acc")
        controller = Controller(
            trainer,
            ScriptedEvaluator(trainer, values),
            CheckpointManager(str(tmp_path / "checkpoints")),
            steps_per_loop=10,
            checkpoint_interval=10,
            eval_actions=[ConditionalAction(best.test, best.commit), stopper],
            progress=False,
        )
        stopper.attach(controller)
        return controller, stopper, best

    first, stopper, best = build()
    first.train_and_evaluate(train_steps=30, eval_interval=10)  # interrupted after step 30
    assert stopper.wait == 1 and best.best_value == 0.6

    resumed, stopper2, best2 = build()
    assert resumed.global_step == 30
    assert stopper2.wait == 1 and best2.best_value == 0.6  # restored from the checkpoint
    resumed.train_and_evaluate(train_steps=60, eval_interval=10)
    assert resumed.stop_reason is not None and "acc" in resumed.stop_reason
    assert resumed.global_step == 50  # 30, 40, 50 without improvement: stops as an uninterrupted run
    assert "step 20" in resumed.stop_reason


def test_controller_attaches_and_checkpoints_periodic_action(tmp_path: Path) -> None:
    from cadence import Controller
    from cadence.checkpoint import CheckpointManager

    def build(actions) -> Controller:
        return Controller(
            CountingTrainer(),
            checkpoint_manager=CheckpointManager(str(tmp_path / "checkpoints")),
            steps_per_loop=3,
            train_actions=actions,
            progress=False,
        )

    uninterrupted = Recorder()
    other = tmp_path / "other"
    Controller(CountingTrainer(), checkpoint_manager=CheckpointManager(str(other)), steps_per_loop=3,
               train_actions=[PeriodicAction(uninterrupted, 5)], progress=False).train(12)

    first = Recorder()
    build([PeriodicAction(first, 5)]).train(6)  # attached by the controller; stops at 6
    second = Recorder()
    resumed = build([PeriodicAction(second, 5)])
    assert resumed.global_step == 6
    resumed.train(12)
    assert [o["loss"] for o in uninterrupted.outputs] == [1.0, 1.0]  # at 6 and 12
    assert len(first.outputs) == 1 and len(second.outputs) == 1  # at 6, then at 12 (not at 9)

    added = Recorder()  # an action new in this run (no saved state): the restored step counts
    build([Recorder(), PeriodicAction(added, 4)]).train(18)  # from 12: loops end at 15, 18
    assert len(added.outputs) == 1  # at 18 (crossed 16); not at 15, as a reference of 0 would
