"""Reading a model dir for people: cadence ls and cadence report."""
