"""Roles from the argument / CADENCE_ROLE / TF_CONFIG, and train_and_evaluate's dispatch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cadence.cluster.roles import ClusterSpec, resolve_role
from cadence.config import ExperimentConfig, config_from_dict
from cadence.errors import ConfigError


def tf(cluster: dict | None = None, task: dict | None = None) -> dict[str, str]:
    data: dict[str, Any] = {}
    if cluster is not None:
        data["cluster"] = cluster
    if task is not None:
        data["task"] = task
    return {"TF_CONFIG": json.dumps(data)}


CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]}


def error(environ: dict[str, str], explicit: str | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_role(environ, explicit)
    return str(info.value)


# --- defaults and precedence -----------------------------------------------------------------


def test_default_is_a_lone_chief() -> None:
    assert resolve_role({}) == ClusterSpec("chief", 0, False, "default")


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENCE_ROLE", "Evaluator")
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("CADENCE_SIDECAR", raising=False)
    assert resolve_role() == ClusterSpec("evaluator", 0, True, "CADENCE_ROLE")


@pytest.mark.parametrize("value", ["worker", "WORKER", " Worker "])
def test_cadence_role_case_insensitive(value: str) -> None:
    assert resolve_role({"CADENCE_ROLE": value}) == ClusterSpec("worker", 0, False, "CADENCE_ROLE")


def test_precedence_argument_over_cadence_role_over_tf_config() -> None:
    env = {"CADENCE_ROLE": "worker", **tf(CLUSTER, {"type": "chief", "index": 0})}
    assert resolve_role(env).role == "worker"
    assert resolve_role(env).source == "CADENCE_ROLE"
    spec = resolve_role(env, explicit="evaluator")
    assert (spec.role, spec.source, spec.has_evaluator) == ("evaluator", "argument", True)
    env.pop("CADENCE_ROLE")
    assert resolve_role(env) == ClusterSpec("chief", 0, False, "TF_CONFIG")


def test_empty_variables_are_unset() -> None:
    assert resolve_role({"CADENCE_ROLE": "", "TF_CONFIG": "  ", "CADENCE_SIDECAR": ""}).source == "default"


@pytest.mark.parametrize(
    "explicit,env,source",
    [("boss", {}, "role"), (None, {"CADENCE_ROLE": "ps"}, "CADENCE_ROLE")],
)
def test_bad_role_names_source_and_valid_values(explicit, env, source) -> None:
    msg = error(env, explicit)
    assert msg.startswith(f"{source}: ")
    assert repr(explicit or env["CADENCE_ROLE"]) in msg
    assert "chief, worker, evaluator" in msg


# --- has_evaluator ---------------------------------------------------------------------------


def test_sidecar_flag_and_evaluator_in_cluster_mean_has_evaluator() -> None:
    assert resolve_role({"CADENCE_SIDECAR": "1"}) == ClusterSpec("chief", 0, True, "default")
    assert resolve_role({"CADENCE_SIDECAR": "0"}).has_evaluator is False
    assert resolve_role({"CADENCE_SIDECAR": "1", "CADENCE_ROLE": "worker"}).has_evaluator
    with_eval = tf({**CLUSTER, "evaluator": ["h3:2222"]}, {"type": "worker", "index": 1})
    assert resolve_role(with_eval) == ClusterSpec("worker", 1, True, "TF_CONFIG")
    # the cluster's evaluator counts even when the role comes from elsewhere
    assert resolve_role({**with_eval, "CADENCE_ROLE": "chief"}).has_evaluator
    assert resolve_role(tf(CLUSTER, {"type": "worker", "index": 1})).has_evaluator is False


def test_bad_sidecar_flag() -> None:
    msg = error({"CADENCE_SIDECAR": "maybe"})
    assert msg.startswith("CADENCE_SIDECAR: ") and "'maybe'" in msg


# --- TF_CONFIG -------------------------------------------------------------------------------


def test_tf_config_roles() -> None:
    assert resolve_role(tf(CLUSTER, {"type": "chief", "index": 0})) == ClusterSpec("chief", 0, False, "TF_CONFIG")
    assert resolve_role(tf(CLUSTER, {"type": "worker", "index": 1})) == ClusterSpec("worker", 1, False, "TF_CONFIG")
    assert resolve_role(tf(CLUSTER, {"type": "worker"})).index == 0  # index defaults to 0
    # the evaluator is not part of the cluster
    assert resolve_role(tf(CLUSTER, {"type": "evaluator", "index": 0})) == ClusterSpec(
        "evaluator", 0, True, "TF_CONFIG")
    assert resolve_role(tf(None, {"type": "evaluator", "index": 0})).role == "evaluator"
    # no cluster at all: a single chief
    assert resolve_role(tf(None, {"type": "chief", "index": 0})).role == "chief"
    assert resolve_role(tf({}, None)).source == "default"


def test_master_is_chief() -> None:
    cluster = {"master": ["h0:2222"], "worker": ["h1:2222"]}
    assert resolve_role(tf(cluster, {"type": "master", "index": 0})) == ClusterSpec("chief", 0, False, "TF_CONFIG")
    assert resolve_role(tf(cluster, {"type": "worker", "index": 0})).role == "worker"
    assert resolve_role(tf(cluster, {"type": "CHIEF", "index": 0})).role == "chief"


def test_malformed_json_names_tf_config_and_the_json_error() -> None:
    msg = error({"TF_CONFIG": '{"task": {"type": "chief",}}'})
    assert msg.startswith("TF_CONFIG: not valid JSON: ")
    assert "line 1 column" in msg


@pytest.mark.parametrize(
    "text,expected",
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"cluster": ["h0"]}', "'cluster' must be an object"),
        ('{"cluster": {"worker": "h0:1"}}', "cluster.worker must be a list"),
        ('{"task": "chief"}', "'task' must be an object"),
        ('{"task": {"index": 0}}', "task.type is missing"),
        ('{"task": {"type": "boss"}}', "task.type 'boss' is not a role"),
        ('{"task": {"type": "chief", "index": "0"}}', "task.index must be a non-negative integer, got '0'"),
        ('{"task": {"type": "chief", "index": -1}}', "task.index must be a non-negative integer, got -1"),
        ('{"task": {"type": "chief", "index": true}}', "task.index must be a non-negative integer, got True"),
        ('{"cluster": {"chief": ["h0"]}}', "has a 'cluster' but no 'task'"),
        ('{"cluster": {"chief": ["h0"], "gpu": ["h1"]}, "task": {"type": "chief"}}',
         "cluster.gpu: unknown job name"),
    ],
)
def test_malformed_tf_config(text: str, expected: str) -> None:
    msg = error({"TF_CONFIG": text})
    assert msg.startswith("TF_CONFIG: ")
    assert expected in msg


def test_ps_is_refused_with_a_pointer_to_torchrun() -> None:
    for env in (tf({**CLUSTER, "ps": ["h9:2222"]}, {"type": "ps", "index": 0}),
                tf({**CLUSTER, "ps": ["h9:2222"]}, {"type": "worker", "index": 0})):
        msg = error(env)
        assert "ps" in msg and "no parameter servers" in msg and "torchrun" in msg


def test_only_evaluator_index_0() -> None:
    msg = error(tf(CLUSTER, {"type": "evaluator", "index": 1}))
    assert "only one evaluator is supported" in msg and "task.index is 1" in msg
    msg = error(tf({**CLUSTER, "evaluator": ["h3", "h4"]}, {"type": "evaluator", "index": 0}))
    assert "only one evaluator is supported" in msg and "2 evaluators" in msg


@pytest.mark.parametrize(
    "cluster,count",
    [
        ({"chief": ["h0", "h1"], "worker": ["h2"]}, "it has 2 (chief)"),
        ({"chief": ["h0"], "master": ["h1"]}, "it has 2 (chief + master)"),
        ({"worker": ["h1", "h2"]}, "it has 0 (chief)"),
    ],
)
def test_exactly_one_chief(cluster: dict, count: str) -> None:
    for task_type in ("worker", "evaluator"):
        msg = error(tf(cluster, {"type": task_type, "index": 0}))
        assert "exactly one chief" in msg and count in msg


@pytest.mark.parametrize(
    "task,expected",
    [
        ({"type": "worker", "index": 2}, "task.index 2 is outside cluster.worker, which has 2 entries"),
        ({"type": "chief", "index": 1}, "task.index 1 is outside cluster.chief, which has 1 entry"),
    ],
)
def test_index_outside_cluster(task: dict, expected: str) -> None:
    assert expected in error(tf(CLUSTER, task))


def test_worker_without_a_cluster() -> None:
    assert "no chief or workers" in error(tf(None, {"type": "worker", "index": 0}))
    assert "outside cluster.worker, which has 0 entries" in error(tf({"chief": ["h0"]}, {"type": "worker"}))


def test_tf_config_task_ignored_when_role_given_elsewhere() -> None:
    env = tf(CLUSTER, {"type": "evaluator", "index": 3})  # invalid, but overridden
    assert resolve_role(env, explicit="chief").role == "chief"
    with pytest.raises(ConfigError, match="TF_CONFIG: not valid JSON"):  # still the same environment
        resolve_role({"TF_CONFIG": "{"}, explicit="chief")


# --- train_and_evaluate ----------------------------------------------------------------------


class SomeTask:
    """Stands for a Task class: train_and_evaluate only needs its import path."""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ExperimentConfig, dict[str, Any]]]:
    """Stand-ins for the sidecar and the trainer (the real ones are tested elsewhere), put in
    place of the functions that cadence.torch's train_and_evaluate dispatches to."""
    record: list[tuple[str, ExperimentConfig, dict[str, Any]]] = []

    def run_sidecar(cfg):
        record.append(("sidecar", cfg, {}))
        return {"evaluated": 3}

    def run_training(cfg, **kwargs):
        record.append(("train", cfg, kwargs))
        return {"accuracy": 0.9}

    from cadence.torch.experiments import experiment

    monkeypatch.setattr(experiment, "run_sidecar", run_sidecar)
    monkeypatch.setattr(experiment, "run_training", run_training)
    return record


