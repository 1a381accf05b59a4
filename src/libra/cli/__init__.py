"""The ``libra`` command line. Only the CLI prints; the library logs."""
