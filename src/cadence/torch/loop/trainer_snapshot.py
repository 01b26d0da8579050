"""A :class:`~cadence.torch.loop.trainer.TorchTrainer`'s checkpoint content captured at one moment,
and its writing into a checkpoint (synchronous saves, and the asynchronous snapshot written later
while training goes on)."""

from __future__ import annotations

import logging
from typing import Any

from cadence.checkpoint.background import Pending, Worker
from cadence.checkpoint.protocol import CheckpointWriter
from cadence.torch.checkpoint_io import tensor_tree
from cadence.torch.checkpoint_io.pipelined import PendingCopy
from cadence.torch.checkpoint_io.shard_writes import files_of
from cadence.torch.checkpoint_io.state import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    SafetensorsPayload,
    save_torch_state,
)
from cadence.torch.components.ema import EMA_FILE

log = logging.getLogger(__name__)

__all__ = ["TrainerSnapshot"]


class TrainerSnapshot:
    """A :class:`TorchTrainer`'s checkpoint content captured at one moment: the model's tensors,
    the optimizer / scheduler / grad-scaler state and the JSON state. ``save_checkpoint(writer)``
    writes it (see :meth:`TorchTrainer.save_checkpoint`)."""

    def __init__(self, model: SafetensorsPayload | None, torch_state: dict[str, Any], state: dict[str, Any],
                 *, shards: Pending | None = None, ema: SafetensorsPayload | None = None) -> None:
        self.model = model
        self.ema = ema  # ema.safetensors (an EMA of the weights), or None
        self.torch_state = torch_state
        self.state = state
        self.shards = shards  # a sharded checkpoint: the ranks' write of their files
        self.written = False  # True once save_checkpoint is done with the tensors (then reusable)
        self.ready: Any = None  # set for CUDA state: the device-to-host copies are done once it synchronizes
        self.copied: PendingCopy | None = None  # a pipelined snapshot: the copy of its tensors in flight

    def save_checkpoint(self, writer: CheckpointWriter) -> dict[str, Any]:
        """Write the model's file (then the EMA's) here and the optimizer's on a helper thread, at once
        (writes, checksums and fsyncs release the GIL); return the JSON state. A sharded checkpoint: wait
        for the ranks' write and add every rank's files."""
        if self.shards is not None:
            for rank, files in enumerate(files_of(self.shards, 0)):
                writer.add_files(files, rank=rank)
            self.written = True
            return self.state
        assert self.model is not None
        if self.copied is not None:
            # The tensors are copies from here on. A failed copy raises, and the snapshot is not
            # marked written: some of its tensors may be live ones, never to be reused.
            self.copied.result()
            self.copied = None
        try:
            if self.ready is not None:
                self.ready.synchronize()
            optimizer = _FILE_WRITER.submit(self._write_optimizer, writer)
            try:
                with writer.open(MODEL_FILE) as f:
                    self.model.write(f)
                if self.ema is not None:
                    with writer.open(EMA_FILE) as f:
                        self.ema.write(f)
            except BaseException:
                optimizer.wait()  # done with the tensors; the model's error wins
                raise
            optimizer.result()
        finally:
            self.written = True
        return self.state

    def _write_optimizer(self, writer: CheckpointWriter) -> None:
        try:
            optimizer = tensor_tree.payload(self.torch_state)
        except tensor_tree.NotFlat as e:
            log.debug("optimizer state saved with torch.save: %s", e)
            with writer.open(OPTIMIZER_FILE) as f:
                save_torch_state(f, self.torch_state, OPTIMIZER_FILE)
            return
        with writer.open(OPTIMIZER_TENSORS_FILE) as f:
            optimizer.write(f)


_FILE_WRITER = Worker("cadence-write")  # writes a checkpoint's second file beside the first
