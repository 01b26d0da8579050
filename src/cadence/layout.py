"""Paths of the model directory (docs/design.md's contract), for local paths and fsspec URLs alike."""

from __future__ import annotations

from cadence.errors import ConfigError, ModelDirError

CHECKPOINTS = "checkpoints"
TRAIN = "train"
EVAL = "eval"
CONFIG = "config.yaml"


def require_model_dir(model_dir: str | None) -> str:
    """``model_dir``; ConfigError naming the two ways to set it when it is empty or None."""
    if not model_dir:
        raise ConfigError("model_dir: not set; give it in the config or with --model-dir")
    return model_dir


def check_model_dir(model_dir: str, *, must_exist: bool = False, writable: bool = False) -> str:
    """``model_dir``; :class:`~cadence.errors.ModelDirError` (bad input, exit 2) when it is a file or,
    on a local disk, a file stands on its path, or, with ``must_exist``, missing. ``writable`` (a
    trainer's model dir): also when this process may not create it or write into it (permission, a
    read-only file system); checked without creating anything."""
    from cadence.storage import Storage

    storage = Storage(model_dir)
    if storage.isdir(storage.root):
        if writable:
            _check_local_writable(model_dir)
        return model_dir
    # isfile, not exists: on an object store a directory that another process (a sidecar, another node) starts
    # writing between the two calls exists by then, and is still no file
    if storage.isfile(storage.root):
        raise ModelDirError(f"model dir is a file, not a directory: {model_dir}")
    _check_no_file_on_path(model_dir)
    if must_exist and not storage.exists(storage.root):
        raise ModelDirError(f"model dir not found: {model_dir}")
    if writable:
        _check_local_writable(model_dir)
    return model_dir


def _check_no_file_on_path(model_dir: str) -> None:
    """ModelDirError when, on a local disk, a file stands on ``model_dir``'s path."""
    from cadence.storage import file_on_path

    why = file_on_path(model_dir)
    if why is not None:
        raise ModelDirError(f"model dir {model_dir}: {why}")


def _check_local_writable(model_dir: str) -> None:
    """ModelDirError unless this process can write into local ``model_dir``, or create it."""
    from cadence.storage import unwritable_reason

    why = unwritable_reason(model_dir)
    if why is not None:
        raise ModelDirError(f"model dir {model_dir}: {why}")


def require_cadence_model_dir(model_dir: str) -> None:
    """ModelDirError (bad input) unless ``model_dir`` exists and holds ``config.yaml``, ``checkpoints/``,
    ``train/`` or ``.writer/`` (a trainer that is just starting): what ``ls`` and ``report`` read."""
    from cadence.storage import Storage

    check_model_dir(model_dir, must_exist=True)
    storage = Storage(model_dir)
    if not set(storage.listdir(storage.root)) & {CONFIG, CHECKPOINTS, TRAIN, WRITER}:
        raise ModelDirError(f"not a cadence model dir (no {CONFIG}, {CHECKPOINTS}/ or {TRAIN}/): {model_dir}")


def join(model_dir: str, *parts: str) -> str:
    """``model_dir/part/...`` without doubling slashes (works for ``memory://x`` and ``s3://b/k``)."""
    return "/".join([model_dir.rstrip("/"), *parts])


def checkpoints_dir(model_dir: str) -> str:
    return join(model_dir, CHECKPOINTS)


def train_dir(model_dir: str) -> str:
    return join(model_dir, TRAIN)


def eval_dir(model_dir: str, name: str | None = None) -> str:
    """``eval/``, or ``eval_<name>/`` for a named evaluation."""
    return join(model_dir, EVAL if not name else f"{EVAL}_{name}")


def config_path(model_dir: str) -> str:
    return join(model_dir, CONFIG)


BEST = "best"
EXPORT = "export"


def best_dir(model_dir: str) -> str:
    """``best/``: the best checkpoint so far and ``best.json``."""
    return join(model_dir, BEST)


def export_dir(model_dir: str, name: str, step: int | None = None) -> str:
    """``export/<name>/`` or, with a step, ``export/<name>/<step>/``."""
    return join(model_dir, EXPORT, name) if step is None else join(model_dir, EXPORT, name, str(step))


WRITER = ".writer"


def writer_lease_dir(model_dir: str) -> str:
    """``.writer/``: the writer lease's files (:mod:`cadence.checkpoint.writer_lease`)."""
    return join(model_dir, WRITER)


PROFILE = "profile"


def profile_dir(model_dir: str) -> str:
    """``profile/``: the profiler's traces, ``rank<R>.<time>.pt.trace.json[.gz]`` (one per rank and
    cycle), laid out as TensorBoard's profiler plugin reads a run (:mod:`cadence.torch.components.profiling`)."""
    return join(model_dir, PROFILE)


REPLICAS = "replicas"


def replica_group_dir(model_dir: str, group: int) -> str:
    """Where replica group ``group`` of a fault-tolerant run writes its own outputs (its ``train/``
    metrics, TensorBoard events, ``eval/``, ``config.yaml``, ``best/``, ``export/``): the model dir
    itself for group 0, ``replicas/group<r>/`` for the others. The run's checkpoints and writer lease
    stay in the model dir (``checkpoints/``, ``.writer/``): one group writes them at a time."""
    return model_dir if group == 0 else join(model_dir, REPLICAS, f"group{group}")
