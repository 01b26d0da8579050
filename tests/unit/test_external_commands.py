"""External evaluators without processes: the ``evaluators:`` settings and their one-line errors, the
templates, finding and flattening a JSON result, and the record a sidecar writes from an evaluator that
reports its commands (the commands themselves, in real processes: tests/processes/test_external_evaluators.py)."""

from __future__ import annotations

import json
import math
import os
import typing

import pytest

from cadence.config import EXPORT_FORMATS, config_from_dict
from cadence.config.components.external_evaluators import (EXTERNAL_FORMATS, TEMPLATE_FIELDS, ExternalEvaluatorConfig,
                                                           ExternalFormat, template_fields)
from cadence.errors import ConfigError
from cadence.sidecar.evaluator import SidecarEvaluator
from cadence.sidecar.external import ExternalEvaluators, ReportsExternal
from cadence.sidecar.external_results import (ResultError, command_argv, last_json_object, last_line, newest_match,
                                              read_result, to_metrics)
from cadence.summaries.metrics_file import read_metrics
from test_sidecar import FakeEvaluator, train

LM_EVAL = {"results": {"arc": {"alias": "arc", "acc,none": 0.25, "acc_stderr,none": 0.01,
                               "exact_match,strict-match": 0.5, "sample_len": 40, "flag": True,
                               "nan": float("nan"), "list": [1, 2], "none": None}},
           "config": {"model": "hf"}, "n-shot": {"arc": 0}}


def spec(**fields) -> ExternalEvaluatorConfig:
    return ExternalEvaluatorConfig(**{"name": "ev", "command": "run {step}", **fields})


def load_error(evaluators) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict({"task": {"class": "x.py:T"}, "evaluators": evaluators})
    assert "\n" not in str(e.value)
    return str(e.value)


# -- the settings ----------------------------------------------------------------------------------


def test_defaults_and_the_metric_prefix():
    s = spec()
    assert (s.format, s.result, s.select, s.retries, s.on) == ("none", "stdout", None, 1, ["sidecar", "evaluate"])
    assert s.metric_prefix == "ev" and spec(prefix="lm_eval/x").metric_prefix == "lm_eval/x"
    cfg = config_from_dict({"task": {"class": "x.py:T"}})
    assert cfg.evaluators == []


def test_formats_are_none_and_the_export_formats():
    assert set(EXTERNAL_FORMATS) == {"none", *EXPORT_FORMATS} and typing.get_args(ExternalFormat) == EXTERNAL_FORMATS


@pytest.mark.parametrize("evaluators, words", [
    ([{"name": "a", "command": "echo {stp}"}], "evaluators[0].command: unknown template field {stp}"),
    ([{"name": "a", "command": ["x", "{step:>4}"]}], "unknown template field {step:>4}"),
    ([{"name": "a", "command": "x {"}], "evaluators[0].command: bad template"),
    ([{"name": "a", "command": "x", "result": "{output_dir}/{nope}.json"}], "evaluators[0].result: unknown template"),
    ([{"name": "a", "command": "x", "env": {"V": "{bad}"}}], "evaluators[0].env: unknown template field {bad}"),
    ([{"name": "a", "command": "x {export_dir}"}], "{export_dir} needs a format"),
    ([{"name": "a", "command": "x {export_dir}", "format": "gguf"}], "evaluators[0].format: expected one of 'none'"),
    ([{"name": "a"}], "evaluators[0].command: required field missing"),
    ([{"name": "a", "command": 5}], "evaluators[0].command: expected a command line (a string) or a list"),
    ([{"name": "a", "command": "  "}], "command is empty"),
    ([{"name": "a", "command": []}], "command is empty"),
    ([{"name": "a", "command": "echo 'x"}], "No closing quotation"),
    ([{"name": "a", "command": "x"}, {"name": "a", "command": "y"}], "'a' given more than once"),
    ([{"name": "a", "command": "x {checkpoint_dir}", "on": ["train"]}], "{checkpoint_dir} is not known in-process"),
    ([{"name": "a", "command": "x", "on": ["cron"]}], "evaluators[0].on[0]: expected one of 'sidecar'"),
    ([{"name": "a", "command": "x", "on": []}], "evaluators[0].on"),
    ([{"name": "a b", "command": "x"}], "evaluators[0].name"),
    ([{"name": "a", "command": "x", "retries": 11}], "evaluators[0].retries"),
    ([{"name": "a", "command": "x", "timeout_s": 0}], "evaluators[0].timeout_s"),
    ([{"name": "a", "command": "x", "prefix": "/p"}], "evaluators[0].prefix"),
    ([{"name": "a", "command": "x", "shell": True}], "evaluators[0].shell"),
])
def test_bad_settings_are_one_line_config_errors_at_load(evaluators, words):
    assert words in load_error(evaluators)


