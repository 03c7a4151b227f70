"""Loading: the one load_models (checkpoint -> build cache -> artifact -> weights), the artifact
reader, the drafter loader."""
