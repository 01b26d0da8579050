"""The training loop: the Controller, the runner protocols, schedules, callback dispatch and the sanity check."""
