"""`kdtree build`: checkpoint (+ drafter) -> per-rank artifact, through the content-addressed cache.

Steps (each with a progress bar where long): validate (config, plan, options) -> hash inputs -> cache
lookup (verified) -> on a miss, in a private staging folder: shard weights per rank, export ONNX graphs
per rank, compile kernels per arch, copy tokenizer files and the drafter, [TensorRT engines], [on a
GPU with warm: decode in every mode and keep Triton's compiled kernels, build_pipeline/kernel_cache.py] ->
manifest (written last) -> atomic rename into the cache -> optional copy to --out.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from build_pipeline import artifact_cache as cache
from build_pipeline.artifact_cache import FORMAT
from build_pipeline.compile_kernels import compile_all, parse_archs
from build_pipeline.integrity import sha256_file
from build_pipeline.kernel_cache import UNWARMED, not_warmed
from build_pipeline.shard import GLOBALS_FILE, layer_file, write_rank_shards
from core.cache_dir import cache_root
from core.checkpoint import INDEX_NAME, Checkpoint
from core.config import ModelConfig, load_config
from core.errors import ConfigError, KdtreeError
from core.plan import ParallelPlan
from core.safetensors_file import SafetensorsFile
from core.staging import staged_dir
from core.tokenizer import Tokenizer
from plugins.common.device import device_facts

DEFAULT_BUDGETS = (16, 32, 64)
# what a manifest says of its rank files (every artifact, built or synthetic)
LAYOUT = {"weights": "build_pipeline/shard.py", "moe_int4": "moe_w4a16 fragment order "
          "(plugins/moe_w4a16/fragment_layout.py)", "graph_activations": "float32"}
COLLECTIVES = {"all_reduce": ["attn_part", "mlp_part", "moe_part", "x_part"], "gather": ["logits_part"]}
DEFAULT_ARCHS = ("sm_90",)
# what core/tokenizer.Tokenizer reads (and the chat template a server will): nothing else of a model
# dir is carried into an artifact (no remote code, no stray files)
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")


@dataclass
class BuildResult:
    art_dir: Path  # the artifact: --out if given, else the cache entry
    cache_hit: bool
    manifest: dict
    seconds: float

    def summary(self) -> dict:
        """What `kdtree build --json` prints."""
        m = self.manifest
        return {"artifact": str(self.art_dir), "cache_hit": self.cache_hit, "key": m["key"],
                "seconds": round(self.seconds, 3), "plan": m["plan"], "backend": m["options"]["backend"],
                "ranks": {r: len(v["files"]) for r, v in m["ranks"].items()},
                "kernels": len(m["kernels"]), "graphs": sum(len(v["graphs"]) for v in m["ranks"].values()),
                "triton_cache": m.get("triton_cache"),
                "bytes": sum(f["bytes"] for f in m["files"].values()), "steps_s": m.get("steps_s", {})}


def build(model_dir: str | Path, out: str | Path | None = None, drafter_dir: str | Path | None = None, tp: int = 1,
          ep: bool = False, backend: str = "native", archs=DEFAULT_ARCHS, budgets=DEFAULT_BUDGETS,
          progress: bool = True, force: bool = False, warm: bool = False) -> BuildResult:
    """Build (or fetch from the cache) the artifact of `model_dir` for the given plan and options.

    warm: on a machine with a CUDA device, decode the new artifact in every mode and keep the Triton
    kernels that compiled in ART/kernels/triton-<arch>/ (build_pipeline/kernel_cache.py), so a run on a
    GPU of that arch compiles nothing; without a CUDA device (or with backend tensorrt) nothing is warmed
    and the manifest's triton_cache says why."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"MODEL_DIR {model_dir}: not a directory")
    cfg = load_config(model_dir)
    # a bad tokenizer symlink or file fails before any work (a checkpoint without one builds: ids only)
    if {f.name for f in tokenizer_files(model_dir)} & {"tiktoken.model", "tokenizer.json"}:
        Tokenizer.load(model_dir)
    plan = ParallelPlan(tp=tp, ep=ep)
    plan.validate(cfg)
    archs = parse_archs(archs)
    budgets = _parse_budgets(budgets)
    if backend not in ("native", "tensorrt"):
        raise KdtreeError(f"--backend must be native or tensorrt, got {backend!r}")
    if backend == "tensorrt":
        from build_pipeline.trt_backend import require_tensorrt
        require_tensorrt()
    if drafter_dir is not None:
        from core.drafter_config import load_drafter_config
        drafter_dir = Path(drafter_dir)
        load_drafter_config(drafter_dir)  # validates: a bad --drafter fails before any work
    if out is not None:
        refuse_foreign_out(Path(out), force)  # before the build, not after it
    options = {"tp": tp, "ep": ep, "backend": backend, "archs": list(archs), "budgets": list(budgets)}
    warm_arch = device_facts(torch.device("cuda")).arch if warm and backend == "native" and tp == 1 \
        and torch.cuda.is_available() else None
    if warm_arch is not None:  # only then: the key of an unwarmed build stays what it was
        options["warm"] = warm_arch

    root = cache_root()
    memo = cache.HashMemo(root)
    inputs = _input_hashes(model_dir, drafter_dir, memo)
    memo.save()
    tools = cache.toolchain()
    key = cache.build_key(inputs, options, cache.code_version(), tools)
    entry = None if force else cache.lookup(root, key)
    hit = entry is not None
    if entry is None:
        with cache.staging(root, key) as stage:
            manifest = _build_into(stage, model_dir, drafter_dir, cfg, plan, archs, budgets, backend, progress)
            manifest.update(format=FORMAT, format_version=cache.FORMAT_VERSION, key=key, options=options,
                            toolchain=tools, inputs=inputs, budgets=list(budgets))
            manifest["triton_cache"] = _warm(stage, manifest, budgets, warm_arch, progress)
            entry = cache.commit(stage, root, key, manifest)
    manifest = json.loads((entry / cache.MANIFEST).read_text())
    art = _place(entry, Path(out), key, force) if out is not None else entry
    return BuildResult(art, hit, manifest, time.perf_counter() - t0)


