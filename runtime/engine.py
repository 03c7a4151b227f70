"""`Engine`: load a model (artifact or checkpoint dir) once, generate streaming text.

    from runtime.engine import Engine
    eng = Engine.load("ART or MODEL_DIR", device="cuda", drafter="DRAFTER_DIR", spec="ddtree", budget=16)
    for piece in eng.generate("The quick brown fox", max_new_tokens=64):
        print(piece, end="")
    eng.last_stats   # tokens/s, tau, rounds, host overhead per round, graphs used or why not

Decoding goes through a DecodeSession (runtime/session.py) per (mode, budget, batch): persistent
buffers, the static step of runtime/round.py, and on CUDA one captured graph per bucket replayed
through cuda-python (runtime/graphs.py); `graphs=False` runs the same step eagerly.  The same
session code runs runtime/spec.py's generate_spec* and runtime/generate.py's generate_ar* (eager).
At T = 0 the output is the target's greedy output; at T > 0 tokens are sampled with the
counter-based generator of runtime/rng.py (seeded, the same draws eager or replayed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from build_pipeline.errors import CheckpointError
from runtime.generate import SamplingParams
from runtime.graphs import GraphPool
from runtime.session import DecodeSession, collect
from runtime.spec import SpecStats
from runtime.tokenizer import StreamDecoder, Tokenizer


class Engine:
    def __init__(self, target, drafter, tokenizer: Tokenizer | None, spec: str, budget: int, graphs: bool,
                 sessions: dict | None = None, pool: GraphPool | None = None):
        if spec not in ("none", "chain", "ddtree"):
            raise ValueError(f"spec must be none, chain or ddtree, got {spec!r}")
        if spec != "none" and drafter is None:
            raise ValueError(f"spec {spec!r} needs a drafter (drafter=DIR, or an artifact built with --drafter)")
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer  # drafter kept for configure()
        self.spec, self.budget, self.graphs = spec, budget, graphs
        self.device = target.device
        self._sessions = sessions if sessions is not None else {}
        self._pool = pool
        if graphs and self.device.type == "cuda" and self._pool is None:
            self._pool = GraphPool(self.device)
        self.last_stats: dict = {}

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", drafter: str | Path | None = None, spec: str | None = None,
             budget: int = 16, graphs: bool = True, tp: int = 1, ep: bool = False, dtype: torch.dtype | None = None,
             build: bool = False, progress: bool = False) -> "Engine":
        """path: a `kdtree build` artifact or a checkpoint dir.  spec: "ddtree" | "chain" | "none";
        None picks ddtree when a drafter is given (or stored in the artifact), else none.  graphs:
        capture and replay CUDA graphs on CUDA (ignored on CPU).  ep: with tp > 1, routed experts
        whole per rank (expert parallel) instead of TP-sliced (one rank holds every expert
        either way; an artifact keeps the plan it was built with).  build: take a checkpoint dir
        through the build cache first (build_pipeline.build.ensure_built).  dtype: fp32 on CPU,
        bf16 on CUDA by default."""
        if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA device is available")
        if tp > 1:
            return _load_tp(path, device=device, drafter=drafter, spec=spec, budget=budget, graphs=graphs, tp=tp,
                            ep=ep, dtype=dtype, build=build, progress=progress)
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        path = Path(path)
        if build and not _is_artifact(path):
            from build_pipeline.build import ensure_built

            path = Path(ensure_built(path, drafter_dir=drafter))
        target, drafter_model, tok = _load_models(path, drafter, device, dtype, progress)
        spec = spec or ("ddtree" if drafter_model is not None else "none")
        return cls(target, drafter_model, tok, spec, budget, graphs)

    def configure(self, spec: str | None = None, budget: int | None = None, graphs: bool | None = None) -> "Engine":
        """The same loaded model with other decoding options (sessions and graph pool shared)."""
        return Engine(self.target, self.drafter, self.tokenizer, spec or self.spec,
                      budget if budget is not None else self.budget, self.graphs if graphs is None else graphs,
                      self._sessions, self._pool)

    # ---- generation
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.target.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return ids

    def stop_ids(self, stop: Sequence[int | str] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Default stops (eos, <|im_end|>, config eos) plus `stop`: ints are token ids, strings are
        matched on the text (Engine.generate only)."""
        ids = set(self.target.cfg.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.stop_ids())
        texts = []
        for s in stop or ():
            if isinstance(s, str):
                texts.append(s)
            else:
                ids.add(int(s))
        return tuple(sorted(ids)), tuple(texts)

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 stop: Sequence[int | str] | None = None, seed: int | None = None) -> Iterator[str]:
        """Stream the text of the new tokens, piece by piece (stop tokens are not shown; a stop
        string ends the text before it)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: use generate_ids")
        ids, texts = self.stop_ids(stop)
        dec = StreamDecoder(self.tokenizer, skip=ids)
        shown = ""  # text returned so far (held back while it could be the start of a stop string)
        pending = ""
        hold = max((len(t) for t in texts), default=1) - 1
        for tok in self.generate_ids(prompt, max_new_tokens, temperature, stop, seed):
            pending += dec.push(tok)
            if texts:
                hit = min((i for i in (pending.find(t) for t in texts) if i >= 0), default=-1)
                if hit >= 0:
                    if pending[:hit]:
                        yield pending[:hit]
                    return
                cut = max(len(pending) - hold, 0)
                piece, pending = pending[:cut], pending[cut:]
            else:
                piece, pending = pending, ""
            if piece:
                shown += piece
                yield piece
        pending += dec.flush()
        if texts:
            hit = min((i for i in (pending.find(t) for t in texts) if i >= 0), default=-1)
            pending = pending[:hit] if hit >= 0 else pending
        if pending:
            yield pending

    def generate_ids(self, prompt: str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                     stop: Sequence[int | str] | None = None, seed: int | None = None) -> Iterator[int]:
        """Stream the new token ids of one request (the stop token, when hit, included last)."""
        ids = self.encode(prompt)
        for per_request in self._rounds([ids], max_new_tokens, temperature, stop, seed):
            yield from per_request[0]

    def generate_batch_ids(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64,
                           temperature: float = 0.0, stop: Sequence[int | str] | None = None,
                           seed: int | None = None) -> list[list[int]]:
        """Decode several requests together (each with its own cache length and tree)."""
        encoded = [self.encode(p) for p in prompts]
        return collect(self._rounds(encoded, max_new_tokens, temperature, stop, seed), len(encoded))

    def _rounds(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                stop: Sequence[int | str] | None, seed: int | None) -> Iterator[list[list[int]]]:
        check_decode_args(max_new_tokens, temperature)
        stats = SpecStats()
        stats.extra.update(spec=self.spec, budget=self.budget if self.spec == "ddtree" else None,
                           device=str(self.device), batch=len(prompts), plan=self.target.plan.flag())
        self.last_stats = stats.as_dict()
        if max_new_tokens == 0:
            return
        ids, _ = self.stop_ids(stop)
        session = self._session(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
        req = SamplingParams(max_new_tokens, temperature, 0 if seed is None else int(seed), ids)
        try:
            yield from session.rounds(prompts, req, self.graphs, stats)
        finally:
            self.last_stats = stats.as_dict()

    def _session(self, batch: int, need: int) -> DecodeSession:
        key = (self.spec, self.budget if self.spec == "ddtree" else 0, batch)
        s = self._sessions.get(key)
        if s is None or s.capacity < need:
            capacity = max(512, 1 << (need - 1).bit_length())  # powers of two: few re-allocations
            s = self._sessions[key] = DecodeSession(self.target, self.drafter, self.spec, self.budget, batch,
                                                    capacity, self._pool)
        return s


def check_decode_args(max_new_tokens: int, temperature: float) -> None:
    """The argument checks every generate path shares (one rank or many)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