def test_template_fields_are_the_documented_ones():
    assert template_fields("{export_dir}/{step}-{{literal}}") == ["export_dir", "step"]
    assert set(TEMPLATE_FIELDS) == {"export_dir", "checkpoint_dir", "step", "model_dir", "output_dir"}


# -- templates ----------------------------------------------------------------------------------


def test_a_string_command_is_split_before_it_is_filled_in():
    values = {"export_dir": "/a dir/x", "step": "7", "output_dir": "/o", "checkpoint_dir": "", "model_dir": "m"}
    s = spec(command="lm_eval --model_args 'pretrained={export_dir},dtype=float32' --out {output_dir} {{x}}",
             format="hf")
    assert command_argv(s, values) == ["lm_eval", "--model_args", "pretrained=/a dir/x,dtype=float32", "--out", "/o",
                                       "{x}"]
    assert command_argv(spec(command=["run", "{step} and {model_dir}"]), values) == ["run", "7 and m"]


# -- the result -----------------------------------------------------------------------------------


def test_the_last_json_object_line_of_stdout_wins():
    out = 'loading...\n{"a": 1}\n| table |\n{"b": 2}\n{not json}\n[1, 2]\ndone\n'
    assert last_json_object(out) == {"b": 2}
    assert last_json_object(json.dumps({"pretty": {"x": 1}}, indent=2)) == {"pretty": {"x": 1}}
    assert last_json_object("no json here\n") is None and last_json_object("[1]") is None


def test_lm_eval_results_flatten_under_the_prefix_numbers_only():
    assert to_metrics(LM_EVAL, "results", "lm_eval") == {
        "lm_eval/arc/acc": 0.25, "lm_eval/arc/acc_stderr": 0.01, "lm_eval/arc/exact_match/strict-match": 0.5,
        "lm_eval/arc/sample_len": 40}
    assert to_metrics({"a": {"b": 1, "c": {"d": 2.5}}}, None, "p") == {"p/a/b": 1, "p/a/c/d": 2.5}
    assert to_metrics(LM_EVAL, "results/arc", "x")["x/acc"] == 0.25
    with pytest.raises(ResultError, match="no 'scores' object"):
        to_metrics(LM_EVAL, "scores", "x")
    with pytest.raises(ResultError, match="not an object"):
        to_metrics(LM_EVAL, "results/arc/acc,none", "x")


def test_a_result_file_is_the_newest_glob_match(tmp_path):
    (tmp_path / "model_a").mkdir()
    old, new = tmp_path / "model_a" / "results_1.json", tmp_path / "model_a" / "results_2.json"
    old.write_text(json.dumps({"v": 1}))
    new.write_text(json.dumps({"v": 2}))
    os.utime(old, (1, 1))
    assert newest_match(str(tmp_path / "**" / "results_*.json")) == str(new)
    s = spec(result="{output_dir}/**/results_*.json")
    assert read_result(s, {"output_dir": str(tmp_path)}, "ignored stdout") == {"v": 2}
    with pytest.raises(ResultError, match="no result file"):
        read_result(spec(result="{output_dir}/none.json"), {"output_dir": str(tmp_path)}, "")
    new.write_text("[1]")
    os.utime(old, (1, 1))
    with pytest.raises(ResultError, match="holds no JSON object"):
        read_result(s, {"output_dir": str(tmp_path)}, "")
    with pytest.raises(ResultError, match="no JSON object on its standard output"):
        read_result(spec(), {}, "plain text")


