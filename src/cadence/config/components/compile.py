"""``trainer.compile``: the settings of ``torch.compile`` of the model
(:mod:`cadence.torch.components.compile` compiles as they say)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, model_validator

from cadence.config.base import ConfigModel

__all__ = ["COMPILE_FORM", "CompileConfig", "CompileMode", "compile_shorthand"]

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_FORM = "true, false, a mapping {backend, mode, fullgraph, dynamic}"


class CompileConfig(ConfigModel):
    """`torch.compile` of the model's forward (and so its backward), in place: the module and its
    `state_dict` keys stay as they are, so checkpoints are the same as an eager run's (no `_orig_mod.`
    prefix) and resume either way. One process and DDP compile the whole model (before the DDP wrap);
    `fsdp` on several ranks compiles each unit `Task.fsdp_units` names before sharding it (the rest runs
    eagerly). The evaluator shares the model and runs compiled too (so do the sidecar and `cadence
    evaluate`); exports always trace the eager forward. Costs: the first training step and the first
    evaluation each compile (seconds on small models, minutes on large ones, in every process: each rank,
    each sidecar, each resume), and a new input shape, dtype or mode may compile again (a last, smaller
    batch: once, as a dynamic shape); steps after it run faster where the backend's kernels pay (GPUs
    mostly; on CPU often little). A failure to compile stops the run with one line (exit 2)."""

    backend: str = Field(
        default="inductor", min_length=1,
        description=("`torch.compile`'s backend: `inductor` (generated kernels), or another name "
                     "`torch._dynamo.list_backends()` knows (`aot_eager`: traced, no kernels of its own; checked "
                     "when the model is built)."),
    )
    mode: CompileMode = Field(
        default="default",
        description=("inductor's mode: `default`, `reduce-overhead` (CUDA graphs: less launch overhead, more "
                     "memory), `max-autotune` (benchmarks kernel choices: a much longer compile) or "
                     "`max-autotune-no-cudagraphs`. Other backends take none."),
    )
    fullgraph: StrictBool = Field(
        default=False,
        description="`true`: a graph break (code dynamo cannot trace) is an error instead of running that part eagerly.",
    )
    dynamic: StrictBool | None = Field(
        default=None, json_schema_extra={"expected": "true or false"},
        description=("`true`: compile for dynamic shapes from the start; `false`: one graph per shape; `null`: "
                     "static first, dynamic once a shape changes (torch's default)."),
    )

    @model_validator(mode="after")
    def _mode_is_inductor_s(self) -> CompileConfig:
        if self.mode != "default" and self.backend != "inductor":
            raise ValueError(f"mode {self.mode!r} is inductor's; backend {self.backend!r} takes no mode")
        return self


def compile_shorthand(value: Any) -> Any:
    """``trainer.compile``'s short forms: ``true``: compile with the defaults; ``false``: off (as null)."""
    if value is True:
        return {}
    if value is False:
        return None
    return value
