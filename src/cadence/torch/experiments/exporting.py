"""Inference exports during a run built from a config: :class:`ModelExporter` writes the
configured formats of the live model, :class:`ExportEveryEval` exports after each evaluation."""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from cadence import layout
from cadence.config import ExperimentConfig
from cadence.errors import ConfigError
from cadence.export_marker import ExportTargetError
from cadence.extensions import RunContext
from cadence.torch.checkpoint_io.state import unwrap_model
from cadence.torch.components.ema import ModelEMA, applied
from cadence.torch.export.dynamic_shapes import check_spec
from cadence.torch.export.formats import TRACED_FORMATS, check_formats
from cadence.torch.export.signatures import check_signatures, has_export_signatures
from cadence.torch.hf.save import check_hf_model
from cadence.torch.parallel import sharding
from cadence.torch.task.export_specs import as_inputs
from cadence.torch.task.task import Task

__all__ = ["ExportEveryEval", "ModelExporter", "example_inputs_for"]

log = logging.getLogger(__name__)


def example_inputs_for(task: Task, formats: Sequence[str], where: str, model: Any = None) -> Any:
    """``task.example_inputs()`` when a format traces the model, else None.

    With ``model`` and a task whose ``export_signatures(model)`` returns signatures, those are
    checked instead (each signature brings its own example inputs) and the result is None.

    Raises:
      ConfigError: formats that do not combine (``hf`` and ``safetensors``); ``hf`` for a model
        (``model``) that is not a ``transformers`` one, or without ``transformers`` installed;
        a traced format, and the task does not define ``example_inputs()``, or its
        ``export_spec()`` does not fit them; a signature with a bad name, without example inputs
        for a traced format, or with a spec that does not fit them (named).
    """
    try:
        check_formats(formats)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if "hf" in formats and model is not None:
        check_hf_model(unwrap_model(model), where)
    if model is not None and has_export_signatures(task):
        try:
            signatures = check_signatures(task.export_signatures(unwrap_model(model)), formats)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {type(task).__name__}.export_signatures(): {exc}") from exc
        if signatures:
            return None
    needing = [f for f in formats if f in TRACED_FORMATS]
    if not needing:
        return None
    try:
        inputs = task.example_inputs()
    except NotImplementedError as exc:
        raise ConfigError(f"{where}: {needing} need {type(task).__name__}.example_inputs(), which is not defined") from exc
    try:
        check_spec(task.export_spec(), as_inputs(inputs) or ())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {type(task).__name__}.export_spec(): {exc}") from exc
    return inputs


class ModelExporter:
    """Writes the configured inference artefacts of the live model to ``export/<name>/<step>/``
    (with :meth:`Task.export_signatures`: one ``<signature>/`` subdirectory each, and
    ``signatures.json``) and keeps the newest ``export.max_to_keep`` steps. Only the chief
    writes (``chief``). Example inputs and signatures are checked when it is built (ConfigError).
    ``ema``: the weights exported are this EMA's (the evaluated ones), swapped in for the export.
    Only cadence's exports are replaced or deleted: a step directory holding anything else is left
    alone, that export skipped with a warning (training goes on)."""

    def __init__(self, cfg: ExperimentConfig, task: Task, model: Any, name: str, *, chief: bool = True,
                 ema: ModelEMA | None = None) -> None:
        from cadence.actions import ExportFileManager

        assert cfg.export is not None
        self.formats = list(cfg.export.formats)
        self.model = model
        self.model_dir = cfg.require_model_dir()
        self.name = name
        self.task = task
        self.example_inputs = example_inputs_for(task, self.formats, "export.formats", model)
        self.files = ExportFileManager(
            layout.export_dir(self.model_dir, name), max_to_keep=cfg.export.max_to_keep, separator="/",
            exports_only=True,
        )
        self.chief = chief  # one process writes exports
        self.ema = ema

    def __call__(self, step: int, metadata: Mapping[str, Any]) -> str | None:
        """Export at ``step``; called on every rank; the directory, or None when the chief skipped it
        (its directory holds what cadence did not write). A model sharded by FSDP is first gathered
        (a collective) into a plain copy built by the task, on the chief's CPU."""
        from cadence.torch.export.api import export_task_model

        directory = layout.export_dir(self.model_dir, self.name, step)
        with applied(self.ema):
            model = self.model
            if sharding.is_sharded(model):
                model = sharding.full_copy(self.task.build_model, model)
            if not self.chief:
                return directory
            try:
                export_task_model(self.task, model, directory, self.formats, example_inputs=self.example_inputs,
                                  metadata={**metadata, "step": step})
            except ExportTargetError as e:
                log.warning("export skipped: %s", e)
                return None
        self.files.clean_up()
        return directory


class ExportEveryEval:
    """An eval action: export after every evaluation, at the evaluated step."""

    def __init__(self, export: ModelExporter) -> None:
        self.export = export
        self._run: RunContext | None = None

    def attach(self, run: RunContext) -> None:
        self._run = run

    def __call__(self, metrics: dict[str, Any]) -> None:
        if self._run is None:
            raise RuntimeError("ExportEveryEval must be attached to a Controller (pass it in eval_actions)")
        self.export(self._run.global_step, {"metrics": metrics})
