"""Inference export: formats, signatures, and the staging that publishes an export directory atomically."""
