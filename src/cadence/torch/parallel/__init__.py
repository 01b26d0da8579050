"""How ranks split the work: DDP and FSDP2 sharding over the units a Task names."""
