"""Which training steps the profiler traces: ``torch.profiler.schedule``'s cycles, counted in
global steps (pure arithmetic, no torch; :mod:`cadence.torch.components.profiling` runs the profiler).

Global step ``s`` is the ``s``-th optimizer step of the run (1 for the first; a resumed run goes
on counting), so a window set in the config names the same steps whatever the restarts. With
torch's meaning of the settings, the steps ``1 .. skip_first`` are skipped, then every cycle is
``wait`` steps without a profiler, ``warmup`` steps profiled but discarded, and ``active`` steps
recorded into one trace; ``repeat`` cycles (0: until training ends).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cycle", "ProfilerWindow"]

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


@dataclass(frozen=True)
class ProfilerWindow:
    """The cycles of ``torch.profiler.schedule(skip_first, wait, warmup, active, repeat)`` in
    global steps. ``ValueError`` for a negative count, ``active < 1`` or ``repeat < 0``."""

    skip_first: int = 0
    wait: int = 0
    warmup: int = 1
    active: int = 1
    repeat: int = 1

    def __post_init__(self) -> None:
        for name in ("skip_first", "wait", "warmup", "repeat"):
            if getattr(self, name) < 0:
                raise ValueError(f"profiler.{name} must be >= 0, got {getattr(self, name)}")
        if self.active < 1:
            raise ValueError(f"profiler.active must be >= 1, got {self.active}")

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
