"""Shared fixtures: tiny checkpoints in the real layout, built once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from build_pipeline.tiny import make_tiny

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make test-gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class TinyModels:
    """Lazily made tiny checkpoints, keyed by (preset, int4, kimi25, dialect)."""

    def __init__(self, root):
        self.root = root
        self._made: dict[tuple, str] = {}

    def get(self, preset: str = "kimi", int4: bool = False, kimi25: bool = False, dialect: str = "hf",
            twin: bool = False) -> str:
        key = (preset, int4, kimi25, dialect)
        if key not in self._made:
            name = "-".join([preset] + [k for k, v in (("int4", int4), ("k25", kimi25)) if v] + [dialect])
            out = self.root / name
            twin_dir = self.root / (name + "-twin") if int4 else None
            make_tiny(out, preset=preset, int4=int4, kimi25=kimi25, dialect=dialect, twin_dir=twin_dir)
            self._made[key] = str(out)
        path = self._made[key]
        return path + "-twin" if twin else path


@pytest.fixture(scope="session", autouse=True)
def build_cache(tmp_path_factory):
    """Every checkpoint dir a test loads goes through the build cache (runtime/load/models.py): one
    fresh cache per test session, inherited by spawned ranks and CLI subprocesses."""
    path = tmp_path_factory.mktemp("kdtree-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny"))
