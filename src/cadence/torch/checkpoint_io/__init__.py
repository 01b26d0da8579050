"""What a checkpoint holds, as files: RNG and model state, safetensors, optimizer trees, sharded (DCP) state."""
