"""Roles in a cluster (chief / worker / evaluator) and the tf.estimator-style ``train_and_evaluate``.

Every process of an experiment runs the same program; its *role* decides what it does:

* ``chief``: trains, writes checkpoints and summaries (exactly one);
* ``worker``: trains alongside the chief (torchrun ranks; rank 0 writes);
* ``evaluator``: the sidecar -- evaluates committed checkpoints while the others train. As in
  tf.estimator it is not part of the training cluster, and there is only one (index 0).

The role comes from, in order of precedence:

1. an explicit argument (``cadence ... --role``, ``train_and_evaluate(..., role=...)``);
2. ``CADENCE_ROLE`` = ``chief`` | ``worker`` | ``evaluator`` (case-insensitive);
3. ``TF_CONFIG``, the JSON tf.estimator reads, for clusters already set up for it::

       {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222"]},
        "task": {"type": "worker", "index": 0}}

   ``master`` is read as ``chief`` (tf.estimator's legacy name); ``ps`` is refused (cadence has no
   parameter servers);
4. nothing set: ``chief``, index 0 (a single process that trains and evaluates).

Whether a separate evaluator exists (``has_evaluator``) decides whether the trainers validate
in-process: it is true for the evaluator itself, when ``TF_CONFIG``'s cluster lists an
``evaluator``, or when ``CADENCE_SIDECAR=1`` (set by ``cadence launch --sidecar``).

This module imports neither torch nor the training code: ``cadence.torch.train_and_evaluate``
dispatches on the role it resolves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from cadence.errors import ConfigError

__all__ = ["ROLES", "ClusterSpec", "Role", "resolve_role"]

Role = Literal["chief", "worker", "evaluator"]
ROLES: tuple[str, ...] = get_args(Role)

RoleSource = Literal["default", "CADENCE_ROLE", "TF_CONFIG", "argument"]

_TF_TASK_TYPES = ("chief", "master", "worker", "evaluator", "ps")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_NO_PS = "cadence has no parameter servers; run the trainers as torchrun workers instead"


@dataclass(frozen=True)
class ClusterSpec:
    """This process's place in the cluster.

    Attributes:
      role: ``"chief"``, ``"worker"`` or ``"evaluator"``.
      index: the task index within its role (the evaluator's is always 0).
      has_evaluator: a separate evaluator process evaluates the checkpoints, so trainers need not
        validate in-process.
      source: where the role came from: ``"default"``, ``"CADENCE_ROLE"``, ``"TF_CONFIG"`` or
        ``"argument"``.
    """

    role: Role
    index: int = 0
    has_evaluator: bool = False
    source: RoleSource = "default"

    @property
    def is_chief(self) -> bool:
        return self.role == "chief"

    @property
    def is_evaluator(self) -> bool:
        return self.role == "evaluator"

    @property
    def is_trainer(self) -> bool:
        """Chief or worker: a process that trains."""
        return self.role != "evaluator"


def resolve_role(environ: Mapping[str, str] | None = None, explicit: str | None = None) -> ClusterSpec:
    """Work out this process's role (see the module docstring for the precedence).

    Args:
      environ: the environment to read (default ``os.environ``).
      explicit: a role given as an argument (``chief`` | ``worker`` | ``evaluator``, any case;
        ``None``: not given). It wins over the environment.

    Raises:
      ConfigError: an invalid role, ``CADENCE_ROLE``, ``CADENCE_SIDECAR`` or ``TF_CONFIG``; the
        message names the variable and what is wrong with it.
    """
    env = os.environ if environ is None else environ
    sidecar = _sidecar_flag(env)
    tf_config = env.get("TF_CONFIG", "")
    # TF_CONFIG, when set, is read even if the role comes from elsewhere: its cluster says whether
    # an evaluator exists. Its task is checked only when it decides the role.
    cluster, task = _parse_tf_config(tf_config) if tf_config.strip() else ({}, None)
    has_evaluator = sidecar or "evaluator" in cluster

    if explicit is not None:
        role = _parse_role(explicit, "role")
        return ClusterSpec(role, 0, has_evaluator or role == "evaluator", "argument")
    cadence_role = env.get("CADENCE_ROLE", "")
    if cadence_role.strip():
        role = _parse_role(cadence_role, "CADENCE_ROLE")
        return ClusterSpec(role, 0, has_evaluator or role == "evaluator", "CADENCE_ROLE")
    if task is not None:
        role, index = _tf_config_role(cluster, task)
        return ClusterSpec(role, index, has_evaluator or role == "evaluator", "TF_CONFIG")
    if cluster:
        _check_cluster_roles(cluster)
        raise ConfigError(
            "TF_CONFIG: has a 'cluster' but no 'task'; set task.type (chief, worker or evaluator) "
            "and task.index"
        )
    return ClusterSpec("chief", 0, has_evaluator, "default")


def _parse_role(value: str, source: str) -> Role:
    role = value.strip().lower()
    if role not in ROLES:
        raise ConfigError(f"{source}: {value!r} is not a role; expected one of {', '.join(ROLES)}")
    return role  # type: ignore[return-value]


def _sidecar_flag(env: Mapping[str, str]) -> bool:
    value = env.get("CADENCE_SIDECAR", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"CADENCE_SIDECAR: {env['CADENCE_SIDECAR']!r} is not a boolean; expected 1 or 0"
    )


def _parse_tf_config(text: str) -> tuple[dict[str, list[Any]], dict[str, Any] | None]:
    """``(cluster, task)`` from TF_CONFIG's JSON, shapes checked; ``task`` is ``None`` if absent."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TF_CONFIG: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"TF_CONFIG: expected a JSON object, got {type(data).__name__}: {text.strip()[:80]}")
    cluster = data.get("cluster") or {}
    if not isinstance(cluster, dict):
        raise ConfigError(
            f"TF_CONFIG: 'cluster' must be an object mapping job names to address lists, got {cluster!r}"
        )
    for job, addresses in cluster.items():
        if not isinstance(addresses, list):
            raise ConfigError(f"TF_CONFIG: cluster.{job} must be a list of addresses, got {addresses!r}")
    task = data.get("task")
    if task is not None and not isinstance(task, dict):
        raise ConfigError(f"TF_CONFIG: 'task' must be an object with 'type' and 'index', got {task!r}")
    return cluster, (task or None)


def _check_cluster_roles(cluster: Mapping[str, list[Any]]) -> int:
    """Check the cluster's jobs and return its number of chiefs."""
    for job in cluster:
        if job == "ps":
            raise ConfigError(f"TF_CONFIG: the cluster has 'ps' jobs, but {_NO_PS}")
        if job not in _TF_TASK_TYPES:
            raise ConfigError(
                f"TF_CONFIG: cluster.{job}: unknown job name; expected chief, worker or evaluator"
            )
    evaluators = cluster.get("evaluator", [])
    if len(evaluators) > 1:
        raise ConfigError(
            f"TF_CONFIG: cluster.evaluator lists {len(evaluators)} evaluators; only one evaluator is supported"
        )
    chiefs = len(cluster.get("chief", [])) + len(cluster.get("master", []))
    trainers = chiefs + len(cluster.get("worker", []))
    if trainers and chiefs != 1:
        jobs = " + ".join(j for j in ("chief", "master") if j in cluster) or "chief"
        raise ConfigError(
            f"TF_CONFIG: the cluster must have exactly one chief, it has {chiefs} ({jobs})"
        )
    return chiefs


def _tf_config_role(cluster: Mapping[str, list[Any]], task: Mapping[str, Any]) -> tuple[Role, int]:
    task_type = task.get("type")
    if not isinstance(task_type, str) or not task_type.strip():
        raise ConfigError(f"TF_CONFIG: task.type is missing or not a string: {task_type!r}; "
                          "expected chief, worker or evaluator")
    task_type = task_type.strip().lower()
    if task_type == "ps":
        raise ConfigError(f"TF_CONFIG: task.type is 'ps', but {_NO_PS}")
    if task_type not in _TF_TASK_TYPES:
        raise ConfigError(f"TF_CONFIG: task.type {task.get('type')!r} is not a role; "
                          "expected chief (or master), worker or evaluator")
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError(f"TF_CONFIG: task.index must be a non-negative integer, got {index!r}")
    _check_cluster_roles(cluster)

    if task_type == "evaluator":
        if index != 0:
            raise ConfigError(
                f"TF_CONFIG: task.index is {index} for the evaluator, but only one evaluator is "
                "supported (index 0)"
            )
        return "evaluator", 0

    role: Role = "chief" if task_type in ("chief", "master") else "worker"
    if role == "chief":
        job = "master" if "master" in cluster else "chief"
        has_trainers = any(j in cluster for j in ("chief", "master", "worker"))
        size = len(cluster.get(job, [])) if has_trainers else 1  # no trainers listed: a lone chief
    else:
        job = "worker"
        if not any(j in cluster for j in ("chief", "master", "worker")):
            raise ConfigError(
                "TF_CONFIG: task.type is 'worker' but the cluster lists no chief or workers to join"
            )
        size = len(cluster.get("worker", []))
    if index >= size:
        raise ConfigError(
            f"TF_CONFIG: task.index {index} is outside cluster.{job}, which has {size} "
            f"{'entry' if size == 1 else 'entries'}"
        )
    return role, index
