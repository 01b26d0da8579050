"""The Task a user subclasses, and the value types it returns."""
