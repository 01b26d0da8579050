"""How ranks split a model: FSDP2 sharding over the units a Task names (DDP wrapping is the Context's),
and rank 0's buffers made every rank's before an evaluation or a save (``replicas``)."""
