"""What a run reports as it goes: TensorBoard events and metrics.jsonl, progress lines, throughput."""
