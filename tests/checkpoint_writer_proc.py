"""Helper for tests/processes/test_checkpoint.py: starts a slow save, to be killed with SIGKILL mid-way.

Usage: python checkpoint_writer_proc.py DIRECTORY STEP
Prints "WRITING" (flushed) once the first chunk of a big file is written, then keeps writing
chunks slowly; the test kills the process while the checkpoint is half-written.
"""

from __future__ import annotations

import sys
import time

from cadence.checkpoint import CheckpointManager

CHUNK = b"\xab" * 65536


class SlowBlob:
    def save_checkpoint(self, writer):
        with writer.open("big.bin") as f:
            for i in range(2000):
                f.write(CHUNK)
                f.flush()
                if i == 0:
                    print("WRITING", flush=True)
                time.sleep(0.02)
        return {"chunks": 2000}

    def load_checkpoint(self, reader, state):  # pragma: no cover - never committed
        raise AssertionError("unreachable")


def main() -> None:
    directory, step = sys.argv[1], int(sys.argv[2])
    CheckpointManager(directory, max_to_keep=None).save(step, {"blob": SlowBlob()})
    print("COMMITTED", flush=True)  # the test kills us before this


if __name__ == "__main__":
    main()
