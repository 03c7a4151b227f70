"""Test helpers: load a tiny pair through the one load path and decode through the Engine front door."""

from __future__ import annotations

import torch

from runtime.decode.params import SamplingParams
from runtime.engine.engine import Engine
from runtime.load.models import LoadedModels, load_models


def load_pair(path, drafter_dir=None, dtype: torch.dtype = torch.float64, device: str = "cpu") -> LoadedModels:
    """The target (and drafter) of a checkpoint dir or artifact, as every rank loads them."""
    return load_models(path, drafter_dir=drafter_dir, device=device, dtype=dtype)


def decode(target, drafter, prompts: list[list[int]], params: SamplingParams, spec: str = "none", budget: int = 16,
           graphs: bool = False) -> tuple[list[list[int]], dict]:
    """Each prompt's new tokens (decoded together) and the stats, through Engine.from_models."""
    eng = Engine.from_models(target, drafter if spec != "none" else None, None, spec, budget, graphs)
    out = eng.generate_batch_ids(prompts, params.max_new_tokens, params.temperature, list(params.stop_ids),
                                 params.seed)
    return out, eng.last_stats
