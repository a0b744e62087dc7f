"""Research and profiling scripts behind jaxmoe's kernel work (python -m benchmarks.research.NAME)."""
