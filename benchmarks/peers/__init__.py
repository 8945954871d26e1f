"""One module per peer; each runs as a script (``python benchmarks/peers/<name>.py CONFIG``)
in its own process and prints its rows as JSON, so one peer's crash never ends the run."""
