"""The training loop's benchmarks: its overhead against a hand-written loop and peers, the overheads of throughput
logging, the profiler and the EMA, torch.compile's speed-up, and GPT-2 small on a GPU (``gpu_loop``)."""
