"""`Engine`: the one front door. Load a model once (one rank or many), generate streaming text.

    from runtime import Engine
    eng = Engine.load("ART or MODEL_DIR", device="cuda", drafter="DRAFTER_DIR", spec="ddtree", budget=16)
    # budget="auto" (or "auto:64"): the tree size chosen per round on the device (runtime/decode/budget.py)
    for piece in eng.generate("The quick brown fox", max_new_tokens=64):
        print(piece, end="")
    eng.last_stats   # tokens/s, tau, rounds, host overhead per round, graphs used or why not

Every way in (generate, generate_ids, generate_batch_ids; the CLI, `kdtree bench`, the TP ranks,
the tests) goes through `Engine.rounds`, one iterator of per-round emissions over a runner:
LocalRunner (models in this process: runtime/engine/local.py) or RanksRunner (`tp` rank processes,
each a LocalRunner on its shard: runtime/engine/ranks.py).  Models load through
runtime/load/models.load_models only.  At T = 0 the output is the target's greedy output; at T > 0
tokens are sampled with plugins/common/rng.py's counter-based generator (seeded, the same draws
eager or replayed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from core.config import ModelConfig
from core.plan import ParallelPlan
from core.tokenizer import StreamDecoder, Tokenizer
from runtime.decode.budget import AUTOTUNE_DIR, CostCurve
from runtime.decode.params import InvalidParam, SamplingParams, SpecConfig, default_budget, parse_budget
from runtime.engine.local import LocalRunner
from runtime.engine.ranks import RanksRunner
from runtime.load.artifact import read_manifest
from runtime.load.models import load_models, load_tokenizer, resolve_artifact
from runtime.model.drafter import DFlashDrafter
from runtime.model.target import TargetModel
from runtime.parallel.comm import Comm, comm_from_env, under_torchrun


class Engine:
    def __init__(self, runner: LocalRunner | RanksRunner, tokenizer: Tokenizer | None, rank: int = 0):
        """Use Engine.load (or from_models / on_rank); rank: this process's rank (only rank 0 prints)."""
        self.runner, self.tokenizer, self.rank = runner, tokenizer, rank
        self.cfg = runner.cfg

    # ---- construction
    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", drafter: str | Path | None = None, spec: str | None = None,
             budget: int | str | None = None, graphs: bool = True, tp: int = 1, ep: bool = False,
             dtype: torch.dtype | None = None, progress: bool = False,
             budget_curve: str | Path | CostCurve | None = None) -> "Engine":
        """path: a `kdtree build` artifact or a checkpoint dir (always taken through the build cache:
        runtime/load/models.py).  spec: "ddtree" | "chain" | "none"; None picks ddtree when a drafter
        is given (or stored in the artifact), else none.  graphs: capture and replay CUDA graphs on
        CUDA (ignored on CPU).  tp > 1: one process per rank (or, under torchrun, this process is one
        rank: `rank` says which).  ep: with tp > 1, routed experts whole per rank instead of
        TP-sliced (an artifact keeps the plan it was built with).  dtype: fp32 on CPU, bf16 on CUDA
        by default.  budget: B, or "auto" / "auto:B_MAX" (chosen per round); None: auto on CUDA, 16 on CPU
        (runtime/decode/params.default_budget); budget_curve: with auto, the
        cost curve to choose with (a CostCurve or its JSON file; default: stored beside the artifact under
        autotune/, else measured by the session and stored there)."""
        if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda: no CUDA device is available")
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        curve = CostCurve.load(budget_curve) if isinstance(budget_curve, (str, Path)) else budget_curve
        budget = default_budget(device) if budget is None else budget
        want = _spec(spec, budget, curve)
        plan = ParallelPlan(tp=tp, ep=ep) if tp > 1 else None  # None: an artifact's own plan, or one rank
        if tp > 1 and under_torchrun():
            comm = comm_from_env(device)
            if comm.world != tp:
                raise ValueError(f"--tp {tp}: torchrun started {comm.world} ranks (WORLD_SIZE)")
            return cls.on_rank(comm, path, drafter, spec, budget, graphs, plan, dtype, progress, curve)
        if tp > 1:
            art, plan = resolve_artifact(path, plan, drafter, progress)
            cfg = ModelConfig.from_dict(read_manifest(art)["model"])
            return cls(RanksRunner.start(art, cfg, plan, device, drafter, want, graphs, dtype), load_tokenizer(art))
        m = load_models(path, None, plan, drafter, device, dtype, progress)
        return cls.from_models(m.target, m.drafter, m.tokenizer, spec, budget, graphs, 0, curve,
                               m.art_dir / AUTOTUNE_DIR)

    @classmethod
    def from_models(cls, target: TargetModel, drafter: DFlashDrafter | None = None, tokenizer: Tokenizer | None = None,
                    spec: str | None = None, budget: int | str | None = None, graphs: bool = True, rank: int = 0,
                    budget_curve: CostCurve | None = None, autotune_dir: str | Path | None = None) -> "Engine":
        """An Engine over models already loaded in this process (a rank's shard, or a test's models).
        budget None: the target's device's default (runtime/decode/params.default_budget).
        autotune_dir: where budget-auto sessions store measured cost curves (None: kept in memory)."""
        budget = default_budget(target.device) if budget is None else budget
        want = _spec(spec or ("ddtree" if drafter is not None else "none"), budget, budget_curve)
        return cls(LocalRunner(target, drafter, want, graphs, autotune_dir=autotune_dir), tokenizer, rank)

    @classmethod
    def on_rank(cls, comm: Comm, path: str | Path, drafter: str | Path | None = None, spec: str | None = None,
                budget: int | str | None = None, graphs: bool = True, plan: ParallelPlan | None = None,
                dtype: torch.dtype | None = None, progress: bool = False,
                budget_curve: CostCurve | None = None) -> "Engine":
        """This process as rank comm.rank of a group (torchrun, or a test's launch): its shard's Engine.
        Every rank must make the same calls; each returns the same tokens."""
        m = load_models(path, comm, plan, drafter, dtype=dtype, progress=progress)
        return cls.from_models(m.target, m.drafter, m.tokenizer, spec, budget, graphs, comm.rank, budget_curve,
                               m.art_dir / AUTOTUNE_DIR)

    def configure(self, spec: str | None = None, budget: int | str | None = None, graphs: bool | None = None,
                  budget_curve: CostCurve | None = None) -> "Engine":
        """The same loaded model with other decoding options (sessions and graph pool shared).  The budget
        stays as it was unless given (auto stays auto for ddtree, with the same cost curve unless given)."""
        cur = self.runner.spec
        mode = spec or cur.mode
        size, auto = (cur.budget, cur.auto) if budget is None else parse_budget(budget)
        auto = auto and mode == "ddtree"
        want = SpecConfig(mode, size, auto, (budget_curve or cur.curve) if auto else None)
        runner = self.runner.configure(want, self.runner.graphs if graphs is None else graphs)
        return Engine(runner, self.tokenizer, self.rank)

    # ---- what is loaded
    @property
    def spec(self) -> str:
        return self.runner.spec.mode

    @property
    def budget(self) -> int:
        """The tree budget (with auto: the largest bucket)."""
        return self.runner.spec.budget

    @property
    def spec_config(self) -> SpecConfig:
        """The whole decoding mode: spec, budget, whether auto, the cost curve given."""
        return self.runner.spec

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype | None:
        return self.runner.dtype

    @property
    def has_drafter(self) -> bool:
        return self.runner.has_drafter

    @property
    def plan_flag(self) -> str:
        return self.runner.plan_flag

    @property
    def last_stats(self) -> dict:
        """DecodeStats.as_dict() of the last generation (runtime/decode/stats.py)."""
        return self.runner.last_stats

    # ---- generation
    def encode(self, prompt: str | Sequence[int], allowed_special: bool = False) -> list[int]:
        """Text (special-token strings in it are plain text unless allowed_special) or ids -> checked ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: give token ids")
            ids = self.tokenizer.encode(prompt, allowed_special)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.cfg.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"prompt ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return ids

    def stop_ids(self, stop: Sequence[int | str] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Default stops (eos, <|im_end|>, config eos) plus `stop`: ints are token ids, strings are
        matched on the text (Engine.generate only)."""
        ids = set(self.cfg.eos_token_ids)
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
        pending = ""  # decoded text held back while it could be the start of a stop string
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
        for per_request in self.rounds([prompt], max_new_tokens, temperature, stop, seed):
            yield from per_request[0]

    def generate_batch_ids(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64,
                           temperature: float = 0.0, stop: Sequence[int | str] | None = None,
                           seed: int | None = None) -> list[list[int]]:
        """Decode several requests together (each with its own cache length and tree); each one's new ids."""
        outs: list[list[int]] = [[] for _ in prompts]
        for per_request in self.rounds(prompts, max_new_tokens, temperature, stop, seed):
            for r, toks in enumerate(per_request):
                outs[r] += toks
        return outs

    def rounds(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 64, temperature: float = 0.0,
               stop: Sequence[int | str] | None = None, seed: int | None = None) -> Iterator[list[list[int]]]:
        """The one way a generation runs: per round, the tokens each request emits."""
        if not prompts:
            raise ValueError("no prompts: give at least one request")
        encoded = [self.encode(p) for p in prompts]
        ids, _ = self.stop_ids(stop)
        params = SamplingParams(max_new_tokens, temperature, 0 if seed is None else int(seed), ids)
        self._check_context(max(len(p) for p in encoded), max_new_tokens)
        yield from self.runner.rounds(encoded, params)

    def _check_context(self, prompt: int, max_new_tokens: int) -> None:
        """Refuse up front what would run past the model's context length (vLLM's max_model_len rule:
        prompt + max_new_tokens <= max_position_embeddings)."""
        limit = self.cfg.max_position_embeddings
        if prompt > limit:
            raise ValueError(f"prompt of {prompt} tokens does not fit the model's context length {limit} "
                             f"(max_position_embeddings)")
        if prompt + max_new_tokens > limit:
            raise InvalidParam("max_new_tokens", f"max_new_tokens {max_new_tokens} + prompt {prompt} tokens exceed "
                               f"the model's context length {limit} (max_position_embeddings)")

    def close(self) -> None:
        """Stop the rank processes of a multi-rank engine (a no-op for one rank)."""
        if isinstance(self.runner, RanksRunner):
            self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _spec(spec: str | None, budget: int | str, curve: CostCurve | None = None) -> SpecConfig | None:
    """The asked-for mode, validated (None: decided by whether a drafter is loaded)."""
    if spec is None:
        return None
    return SpecConfig.of(spec, budget, curve) if spec == "ddtree" else SpecConfig(spec, parse_budget(budget)[0])
