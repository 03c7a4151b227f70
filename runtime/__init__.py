"""kdtree runtime: the target and drafter forward passes, the speculative loop, the Engine.

Layers, lowest first: parallel/ (Comm, rank processes), model/ (forward passes), load/ (the one
load_models), decode/ (params, round, session, graphs), engine/ (the Engine front door); cli.py and
bench.py on top."""


def __getattr__(name):  # `from runtime import Engine` without importing torch for every submodule
    if name == "Engine":
        from runtime.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
