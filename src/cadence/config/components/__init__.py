"""The settings of each training component (EMA, profiler, compile, activation
checkpointing, LR schedule): one pydantic
model each, with its defaults, read by the experiment schema and by the component itself."""
