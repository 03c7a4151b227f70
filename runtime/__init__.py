"""kdtree runtime: the target and drafter forward passes, the speculative loop, the Engine."""


def __getattr__(name):  # `from runtime import Engine` without importing torch for every submodule
    if name == "Engine":
        from runtime.engine import Engine

        return Engine
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