def train_and_evaluate(*args: Any, **kwargs: Any) -> Any:
    from cadence.torch import train_and_evaluate as dispatch

    return dispatch(*args, **kwargs)


@pytest.fixture
def cfg(tmp_path: Path) -> ExperimentConfig:
    return config_from_dict({"model_dir": str(tmp_path / "run"),
                             "task": {"class": "tasks:TinyTask", "params": {"n": 40}}})


def test_dispatch_chief_validates_in_process_without_an_evaluator(calls, cfg) -> None:
    assert train_and_evaluate(cfg, environ={}) == {"accuracy": 0.9}
    train_and_evaluate(cfg, environ={}, progress=False)
    train_and_evaluate(cfg, environ={"CADENCE_ROLE": "evaluator"}, progress=False)
    assert calls == [("train", cfg, {"in_process_validation": None}),
                     ("train", cfg, {"in_process_validation": None, "progress": False}),
                     ("sidecar", cfg, {})]


@pytest.mark.parametrize("environ", [{"CADENCE_SIDECAR": "1"},
                                     tf({**CLUSTER, "evaluator": ["h3"]}, {"type": "worker", "index": 0})])
def test_dispatch_trainer_skips_validation_with_an_evaluator(calls, cfg, environ) -> None:
    train_and_evaluate(cfg, environ=environ)
    assert calls == [("train", cfg, {"in_process_validation": False})]


