"""``profiler:``: the settings of ``torch.profiler`` traces of chosen training steps, and which
global steps they trace: ``torch.profiler.schedule``'s cycles, counted in global steps (pure
arithmetic, no torch; :mod:`cadence.torch.components.profiling` runs the profiler).

Global step ``s`` is the ``s``-th optimizer step of the run (1 for the first; a resumed run goes
on counting), so a window set in the config names the same steps whatever the restarts. With
torch's meaning of the settings, the steps ``1 .. skip_first`` are skipped, then every cycle is
``wait`` steps without a profiler, ``warmup`` steps profiled but discarded, and ``active`` steps
recorded into one trace; ``repeat`` cycles (0: until training ends).

The defaults (skip 10, wait 1, warmup 1, record 3, one cycle: steps 13-15) are those of the
``profiler:`` section and of ``cadence train --profile``, and of a :class:`ProfilerConfig` built in
code (see ``docs/changelog.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field, StrictBool

from cadence.config.base import ConfigModel

__all__ = ["NEVER", "Cycle", "ProfilerConfig"]

NEVER = 2**62
"""A step no run reaches: where a window with no cycle left starts."""


@dataclass(frozen=True)
class Cycle:
    """One cycle of the window, in global steps: warmup ``first_warmup .. first_active - 1``
    (empty without warmup), recorded ``first_active .. last_active``."""

    index: int
    first_warmup: int
    first_active: int
    last_active: int

    @property
    def active_steps(self) -> str:
        """``"13-15"`` (``"13"`` for one step)."""
        if self.first_active == self.last_active:
            return str(self.first_active)
        return f"{self.first_active}-{self.last_active}"


class ProfilerConfig(ConfigModel):
    """`torch.profiler` traces of chosen training steps (`cadence train --profile` turns it on with these
    defaults: steps 13-15). The window is `torch.profiler.schedule`'s, in global steps (a resumed run keeps it):
    steps 1 to `skip_first` are skipped, then each cycle waits `wait` steps, warms up `warmup` and records
    `active` into one trace per rank, `MODEL_DIR/profile/rank<R>.<time>.pt.trace.json` (TensorBoard's profiler
    plugin, Perfetto, chrome://tracing). No profiler exists outside the warmup and recorded steps; an
    evaluation or checkpoint between loops inside them is recorded too, and the step that ends a cycle
    waits for its trace to be written. A cycle is cut at `trainer.train_steps`; a run resumed inside a cycle's
    recorded steps skips that cycle."""

    skip_first: int = Field(
        default=10, ge=0, strict=True,
        description="Global steps before the first cycle (its first wait step is `skip_first + 1`).",
    )
    wait: int = Field(default=1, ge=0, strict=True, description="Steps at the start of each cycle without a profiler.")
    warmup: int = Field(
        default=1, ge=0, strict=True,
        description=("Steps profiled and discarded before the recorded ones (the profiler's own start-up); "
                     "0 skews the first recorded step."),
    )
    active: int = Field(default=3, ge=1, strict=True, description="Steps recorded into each trace.")
    repeat: int = Field(default=1, ge=0, strict=True, description="How many cycles; 0: cycle after cycle until training ends.")
    record_shapes: StrictBool = Field(
        default=False,
        description="Record every op's input shapes (the plugin groups ops by shape); more time per op, bigger traces.",
    )
    profile_memory: StrictBool = Field(
        default=False,
        description="Track every tensor allocation and free (the memory view); more time per op, bigger traces.",
    )
    with_stack: StrictBool = Field(
        default=False,
        description=("Record the Python stack (file:line) of every op (the plugin's call stacks); more time per op "
                     "and traces about 3x bigger."),
    )
    gzip: StrictBool = Field(
        default=False,
        description="Write `.pt.trace.json.gz` (about 10x smaller; the plugin and Perfetto read both).",
    )

    # -- the window, in global steps (``ValueError`` at construction for a count out of bounds) ----

    @property
    def period(self) -> int:
        """Steps from one cycle's start (its first wait step) to the next one's."""
        return self.wait + self.warmup + self.active

    def cycle(self, index: int) -> Cycle | None:
        """Cycle ``index`` (0 for the first); None past the last one."""
        if index < 0 or (self.repeat and index >= self.repeat):
            return None
        first_warmup = self.skip_first + index * self.period + self.wait + 1
        first_active = first_warmup + self.warmup
        return Cycle(index, first_warmup, first_active, first_active + self.active - 1)

    def cycle_of(self, step: int) -> Cycle | None:
        """The cycle whose warmup or recorded steps hold global step ``step`` (None: a step
        outside them: skipped, waiting, or after the last cycle)."""
        if step <= self.skip_first:
            return None
        cycle = self.cycle((step - self.skip_first - 1) // self.period)
        return cycle if cycle is not None and cycle.first_warmup <= step <= cycle.last_active else None

    def starting_at(self, step: int) -> Cycle | None:
        """The cycle to trace when ``step`` is the next step to run: one whose warmup holds it
        (its warmup then shortened, for a run resumed inside it) or whose first recorded step it
        is. None inside a cycle's recorded steps: a cycle is traced whole or not at all."""
        cycle = self.cycle_of(step)
        return cycle if cycle is not None and step <= cycle.first_active else None

    def next_start(self, step: int) -> int:
        """The first step ``>= step`` at which a cycle can start (see :meth:`starting_at`);
        :data:`NEVER` when no cycle is left."""
        if step <= self.skip_first:
            first = self.cycle(0)
            return first.first_warmup if first is not None else NEVER
        index = (step - self.skip_first - 1) // self.period
        cycle = self.cycle(index)
        if cycle is None:
            return NEVER
        if step <= cycle.first_active:
            return max(step, cycle.first_warmup)
        later = self.cycle(index + 1)
        return later.first_warmup if later is not None else NEVER

    def describe(self, limit: int = 3) -> str:
        """The recorded steps, for messages: ``"steps 13-15"``, ``"steps 13-15, 19-21 (2 cycles)"``,
        ``"steps 13-15, 19-21, 25-27, ... (every 6 steps until training ends)"``."""
        shown = [c.active_steps for c in (self.cycle(i) for i in range(limit)) if c is not None]
        if not self.repeat:
            return f"steps {', '.join(shown)}, ... (every {self.period} steps until training ends)"
        if self.repeat > limit:
            last = self.cycle(self.repeat - 1)
            assert last is not None
            return f"steps {', '.join(shown)}, ..., {last.active_steps} ({self.repeat} cycles)"
        return f"steps {', '.join(shown)}" + (f" ({self.repeat} cycles)" if self.repeat > 1 else "")
