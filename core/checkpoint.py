"""A checkpoint directory: its shards, the index that names them, and raw tensor access.

`model.safetensors.index.json` ({"weight_map": {tensor: shard file}}) or a single
`model.safetensors`. Headers are parsed lazily per shard, so opening a 64-shard checkpoint reads
only the index; each tensor comes out as a zero-copy memory-mapped view.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.errors import CheckpointError
from core.safetensors_file import SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class Checkpoint:
    """Name -> shard resolution over a directory of safetensors files."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / INDEX_NAME
        single = self.dir / SINGLE_NAME
        self._shards: dict[str, SafetensorsFile] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index "
                                      f"({exc.__class__.__name__}: {exc})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: `weight_map` must be an object")
            for shard in sorted(set(weight_map.values())):
                if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
                    raise CheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
                if not (self.dir / shard).is_file():
                    raise CheckpointError(f"{index}: points at missing shard {shard!r}")
            self.weight_map: dict[str, str] = dict(weight_map)
        elif single.is_file():
            shard = SafetensorsFile(single)
            self._shards[SINGLE_NAME] = shard
            self.weight_map = {name: SINGLE_NAME for name in shard.keys()}
        else:
            raise CheckpointError(f"{self.dir}: no {INDEX_NAME} or {SINGLE_NAME} found")

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shard_files(self) -> list[Path]:
        return [self.dir / s for s in sorted(set(self.weight_map.values()))]

    def _shard(self, file: str) -> SafetensorsFile:
        shard = self._shards.get(file)
        if shard is None:
            shard = self._shards[file] = SafetensorsFile(self.dir / file)
        return shard

    def validate(self) -> None:
        """Parse every shard header and check the index against them (no tensor data is read)."""
        for name, file in self.weight_map.items():
            if name not in self._shard(file):
                raise CheckpointError(f"{self.dir / file}: tensor {name!r} listed in the index is not in this shard")

    def shape(self, name: str) -> tuple[int, ...]:
        file = self._file_of(name)
        entry = self._shard(file).entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.dir / file}: tensor {name!r} listed in the index is not in this shard")
        return entry.shape

    def tensor(self, name: str) -> torch.Tensor:
        file = self._file_of(name)
        shard = self._shard(file)
        if name not in shard:
            raise CheckpointError(f"{self.dir / file}: tensor {name!r} listed in the index is not in this shard")
        return shard.tensor(name)

    def _file_of(self, name: str) -> str:
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return file
