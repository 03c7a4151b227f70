"""Benchmarks: scripts run on the GPU machine; results land in benchmarks/results/."""
