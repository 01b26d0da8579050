"""How ranks split a model: FSDP2 sharding over the units a Task names (DDP wrapping is the Context's),
rank 0's buffers made every rank's before an evaluation or a save (``replicas``), and the
gradient norm over every mesh dimension for clipping (``grad_norm``)."""
