"""Tensor / expert parallelism: the `Comm` of one rank (comm.py) and the rank processes (ranks.py)."""
