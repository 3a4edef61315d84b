"""Benchmarks that compare offload side by side with its baseline in one run and write JSON."""
