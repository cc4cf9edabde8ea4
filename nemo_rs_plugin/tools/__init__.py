"""The ``nemo-rs`` command and what it runs: check, simulate, recipes, reference, doctor, lab."""
