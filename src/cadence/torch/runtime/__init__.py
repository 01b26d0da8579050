"""Where a task runs: the Context (device, ranks, seed), torch.distributed, and the RNG states of exact resume."""
