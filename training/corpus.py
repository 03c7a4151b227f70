"""The demo corpus: the `.py` files of the running interpreter's standard library (PSF license).

Deterministic: files are read in sorted relative-path order; a file is dropped when the hash of its
normalised text (CRLF -> LF, trailing whitespace stripped per line, leading/trailing blank lines
stripped) was seen before; files that are not UTF-8 are skipped.  `site-packages` is never read.
Held out for evaluation (never trained on, tokenizer included): the modules in HELD_OUT (a top-level
module or package, e.g. `json/…`) and their tests (`test/test_<name>…`); a training file whose
normalised text equals a held-out one is dropped.

Output under `out`: train-NNNNN.jsonl / eval-00000.jsonl shards ({"path", "text"} per line),
manifest.json (interpreter version, file counts, bytes, the held-out list, a sha256 of the corpus)
and LICENSE-corpus.txt.  The corpus depends on the interpreter: the manifest records its version.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# held-out modules: small, self-contained, typical library code (the eval set and the demo prompts)
HELD_OUT = ("bisect", "colorsys", "csv", "fnmatch", "fractions", "glob", "graphlib", "heapq", "json",
            "shlex", "statistics", "textwrap")
SHARD_BYTES = 8_000_000

LICENSE_NOTE = """Training corpus of the kdtree-engine demo models
================================================

The demo target and drafter were trained on the Python source files (`.py`) of the CPython
standard library of the interpreter named in corpus manifest.json (`python_version`).

That text is Copyright (c) 2001-2024 Python Software Foundation; All Rights Reserved, and is
distributed under the Python Software Foundation License Version 2 (PSF-2.0), which permits
reproduction, analysis, derivative works and distribution, provided this notice is retained:
https://docs.python.org/3/license.html  (SPDX: PSF-2.0)

The model weights are a derivative work trained on that text; no file of it is shipped with them.
Held out from training (used for evaluation only): {held_out}.
"""


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def normalise(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "\n".join(lines).strip("\n") + "\n"


def is_held_out(rel: str, held_out: tuple[str, ...] = HELD_OUT) -> bool:
    """rel: a path relative to the stdlib dir, with forward slashes."""
    parts = rel.split("/")
    top = parts[0].removesuffix(".py")
    if top in held_out:
        return True
    tested = [p for p in parts[1:] if p.startswith("test_")]
    if parts[0] in ("test", "tests") and tested:
        name = tested[0][len("test_"):].removesuffix(".py")
        return any(name == m or name.startswith(m + "_") for m in held_out)
    return False


def iter_files(root: Path) -> Iterator[tuple[str, str]]:
    """(relative path, normalised text) of every readable stdlib .py file, sorted by path."""
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    for rel in rels:
        if rel.split("/")[0] in ("site-packages", "dist-packages"):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = normalise(text)
        if text.strip():
            yield rel, text


def split_corpus(root: Path | None = None, held_out: tuple[str, ...] = HELD_OUT
                 ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, eval) lists of (path, text), deduplicated by normalised-text hash, in path order."""
    files = list(iter_files(root or stdlib_dir()))
    seen: set[str] = set()
    train, held = [], []
    for rel, text in files:  # held-out files first claim their hashes
        if is_held_out(rel, held_out):
            h = hashlib.sha256(text.encode()).hexdigest()
            if h not in seen:
                seen.add(h)
                held.append((rel, text))
    for rel, text in files:
        if not is_held_out(rel, held_out):
            h = hashlib.sha256(text.encode()).hexdigest()
            if h not in seen:
                seen.add(h)
                train.append((rel, text))
    return train, held


def build_corpus(out: str | Path, root: Path | None = None, held_out: tuple[str, ...] = HELD_OUT) -> dict:
    """Write the shards, manifest.json and LICENSE-corpus.txt under `out`; returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held = split_corpus(root, held_out)
    digest = hashlib.sha256()
    shards: dict[str, list[str]] = {"train": [], "eval": []}
    for split, docs in (("train", train), ("eval", held)):
        lines, size, n = [], 0, 0
        for rel, text in docs:
            digest.update(f"{split}\0{rel}\0{text}\0".encode())
            line = json.dumps({"path": rel, "text": text}, ensure_ascii=False)
            lines.append(line)
            size += len(line)
            if size >= SHARD_BYTES:
                shards[split].append(_write_shard(out, split, n, lines))
                lines, size, n = [], 0, n + 1
        if lines or not shards[split]:
            shards[split].append(_write_shard(out, split, n, lines))
    manifest = {
        "source": "CPython standard library (.py files)",
        "license": "PSF-2.0",
        "python_version": platform.python_version(),
        "held_out_modules": list(held_out),
        "train_files": len(train), "eval_files": len(held),
        "train_chars": sum(len(t) for _, t in train), "eval_chars": sum(len(t) for _, t in held),
        "shards": shards,
        "sha256": digest.hexdigest(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "LICENSE-corpus.txt").write_text(license_note(held_out))
    return manifest


def license_note(held_out: tuple[str, ...] = HELD_OUT) -> str:
    return LICENSE_NOTE.format(held_out=", ".join(held_out))


def _write_shard(out: Path, split: str, n: int, lines: list[str]) -> str:
    name = f"{split}-{n:05d}.jsonl"
    (out / name).write_text("".join(line + "\n" for line in lines))
    return name


def read_split(corpus_dir: str | Path, split: str) -> list[tuple[str, str]]:
    """The (path, text) documents of `split` ("train" or "eval"), in corpus order."""
    d = Path(corpus_dir)
    manifest = json.loads((d / "manifest.json").read_text())
    docs = []
    for name in manifest["shards"][split]:
        for line in (d / name).read_text().splitlines():
            rec = json.loads(line)
            docs.append((rec["path"], rec["text"]))
    return docs
