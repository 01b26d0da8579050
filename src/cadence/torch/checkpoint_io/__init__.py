"""What a checkpoint holds, as files: model weights, optimizer trees, safetensors, sharded (DCP) state
and the ranks' shard writes."""
