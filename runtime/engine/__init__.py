"""The Engine front door (engine.py) over a runner: models in this process (local.py) or spawned ranks (ranks.py)."""