def test_the_last_line_of_a_failure_prefers_stderr():
    assert last_line("warning\nTraceback\nValueError: bad\n\n", "out") == "ValueError: bad"
    assert last_line("", "a\r\nprogress 100%\r\n") == "progress 100%"
    assert last_line("x" * 600).endswith("...") and len(last_line("x" * 600)) == 500
    assert last_line("", "") == ""


def test_only_the_formats_the_commands_name_are_exported(tmp_path):
    runner = ExternalEvaluators([spec(format="hf"), spec(name="b"), spec(name="c", format="hf"),
                                 spec(name="d", format="safetensors")], "m", work_dir=str(tmp_path))
    assert runner.formats() == ["hf", "safetensors"]
    assert ExternalEvaluators([spec()], "m").formats() == []


# -- the record ----------------------------------------------------------------------------------


class ReportingEvaluator(FakeEvaluator):
    """A fake evaluator whose evaluations ran external commands: a failed one at step 6 (its metric NaN)."""

    def evaluate(self, num_steps: int):
        metrics = super().evaluate(num_steps)
        if self.step == 6:
            self.report = {"ext": {"status": "failed", "exit": 3, "last_line": "boom", "attempts": 2}}
            return {**metrics, "ext/score": math.nan}
        self.report = {"ext": {"status": "ok", "exit": 0, "attempts": 1}}
        return {**metrics, "ext/score": self.step / 10}

    def external_report(self):
        return self.report


def test_the_sidecar_records_what_each_command_did_and_a_failed_one_is_no_best(tmp_path):
    train(tmp_path, steps=6)
    ev = ReportingEvaluator()
    assert isinstance(ev, ReportsExternal) and not isinstance(FakeEvaluator(), ReportsExternal)
    result = SidecarEvaluator(ev, str(tmp_path), poll_interval=0.01, best_metric="ext/score").start()
    rows = read_metrics(tmp_path / "eval" / "evaluations.jsonl")
    assert [r["external"]["ext"]["status"] for r in rows] == ["ok", "ok", "failed"]
    assert rows[2]["external"]["ext"] == {"status": "failed", "exit": 3, "last_line": "boom", "attempts": 2}
    assert rows[2]["status"] == "evaluated" and rows[2]["metrics"]["accuracy"] == 0.9
    assert result.best == {"metric": "ext/score", "step": 4, "value": 0.4}  # not the failed step's NaN
    plain = tmp_path / "plain"
    train(plain, steps=2)
    SidecarEvaluator(FakeEvaluator(), str(plain), poll_interval=0.01).start()
    assert "external" not in read_metrics(plain / "eval" / "evaluations.jsonl")[0]


def test_a_failed_export_fails_its_commands_without_running_them(tmp_path):
    def export(fmt, directory):
        raise RuntimeError(f"no {fmt} today")

    runner = ExternalEvaluators([spec(command="never-started {export_dir}", format="hf")], "m", work_dir=str(tmp_path))
    metrics, report = runner.run(4, None, export)
    assert metrics == {}
    assert report == {"ev": {"status": "failed", "exit": None, "attempts": 0, "duration_s": 0.0,
                             "last_line": "exporting the weights as hf failed: RuntimeError: no hf today"}}
    assert not (tmp_path / "ev").exists() and not list(tmp_path.iterdir())  # nothing ran; the export is gone
