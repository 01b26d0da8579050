"""Training components a config turns on: EMA, profiler, compile, LR schedule, precision, throughput, metrics."""
