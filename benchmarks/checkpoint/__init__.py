"""Checkpoint benchmarks: save and load against peers, the stall of an asynchronous save (CPU, CUDA), sharded
saves under FSDP2, where asynchronous saves pay, a neighbour's effect on a step, a resume's cost."""
