"""Named evaluation splits: ``build_inputs("validation")`` returning ``{name: iterable}`` gives
nested metrics ``{name: {metric: value}}``; the core reads them as ``name/metric``."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cadence.actions import EarlyStopping
from cadence.actions.best_checkpoint import _jsonable
from cadence.actions.metric_path import get_metric
from cadence.config.components.ema import EMAConfig
from cadence.errors import SanityCheckError, StopTraining, ValidationOutputError
from cadence.loop.reports import LoopReports
from cadence.loop.sanity import sanity_check
from cadence.metrics import Sum
from cadence.sidecar.continuous import BestTracker
from cadence.summaries.scalars import json_value
from cadence.sweep.trials import best_value
from cadence.torch import Context, Task, TorchEvaluator
from cadence.torch.components.ema import ModelEMA


def numbers(lo: int, hi: int, batch_size: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(float(lo), float(hi))), batch_size=batch_size)


class Splits(Task):
    """Validation: ``{"a": 0..9 in batches of 3, "b": 10..13 in batches of 4}`` (``one_shot``: generators)."""

    def build_model(self):
        return nn.Linear(1, 1)

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def build_inputs(self, split, ctx):
        self.params["built"] = self.params.get("built", 0) + 1
        data = {"a": numbers(0, 10, 3), "b": numbers(10, 14, 4)}
        if self.params.get("one_shot"):
            return {name: iter(list(loader)) for name, loader in data.items()}
        return data

    def train_step(self, model, batch):
        return model(batch[0][:, None]).mean()

    def build_metrics(self):
        return {"total": Sum()}

    def validation_step(self, model, batch):
        (x,) = batch
        return {"mean": x.mean(), "total": x, "shift": model(x[:, None]).mean()}

    def aggregate_logs(self, state, step_outputs):
        return (state or 0) + 1

    def reduce_aggregated_logs(self, aggregated_logs, global_step):
        return {"batches": aggregated_logs}


def evaluator(task: Task, **kw) -> TorchEvaluator:
    torch.manual_seed(0)
    return TorchEvaluator(task, task.build_model(), ctx=Context(), **kw)


def test_each_split_has_its_own_means_reducers_and_aggregated_logs_in_the_mappings_order():
    logs = evaluator(Splits()).evaluate()
    assert list(logs) == ["a", "b"]
    assert logs["a"]["mean"] == pytest.approx(4.5)  # batches of 3, 3, 3, 1: weighted by batch size
    assert logs["b"]["mean"] == pytest.approx(11.5)
    assert logs["a"]["total"] == 45 and logs["b"]["total"] == 46  # a fresh reducer for each split
    assert logs["a"]["batches"] == 4 and logs["b"]["batches"] == 1  # an aggregate_logs state per split


def test_num_steps_applies_to_each_split_and_the_inputs_are_built_once():
    task = Splits()
    ev = evaluator(task)
    logs = ev.evaluate(2)
    assert logs["a"]["mean"] == pytest.approx(2.5) and logs["a"]["batches"] == 2  # 0..5
    assert logs["b"]["mean"] == pytest.approx(11.5) and logs["b"]["batches"] == 1  # b has one batch
    assert ev.evaluate(2) == logs and task.params["built"] == 1


def test_a_split_that_is_a_one_shot_iterator_is_built_afresh_for_each_evaluation():
    task = Splits(one_shot=True)
    ev = evaluator(task)
    first = ev.evaluate()
    assert ev.evaluate() == first and first["a"]["total"] == 45 and task.params["built"] == 2


def test_ema_with_evaluate_raw_names_the_raw_splits_raw_slash_split():
    task = Splits()
    model = task.build_model()
    ema = ModelEMA(model, EMAConfig(decay=0.5, evaluate_raw=True))
    with torch.no_grad():
        model.bias += 1.0  # the raw weights differ from the EMA's
    logs = TorchEvaluator(task, model, ctx=Context(), ema=ema).evaluate()
    assert list(logs) == ["a", "b", "raw/a", "raw/b"]
    assert get_metric(logs, "raw/a/shift") == pytest.approx(get_metric(logs, "a/shift") + 1.0)
    assert logs["raw/b"]["total"] == 46


@pytest.mark.parametrize("splits, named", [({}, "with no split"), ({"a/b": []}, "'a/b'"), ({"": []}, "''")])
def test_a_bad_split_name_is_one_line(splits, named):
    class Bad(Splits):
        def build_inputs(self, split, ctx):
            return splits

    with pytest.raises(ValidationOutputError) as e:
        evaluator(Bad()).evaluate()
    assert named in str(e.value) and "\n" not in str(e.value)
    assert "non-empty strings without '/'" in str(e.value)


def test_the_sanity_check_runs_the_splits_and_checks_nested_metric_names():
    ev = evaluator(Splits())
    metrics = sanity_check(ev, [EarlyStopping("b/mean", patience=1)], 1)
    assert metrics["a"]["batches"] == metrics["b"]["batches"] == 1
    with pytest.raises(SanityCheckError, match=r"'b/men' is not in the evaluation outputs; available: "
                                               r"'a/batches', 'a/mean', 'a/shift', 'a/total', 'b/batches'"):
        sanity_check(ev, [EarlyStopping("b/men", patience=1)], 1)


def test_early_stopping_on_a_nested_metric():
    stop = EarlyStopping("val/loss", patience=2, higher_is_better=False)
    stop({"train": {"loss": 1.0}, "val": {"loss": 1.0}})
    stop({"train": {"loss": 0.5}, "val": {"loss": 1.1}})  # the train split improving does not count
    with pytest.raises(StopTraining, match="val/loss"):
        stop({"train": {"loss": 0.2}, "val": {"loss": 1.2}})


def test_json_records_of_nested_metrics():
    metrics = {"train": {"loss": torch.tensor(0.5)}, "val": {"loss": float("nan"), "n": 3}, "lr": 0.1}
    assert json.dumps(json_value(metrics)) == '{"train": {"loss": 0.5}, "val": {"loss": "nan", "n": 3}, "lr": 0.1}'
    assert _jsonable(metrics) == {"train/loss": 0.5, "val/loss": "nan", "val/n": 3, "lr": 0.1}  # best.json


def test_the_sidecars_best_reads_a_nested_metric():
    tracker = BestTracker("val/loss", higher_is_better=False)
    best = None
    for step, value in [(4, 2.0), (8, 1.5), (12, 1.7)]:
        record = {"step": step, "status": "evaluated", "metrics": {"train": {"loss": 0.1}, "val": {"loss": value}}}
        best = tracker.update(best, record)
    assert best == {"metric": "val/loss", "step": 8, "value": 1.5}


def test_the_eval_log_line_and_a_sweeps_objective_name_nested_metrics(tmp_path, caplog):
    reports = LoopReports(None, str(tmp_path / "eval"), chief=True, summary_interval=None, hooks=None)
    with caplog.at_level(logging.INFO, logger="cadence"):
        for step, loss in [(4, 2.0), (8, 1.5)]:
            reports.after_evaluation(step, {"train": {"loss": loss / 2}, "val": {"loss": loss}}, 0.1)
    assert "eval at step 8 (0.1s): train/loss=0.75  val/loss=1.5" in caplog.text
    reports.eval.close()
    assert best_value(tmp_path, "val/loss", "minimize") == (1.5, 8)  # from eval/metrics.jsonl