def test_dispatch_evaluator_runs_the_sidecar(calls, cfg) -> None:
    assert train_and_evaluate(cfg, environ={"CADENCE_ROLE": "evaluator"}) == {"evaluated": 3}
    assert train_and_evaluate(cfg, role="evaluator", environ={"CADENCE_ROLE": "chief"}) == {"evaluated": 3}
    assert train_and_evaluate(cfg, role=ClusterSpec("evaluator", 0, True, "argument")) == {"evaluated": 3}
    assert [c[0] for c in calls] == ["sidecar"] * 3
    assert all(c[1] is cfg for c in calls)


def test_dispatch_worker_and_tf_config(calls, cfg) -> None:
    train_and_evaluate(cfg, environ=tf(CLUSTER, {"type": "worker", "index": 1}))
    train_and_evaluate(cfg, environ=tf(CLUSTER, {"type": "evaluator", "index": 0}))
    assert [(c[0], c[2]) for c in calls] == [("train", {"in_process_validation": None}), ("sidecar", {})]


def test_bad_role_fails_before_anything_runs(calls, cfg) -> None:
    with pytest.raises(ConfigError, match="CADENCE_ROLE"):
        train_and_evaluate(cfg, environ={"CADENCE_ROLE": "ps"})
    assert calls == []


def test_task_and_config(calls, cfg) -> None:
    expected = f"{SomeTask.__module__}:SomeTask"
    train_and_evaluate(SomeTask, cfg, environ={})
    train_and_evaluate(SomeTask(), cfg, environ={})
    train_and_evaluate("pkg.mod:Other", cfg, environ={})
    got = [c[1] for c in calls]
    assert [g.task.class_path for g in got] == [expected, expected, "pkg.mod:Other"]
    assert all(g.task.params == {"n": 40} and g.model_dir == cfg.model_dir for g in got)
    assert cfg.task.class_path == "tasks:TinyTask"  # the caller's config is not changed


def test_config_as_mapping_or_path(calls, tmp_path: Path) -> None:
    train_and_evaluate({"model_dir": "m", "task": {"class": "a:B"}}, environ={})
    train_and_evaluate(SomeTask, {"model_dir": "m"}, environ={})
    path = tmp_path / "c.yaml"
    path.write_text("model_dir: m\ntask:\n  class: a:B\n")
    train_and_evaluate(str(path), environ={})
    train_and_evaluate(SomeTask, path, environ={})
    assert [c[1].task.class_path for c in calls] == ["a:B", f"{SomeTask.__module__}:SomeTask", "a:B",
                                                     f"{SomeTask.__module__}:SomeTask"]


def test_task_misuse(calls, cfg) -> None:
    with pytest.raises(TypeError, match="config is missing"):
        train_and_evaluate(SomeTask, environ={})
    with pytest.raises(TypeError, match="give the config once"):
        train_and_evaluate(cfg, cfg, environ={})

    class Local:
        pass

    with pytest.raises(ConfigError, match="defined inside a function"):
        train_and_evaluate(Local, cfg, environ={})
    with pytest.raises(ConfigError, match="task.class: 'not a spec'"):
        train_and_evaluate("not a spec", cfg, environ={})
    assert calls == []
