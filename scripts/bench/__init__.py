"""Benchmarks of what dumping costs: measuring helpers, the run state, the server suites, the
writer alone, and the kit that runs them on a GPU machine (gpu/)."""
