"""Simulated vLLM pieces for tests, demos and benchmarks (never used by the service itself)."""
