"""Every process of a run gets the same torch intra-op threads, whatever its layout: 1 unless the user set
``OMP_NUM_THREADS`` (``cadence.torch.runtime.threads``)."""

from __future__ import annotations

import logging

import torch

from cadence.torch.runtime.threads import INTRA_OP_THREADS, fix_intra_op_threads


def test_without_omp_num_threads_a_process_gets_one_thread_and_says_so(caplog):
    torch.set_num_threads(2)  # as torch would give a process of a 2-core node alone (restored by conftest)
    with caplog.at_level(logging.DEBUG, logger="cadence.torch.runtime.threads"):
        assert fix_intra_op_threads({"PATH": "/bin", "OMP_NUM_THREADS": " "}) == INTRA_OP_THREADS == 1
    assert torch.get_num_threads() == 1
    assert [r.getMessage() for r in caplog.records] == [
        "torch intra-op threads: 1, as on any layout of processes (OMP_NUM_THREADS is unset; set it for more)"]


def test_a_user_setting_of_omp_num_threads_is_left_to_torch():
    torch.set_num_threads(2)  # what torch made of OMP_NUM_THREADS=2 at its start
    assert fix_intra_op_threads({"OMP_NUM_THREADS": "2"}) == 2
    assert torch.get_num_threads() == 2