def _is_artifact(path: Path) -> bool:
    try:
        from runtime.artifact import is_artifact
    except ImportError:
        return False
    return is_artifact(path)


def _load_models(path: Path, drafter_dir, device, dtype, progress):
    """-> (target, drafter or None, tokenizer or None) from an artifact or a checkpoint dir."""
    from build_pipeline.drafter_config import load_drafter_config
    from runtime.drafter import load_drafter
    from runtime.model import TargetModel, load_target

    if _is_artifact(path):
        from runtime.artifact import load_rank

        bundle = load_rank(path, 0, device, dtype)
        if bundle.plan.tp != 1:
            raise ValueError(f"{path} was built for {bundle.plan.tp} ranks: pass tp={bundle.plan.tp}")
        drafter_dir = drafter_dir or bundle.drafter_dir
        features = load_drafter_config(drafter_dir).target_layer_ids if drafter_dir is not None else ()
        target = TargetModel(bundle.cfg, bundle.weights, features)
        tok_dir = bundle.tokenizer_dir
    else:
        features = load_drafter_config(drafter_dir).target_layer_ids if drafter_dir is not None else ()
        target = load_target(path, device=device, dtype=dtype, feature_layers=features, progress=progress)
        tok_dir = path
    drafter = load_drafter(drafter_dir, target, progress=progress) if drafter_dir is not None else None
    try:
        tok = Tokenizer.load(tok_dir)
    except CheckpointError:  # a checkpoint without tokenizer files still decodes ids
        tok = None
    return target, drafter, tok


def _load_tp(path, **kw) -> "Engine":
    """tp > 1 runs one process per rank through runtime/dist.py: `dist.load_engine(path, device=,
    drafter=, spec=, budget=, graphs=, tp=, ep=, dtype=, build=, progress=)` returns an Engine-like object
    (generate, generate_ids, tokenizer, target, stop_ids, last_stats)."""
    try:
        from runtime import dist
    except ImportError:
        dist = None
    if dist is None or not hasattr(dist, "load_engine"):
        raise ValueError(f"tp={kw['tp']}: multi-rank engines need runtime.dist.load_engine, which this "
                         f"install lacks")
    return dist.load_engine(path, **kw)
