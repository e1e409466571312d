"""The work behind each CLI command: run, tune, bench, predict, simulate, list."""
