"""kdtree runtime: the target and drafter forward passes, the speculative loop, the Engine."""
