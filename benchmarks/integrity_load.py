"""Cost of the load-time integrity check (build_pipeline/integrity.py) on one artifact rank.

    kdtree build --synthetic kimi-k2.6 --tp 8 --rank 0 --layers 4 --out /tmp/syn-k26
    python -m benchmarks.integrity_load /tmp/syn-k26 [bfloat16|float32]

Times read_rank with no check, with the sha256 hashed while reading (no marks), and with the marks of
that first load (a stat per file); page cache warmed first, so the numbers are the check's own cost.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch

from build_pipeline import integrity
from runtime.load.artifact import read_rank


def main(art: Path, dtype: torch.dtype) -> None:
    size = sum(p.stat().st_size for p in (art / "rank0").iterdir())

    def load(label: str) -> None:
        t = time.perf_counter()
        read_rank(art, 0, "cpu", dtype)
        s = time.perf_counter() - t
        print(f"{label:<34} {s:7.2f} s  {size / s / 1e9:7.2f} GB/s  ({size / 1e9:.2f} GB, {dtype})")

    for p in (art / "rank0").iterdir():  # warm the page cache
        p.read_bytes()
    checked = integrity.FileCheck.submit
    integrity.FileCheck.submit = lambda self, rel, info: integrity.member(self.art_dir, rel)
    load("no check (baseline)")
    integrity.FileCheck.submit = checked
    shutil.rmtree(art / integrity.VERIFIED, ignore_errors=True)
    load("first load: sha256 while reading")
    load("later load: marks (stat only)")
    t = time.perf_counter()
    for p in (art / "rank0").iterdir():
        integrity.sha256_file(p)
    print(f"{'sha256 alone, one thread':<34} {time.perf_counter() - t:7.2f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]), getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.bfloat16)
