"""The training loop: the Controller, its schedules, what it reports, callback dispatch and the sanity check."""
