"""The artifact's Triton kernel cache: what `kdtree build` warms on a GPU so that `kdtree run` compiles nothing.

Triton compiles a kernel variant (constexprs, integer specialisations, dtypes) at its first launch and keeps
it in its on-disk cache (TRITON_CACHE_DIR, default ~/.triton/cache): one folder per cache key holding the
cubin, the IR stages, a metadata .json and a group file `__grp__<name>.json` that lists the folder's files by
absolute path; the C launchers Triton builds with the host compiler sit in the same cache, one folder each.
The cache key covers the kernel source, the Triton version, the GPU target and the options, so an entry
made by one process on one machine is valid for any process with the same Triton and GPU arch.

Build (on a machine with a CUDA device, `kdtree build --warm`, the CLI default): the staged artifact is
decoded in subprocesses (runtime/warm_kernels.py), one per mode (AR, chain, DDTree at every --budgets value and
every bucket of budget auto; graphs on, the runtime's default dtype), over prompt lengths that cover Triton's
integer buckets (== 1, % 16 == 0, other) and the prefill chunks, with TRITON_CACHE_DIR on a scratch folder; then
DDTree with budget auto alone, which measures its cost curve on the idle GPU and stores it in ART/autotune/ (so
`kdtree run` neither compiles nor times anything).  `pack` then copies that cache into
ART/kernels/triton-<arch>/<key>/ with group files naming their children relative to the folder.  The files
are listed in the manifest's `files` (sha256, size) like every other, and manifest["triton_cache"] records
{warmed, dir, arch, triton, entries, cases (with each one's seconds), cost_curves, seconds}, or {warmed: false,
reason} where nothing was warmed (no CUDA device, --no-warm, a checkpoint built by the runtime).

Run (runtime/load/kernel_cache.py): on a GPU of the same arch with the same Triton, `unpack` copies the
entries the user's Triton cache lacks into it (group files rewritten to the destination's paths); the
artifact is never written.  Anything else: one KernelCacheWarning and Triton's JIT as before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.errors import KdtreeError
from plugins.common.device import device_facts

GROUP_PREFIX = "__grp__"  # Triton's group file: {"child_paths": {file name: path}}
# prompt lengths of the warm-up: Triton's integer buckets (1, multiples of 16, other) for the prefill,
# lengths past a prefill chunk, and cache lengths crossing them while decoding
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 11, 16, 17, 24, 32, 33, 47)
NEW_TOKENS = 40
SAMPLED_LENGTHS = (1, 11)  # also decoded at temperature SAMPLED_T (the sampling kernels)
SAMPLED_T = 0.8
# the buckets of `--budget auto` (runtime/decode/budget.default_buckets(AUTO_MAX_BUDGET) of runtime/decode/params;
# a test keeps the two equal: this layer does not import the runtime)
AUTO_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
UNWARMED = ("built without a CUDA device, with --no-warm, with --tp > 1 (the warm-up decodes one rank), for tensorrt, "
            "synthetic, or by the runtime from a checkpoint")


def cache_dir_name(arch: str) -> str:
    """Where an arch's entries sit in the artifact: kernels/triton-<arch>."""
    return f"kernels/triton-{arch}"


def not_warmed(reason: str) -> dict:
    """manifest["triton_cache"] of an artifact without a kernel cache."""
    return {"warmed": False, "reason": reason}


# ---- the folder format (both directions; no Triton import, testable on any machine)

def _entry_files(entry: Path) -> list[Path]:
    """An entry's files, without Triton's leftovers of interrupted writes (tmp.pid_* folders, locks)."""
    return sorted(p for p in entry.iterdir() if p.is_file() and p.name != "lock" and not p.name.startswith("tmp."))


