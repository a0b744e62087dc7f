"""The user's benchmarks of jaxmoe (python -m benchmarks.NAME) and their shared timing and reporting."""
