"""Benchmarks run on demand (not part of the test suite); see bench/README.md."""
