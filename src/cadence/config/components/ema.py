"""``trainer.ema``: the settings of the exponential moving average of the weights
(:class:`cadence.torch.components.ema.ModelEMA` averages as they say)."""

from __future__ import annotations

from pydantic import Field, StrictBool

from cadence.config.base import ConfigModel

__all__ = ["EMAConfig"]


class EMAConfig(ConfigModel):
    """An exponential moving average (EMA) of the weights, kept on the device beside them (one more copy of
    the floating-point parameters and buffers; under `fsdp` sharded like the parameters). At every global step
    that is a multiple of `every_n_steps`: at a step up to `start_step` the EMA is set to the weights; after
    it, `ema = decay * ema + (1 - decay) * weights` (the decay applies per update, not per step). Float
    buffers (BatchNorm statistics) are averaged too; integer ones are the model's. Every checkpoint holds it
    (`ema.safetensors`, or the `ema` shards); evaluations (in-process, sidecar, `cadence evaluate`) report
    the EMA weights' metrics under their plain names, which `best_checkpoint` and `early_stopping` see, and
    exports are of the EMA weights."""

    decay: float = Field(
        default=0.999, gt=0, lt=1, allow_inf_nan=False,
        description="Weight of the old average in each update; the average spans about `every_n_steps / (1 - decay)` steps.",
    )
    start_step: int = Field(
        default=0, ge=0, strict=True,
        description="Updates at global steps up to this one copy the weights; averaging starts after it.",
    )
    every_n_steps: int = Field(
        default=1, ge=1, strict=True, description="Update the EMA at every global step that is a multiple of this.",
    )
    evaluate_raw: StrictBool = Field(
        default=True,
        description="Also evaluate the raw (not averaged) weights, reported as `raw/<metric>` (a second evaluation).",
    )
