"""Shared by the benchmarks: the one results writer and the examples' Tasks."""
