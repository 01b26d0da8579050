"""Tasks whose validation goes wrong, for the sanity check's tests (``tests/sanity_tasks.py:...``)."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from tasks import TinyTask


class FloatValidationTask(TinyTask):
    """``validation_step`` returns a float (the loss) instead of a dict of metrics."""

    def validation_step(self, model, batch):
        return float(super().validation_step(model, batch)["loss"])


class ListValidationTask(TinyTask):
    """``validation_step`` returns a list of its metrics instead of a dict."""

    def validation_step(self, model, batch):
        return list(super().validation_step(model, batch).values())


class _CountedPasses:
    """The validation batches; raises at the ``fail_at``-th pass over them (counted from 1)."""

    def __init__(self, data: Iterable[Any], fail_at: int | None) -> None:
        self.data = data
        self.fail_at = fail_at
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        if self.passes == self.fail_at:
            raise RuntimeError(f"validation broke at pass {self.passes} over the validation data")
        return iter(self.data)


class FlakyValidationTask(TinyTask):
    """TinyTask whose validation raises at the ``fail_at_pass``-th pass over the validation data
    (each evaluation is one pass; so is the sanity check, the first). ``None``: never."""

    def __init__(self, fail_at_pass: int | None = None, **params: Any) -> None:
        super().__init__(**params)
        self.fail_at_pass = fail_at_pass

    def build_inputs(self, split, ctx):
        data = super().build_inputs(split, ctx)
        return data if split == "train" else _CountedPasses(data, self.fail_at_pass)


class EmptyValidationTask(TinyTask):
    """The validation data yields no batches."""

    def build_inputs(self, split, ctx):
        return super().build_inputs(split, ctx) if split == "train" else []
