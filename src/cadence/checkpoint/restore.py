"""Verified reading of committed checkpoints: every file checked against the manifest before any
object is restored, and the fall-back past corrupt checkpoints to the newest good one."""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping

from cadence.checkpoint import manifest as manifest_lib
from cadence.checkpoint.files import STATE_NAME, VerifiedReader
from cadence.checkpoint.listing import committed_steps, step_dir
from cadence.checkpoint.manifest import MANIFEST_NAME
from cadence.checkpoint.objects import load_object
from cadence.checkpoint.protocol import Restorable
from cadence.extensions import Stateful
from cadence.errors import CheckpointError, CorruptCheckpointError
from cadence.runtime.coordination import Coordinator
from cadence.storage import Storage

logger = logging.getLogger("cadence.checkpoint")

Loaded = tuple[VerifiedReader, dict[str, Any]]
"""A verified checkpoint: its reader (every file checked) and its parsed ``state.json``."""


def check_restorable(objects: Mapping[str, object]) -> None:
    """``TypeError`` for the first object with neither ``load_checkpoint`` nor ``load_state_dict``."""
    for name, obj in objects.items():
        if not isinstance(obj, (Restorable, Stateful)):
            raise TypeError(f"cannot restore {name!r}: {type(obj).__name__} has neither load_checkpoint nor load_state_dict")


def parse_state(storage: Storage, data: memoryview, step: int) -> dict[str, Any]:
    """The ``state.json`` document of checkpoint ``step``; :class:`CorruptCheckpointError` when it
    is not JSON, has no ``state`` object or names another step."""
    path = storage.url(step_dir(storage, step))
    try:
        document = json.loads(data.tobytes())
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(path, f"{STATE_NAME} is not valid JSON ({e})") from None
    if not isinstance(document, dict) or not isinstance(document.get("state"), dict):
        raise CorruptCheckpointError(path, f"{STATE_NAME} has no 'state' object")
    if document.get("step") != step:
        raise CorruptCheckpointError(path, f"{STATE_NAME} is for step {document.get('step')!r}")
    return document


def load(storage: Storage, step: int, coordinator: Coordinator | None = None) -> Loaded:
    """Read and verify every file of checkpoint ``step`` (with a ``coordinator`` of several ranks:
    this rank's share of the ranks' files, then the ranks agree); :class:`CorruptCheckpointError`
    (the same on every rank) when it is bad."""
    directory = step_dir(storage, step)
    collective = coordinator is not None and coordinator.world_size > 1
    problem: CorruptCheckpointError | None = None
    try:
        manifest = manifest_lib.read(storage, directory, step)
        if STATE_NAME not in manifest["files"]:
            raise CorruptCheckpointError(storage.url(directory), f"{STATE_NAME} is not listed in {MANIFEST_NAME}")
        share = (coordinator.rank, coordinator.world_size) if collective and coordinator is not None else None
        files = manifest_lib.verify_all(storage, directory, manifest, share)
        state = parse_state(storage, files[STATE_NAME], step)
    except CorruptCheckpointError as e:
        if not collective:
            raise
        problem = e
    if collective and coordinator is not None:
        found = [p for p in coordinator.all_gather(None if problem is None else (problem.path, problem.reason)) if p]
        if found:
            raise CorruptCheckpointError(*found[0])

    def fetch(name: str) -> memoryview:  # a file whose verification was another rank's share
        return manifest_lib.read_verified(storage, directory, manifest, name)

    reader = VerifiedReader(step, storage.url(directory), files, listed=list(manifest["files"]), fetch=fetch,
                            storage_options=storage.options)
    return reader, state


def load_latest(storage: Storage, coordinator: Coordinator | None = None,
                quarantine: Callable[[int, str], object] | None = None) -> Loaded | None:
    """The newest committed checkpoint that verifies (see :func:`load`); None when none is committed.

    Each corrupt one on the way is warned about and skipped; once a good one is found, each is
    handed to ``quarantine(step, reason)`` (a writer's, to move it aside; None: left as it is).
    With a ``coordinator`` every rank tries the chief's list. Raises :class:`CheckpointError` when
    every committed checkpoint is corrupt.
    """
    steps = committed_steps(storage)
    if coordinator is not None and coordinator.world_size > 1:
        steps = coordinator.broadcast(steps)  # every rank tries the same checkpoints
    corrupt: list[tuple[int, str]] = []  # newer than the one restored: moved aside by a writer
    for step in reversed(steps):
        try:
            loaded = load(storage, step, coordinator)
        except CorruptCheckpointError as e:
            logger.warning("skipping checkpoint %s: %s", e.path, e.reason)
            corrupt.append((step, e.reason))
            continue
        if quarantine is not None:  # saved anew when training reaches them again, not skipped for ever
            for bad, reason in corrupt:
                quarantine(bad, reason)
        return loaded
    if steps:
        raise CheckpointError(
            f"every committed checkpoint in {storage.url(storage.root)} is corrupt "
            f"(steps {steps}; see the warnings); refusing to start from scratch over them"
        )
    return None


def apply(objects: Mapping[str, object], reader: VerifiedReader, state: Mapping[str, Any]) -> None:
    """Restore each object, in order, from a verified checkpoint (see :func:`~cadence.checkpoint.objects.load_object`)."""
    for name, obj in objects.items():
        load_object(name, obj, reader, state["state"])