def _rewrite_group(text: str, where: Path, entry_dir: Path, relative: bool) -> str:
    """A group file's JSON with every child path as a bare file name (relative) or as entry_dir/name."""
    try:
        children = json.loads(text)["child_paths"]
        if not isinstance(children, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise KdtreeError(f"{where}: not a Triton group file (expected {{\"child_paths\": {{...}}}})") from None
    out = {}
    for child, path in children.items():
        name = Path(str(path)).name
        if not name or name != Path(name).name or name in (".", ".."):
            raise KdtreeError(f"{where}: child {child!r} has no file name ({path!r})")
        out[child] = name if relative else str(entry_dir / name)
    return json.dumps({"child_paths": out})


def pack(triton_dir: Path, dest: Path) -> int:
    """Copy the Triton cache at triton_dir into dest (an artifact's kernels/triton-<arch>), group files made
    relative; returns the number of entries.  An entry whose group file lists a file it lacks is skipped
    (an interrupted write: Triton would not use it either)."""
    n = 0
    for entry in sorted(p for p in triton_dir.iterdir() if p.is_dir()):
        files = _entry_files(entry)
        groups = {f.name: _rewrite_group(f.read_text(), f, entry, relative=True)
                  for f in files if f.name.startswith(GROUP_PREFIX)}
        names = {f.name for f in files}
        if any(set(json.loads(g)["child_paths"].values()) - names for g in groups.values()):
            continue
        out = dest / entry.name
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            if f.name in groups:
                (out / f.name).write_text(groups[f.name])
            else:
                shutil.copyfile(f, out / f.name)
        n += 1
    return n


def unpack(src: Path, triton_dir: Path) -> dict:
    """Make the entries under src (an artifact's kernels/triton-<arch>) present in the Triton cache at
    triton_dir: every file the destination lacks is written through a temporary name and renamed, group
    files last (Triton takes an entry as present once its group file is), so a concurrent reader or writer
    (another rank, a JIT compile) sees whole entries only.  src is only read.  Returns {entries, copied}."""
    entries = copied = 0
    for entry in sorted(p for p in src.iterdir() if p.is_dir()):
        out = triton_dir / entry.name
        out.mkdir(parents=True, exist_ok=True)
        files = _entry_files(entry)
        for f in sorted(files, key=lambda p: p.name.startswith(GROUP_PREFIX)):
            target = out / f.name
            if f.name.startswith(GROUP_PREFIX):
                data = _rewrite_group(f.read_text(), f, out, relative=False).encode()
                if target.is_file() and target.read_bytes() == data:
                    continue
            elif target.is_file():
                continue
            else:
                data = f.read_bytes()
            tmp = out / f".{f.name}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, target)
            copied += 1
        entries += 1
    return {"entries": entries, "copied": copied}


# ---- the warm-up (build side, on a CUDA device)

def warm_cases(budgets: tuple[int, ...], has_drafter: bool) -> list[dict]:
    """One case per subprocess: a decoding mode the runtime can be asked for.  With a drafter the last case is
    DDTree with budget auto, `kdtree run`'s default on CUDA: its graphs hold every bucket of AUTO_BUCKETS, and
    it measures the cost curve it then stores in ART/autotune/ (runtime/decode/autotune.py), so warm() runs it
    alone after the others, on an idle GPU; a fixed-budget case per bucket before it compiles the buckets'
    kernels in parallel."""
    cases = [{"spec": "none", "budget": 16}]
    if has_drafter:
        cases.append({"spec": "chain", "budget": 16})
        cases += [{"spec": "ddtree", "budget": b} for b in sorted(set(budgets) | set(AUTO_BUCKETS))]
        cases.append({"spec": "ddtree", "budget": "auto"})
    return cases


def warm(stage: Path, manifest: dict, budgets: tuple[int, ...], progress: bool = True) -> tuple[dict, Path]:
    """Decode the staged artifact on this machine's GPU with TRITON_CACHE_DIR on a scratch folder and pack
    that cache into stage/kernels/triton-<arch>.  Returns (manifest["triton_cache"], the packed folder).
    A temporary manifest.json is written for the subprocesses and removed after, with the integrity marks
    their loads left."""
    import torch
    import triton

    t0 = time.perf_counter()
    arch = device_facts(torch.device("cuda")).arch
    cases = warm_cases(budgets, manifest.get("drafter") is not None)
    (stage / "manifest.json").write_text(json.dumps({**manifest, "triton_cache": not_warmed("warm-up in progress")}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([repo] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if progress:
        sys.stderr.write(f"{'warming Triton':<18} {len(cases)} decoding mode(s) on {arch}\n")
    try:
        with tempfile.TemporaryDirectory(prefix="kdtree-triton-") as scratch:
            env["TRITON_CACHE_DIR"] = scratch

            def one(case: dict) -> subprocess.CompletedProcess:
                cmd = [sys.executable, "-m", "runtime.warm_kernels", "--art", str(stage), "--spec",
                       case["spec"], "--budget", str(case["budget"])]
                t1 = time.perf_counter()
                res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=repo, check=False)
                case["seconds"] = round(time.perf_counter() - t1, 1)  # the record's: where the warm-up's time goes
                return res

            # one process per mode, in parallel (Triton compiles on one core per process); budget auto after
            # them, alone, so that the cost curve it measures is not shared with the others' launches
            parallel = [c for c in cases if c["budget"] != "auto"]
            with ThreadPoolExecutor(len(parallel)) as pool:
                results = list(pool.map(one, parallel))
            results += [one(c) for c in cases[len(parallel):]]  # warm_cases puts auto last
            for case, res in zip(cases, results):
                if res.returncode:
                    last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
                    raise KdtreeError(f"Triton warm-up ({case['spec']}, budget {case['budget']}) failed: {last}")
            rel = cache_dir_name(arch)
            entries = pack(Path(scratch), stage / rel)
    finally:
        (stage / "manifest.json").unlink(missing_ok=True)
        shutil.rmtree(stage / ".verified", ignore_errors=True)
    record = {"warmed": True, "dir": rel, "arch": arch, "triton": triton.__version__, "entries": entries,
              "cases": cases, "prompt_lengths": list(PROMPT_LENGTHS), "new_tokens": NEW_TOKENS,
              "cost_curves": sorted(p.relative_to(stage).as_posix() for p in stage.glob("autotune/*/*.json")),
              "seconds": round(time.perf_counter() - t0, 1)}
    return record, stage / rel
