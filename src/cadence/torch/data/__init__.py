"""Training data: resumable samplers and loaders, nested batches, and the data position saved in a checkpoint."""
