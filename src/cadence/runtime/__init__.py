"""The process's runtime: how ranks coordinate, signal handlers, the hang watchdog."""
