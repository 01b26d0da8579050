"""How ranks split a model: FSDP2 sharding over the units a Task names (DDP wrapping is the Context's)."""
