"""The same number of intra-op threads in every process of a run, whatever its layout:
:func:`fix_intra_op_threads`.

A CPU reduction (a matrix product, a sum) splits its work over torch's intra-op threads, and its
floating-point result depends on how many there are. torch takes that number from
``OMP_NUM_THREADS``, else from the machine's cores; torch's launcher sets ``OMP_NUM_THREADS=1``
for its workers only where it is unset and a node runs several. So without this, one node of 2
processes (1 thread each) and two nodes of 1 process (all the cores each) train the same job to
different weights, and so would a run resumed under another launcher.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

import torch

__all__ = ["INTRA_OP_THREADS", "fix_intra_op_threads"]

log = logging.getLogger(__name__)

INTRA_OP_THREADS = 1
"""The intra-op threads of a process whose ``OMP_NUM_THREADS`` is unset: torch's launcher's choice for
several processes on a node, so that no layout oversubscribes the cores."""


def fix_intra_op_threads(environ: Mapping[str, str] | None = None) -> int:
    """Give this process :data:`INTRA_OP_THREADS` intra-op threads (``torch.set_num_threads``) unless
    ``OMP_NUM_THREADS`` is set in ``environ`` (default: ``os.environ``), which torch then follows
    already; return the number torch now uses. Logged at DEBUG."""
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "").strip():
        threads = torch.get_num_threads()
        log.debug("torch intra-op threads: %d (OMP_NUM_THREADS=%s)", threads, env["OMP_NUM_THREADS"])
        return threads
    if torch.get_num_threads() != INTRA_OP_THREADS:
        torch.set_num_threads(INTRA_OP_THREADS)
    # DEBUG: a line on every command would precede a refusal's one line (the distributed guide says it)
    log.debug("torch intra-op threads: %d, as on any layout of processes (OMP_NUM_THREADS is unset; set it "
             "for more)", INTRA_OP_THREADS)
    return INTRA_OP_THREADS
