"""The `specdec` command line and its demo: a client of both services (it starts them as local servers)."""