def ensure_built(model_dir: str | Path, drafter_dir: str | Path | None = None, tp: int = 1, ep: bool = False,
                 **options) -> Path:
    """The artifact folder for model_dir (built now on a cache miss, quietly)."""
    options.setdefault("progress", False)
    return build(model_dir, drafter_dir=drafter_dir, tp=tp, ep=ep, **options).art_dir


def _build_into(stage: Path, model_dir: Path, drafter_dir: Path | None, cfg: ModelConfig, plan: ParallelPlan,
                archs: tuple[str, ...], budgets: tuple[int, ...], backend: str, progress: bool) -> dict:
    steps: dict[str, float] = {}
    t = time.perf_counter()
    rank_files = write_rank_shards(model_dir, cfg, plan, stage, progress=progress)
    steps["shard"] = time.perf_counter() - t

    t = time.perf_counter()
    # imported here, on a cache miss only: onnx (with ml_dtypes) takes ~0.6 s to import, which every `kdtree run
    # <checkpoint dir>` hitting the cache would otherwise pay before its first token
    from build_pipeline.export_onnx import export_rank
    graphs = {r: export_rank(cfg, plan, r, _graph_tensors(stage, cfg, r), stage) for r in range(plan.tp)}
    steps["export_onnx"] = time.perf_counter() - t

    t = time.perf_counter()
    kernels = compile_all(stage, archs, budgets, progress=progress)
    steps["compile_kernels"] = time.perf_counter() - t

    t = time.perf_counter()
    tok = stage / "tokenizer"
    tok.mkdir()
    for f in tokenizer_files(model_dir):
        shutil.copyfile(f, tok / f.name)
    if drafter_dir is not None:
        shutil.copytree(drafter_dir, stage / "drafter", ignore=shutil.ignore_patterns(".*"))
    engines = {}
    if backend == "tensorrt":
        from build_pipeline.trt_backend import build_engines
        engines = build_engines(stage, graphs)
    steps["copy"] = time.perf_counter() - t

    t = time.perf_counter()
    files = cache.hash_tree(stage)
    steps["hash"] = time.perf_counter() - t

    def listed(paths: list[str]) -> list[dict]:
        return [{"path": p, **files[p]} for p in paths]

    return {
        "model": cfg.to_dict(), "plan": plan.to_dict(), "files": files, "steps_s": steps,
        "ranks": {str(r): {"files": listed(rank_files[r]), "graphs": listed(graphs[r]),
                           "engines": listed(engines.get(r, [])),
                           "vocab_range": list(plan.vocab_range(cfg, r)),
                           "experts": list(plan.local_experts(cfg, r)), "heads": plan.local_heads(cfg)}
                  for r in range(plan.tp)},
        "kernels": [dict(k, sha256=files[k["cubin"]]["sha256"]) for k in kernels],
        "drafter": {"dir": "drafter", "source": str(drafter_dir)} if drafter_dir is not None else None,
        "tokenizer": "tokenizer",
        "layout": LAYOUT, "collectives": COLLECTIVES,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _warm(stage: Path, manifest: dict, budgets: tuple[int, ...], warm_arch: str | None, progress: bool) -> dict:
    """manifest["triton_cache"]; when warm_arch is set, the warmed kernels are added to manifest["files"]."""
    if warm_arch is None:  # one reason for every unwarmed build: they share a key, so whichever built it first
        return not_warmed(UNWARMED)
    from build_pipeline.kernel_cache import warm as warm_kernels

    record, folder = warm_kernels(stage, manifest, budgets, progress)
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            manifest["files"][p.relative_to(stage).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest["steps_s"]["warm_triton"] = record["seconds"]
    return record


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The TOKENIZER_FILES present in model_dir.  A symlink among them must stay inside model_dir, or
    point into the blobs/ of a Hugging Face cache repo when model_dir is one of its snapshots/."""
    root = model_dir.resolve()
    allowed = [root]
    if root.parent.name == "snapshots":  # <repo>/snapshots/<rev>/file -> ../../blobs/<sha>
        allowed.append(root.parent.parent / "blobs")
    out = []
    for name in TOKENIZER_FILES:
        f = model_dir / name
        if not f.exists() and not f.is_symlink():
            continue
        target = f.resolve()
        if not any(target.is_relative_to(a) for a in allowed):
            raise KdtreeError(f"{f}: a symlink to {target}, outside the model directory; refusing to copy it")
        if not target.is_file():
            raise KdtreeError(f"{f}: not a regular file")
        out.append(f)
    return out


def _graph_tensors(stage: Path, cfg: ModelConfig, rank: int) -> dict[str, torch.Tensor]:
    """The stored tensors the graph export needs for shapes/dtypes: globals, first dense and first MoE layer."""
    wanted = {GLOBALS_FILE}
    for kind in (False, True):
        first = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i) == kind), None)
        if first is not None:
            wanted.add(layer_file(first))
    out = {}
    for name in sorted(wanted):
        f = SafetensorsFile(stage / f"rank{rank}" / name)
        out.update({k: f.tensor(k) for k in f.keys()})
    return out


def _input_hashes(model_dir: Path, drafter_dir: Path | None, memo: cache.HashMemo) -> dict[str, str]:
    """sha256 of every file the build reads, by relative name: of the model dir config.json, the
    safetensors index and the shards it names, the tokenizer files (nothing else there changes the
    artifact); the whole drafter dir (copied as is), hidden files skipped."""
    ckpt = Checkpoint(model_dir)
    read = [model_dir / "config.json", *ckpt.shard_files(), *tokenizer_files(model_dir)]
    if (model_dir / INDEX_NAME).is_file():
        read.append(model_dir / INDEX_NAME)
    out = {"model/" + f.relative_to(model_dir).as_posix(): memo.sha256(f) for f in sorted(read)}
    if drafter_dir is not None:
        for f in sorted(drafter_dir.rglob("*")):
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(drafter_dir).parts):
                out["drafter/" + f.relative_to(drafter_dir).as_posix()] = memo.sha256(f)
    return out


def _parse_budgets(budgets) -> tuple[int, ...]:
    items = budgets.split(",") if isinstance(budgets, str) else list(budgets)
    try:
        vals = tuple(sorted({int(b) for b in items if str(b).strip()}))
    except ValueError:
        raise KdtreeError(f"--budgets must be comma-separated positive integers, got {budgets!r}") from None
    if not vals or vals[0] < 1:
        raise KdtreeError(f"--budgets must be comma-separated positive integers, got {budgets!r}")
    return vals


def holds_key(out: Path, key: str) -> bool:
    """Whether --out already holds the artifact of `key`, intact."""
    try:
        return json.loads((out / cache.MANIFEST).read_text()).get("key") == key and cache.verify(out) is None
    except (OSError, ValueError):
        return False


def refuse_foreign_out(out: Path, force: bool) -> None:
    """Never delete something that is not a build output unasked: an --out that exists, is not an
    artifact and is not an empty folder needs --force."""
    foreign = out.exists() and not (out / cache.MANIFEST).is_file() and (not out.is_dir() or any(out.iterdir()))
    if foreign and not force:
        raise KdtreeError(f"--out {out}: exists and is not a kdtree artifact (pass --force to replace it)")


def _place(entry: Path, out: Path, key: str, force: bool) -> Path:
    """Copy the cache entry to --out atomically.  An --out already holding this key is left as is, an
    older artifact there is replaced, anything else only with --force."""
    if holds_key(out, key):
        return out
    refuse_foreign_out(out, force)
    with staged_dir(out) as stage:
        shutil.copytree(entry, stage, dirs_exist_ok=True)
    return out
