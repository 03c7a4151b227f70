"""`kdtree run ART` on a GPU: wall seconds from the process start to the first generated token.

Each run is a fresh `python -m runtime.cli run ART --device cuda` with an empty TRITON_CACHE_DIR, so the
kernels come from the artifact's kernels/triton-<arch>/ (build_pipeline/kernel_cache.py) or are compiled.
Three runs, in this order:
  first  a fresh PYTHONPYCACHEPREFIX: Python compiles the bytecode of every module it imports (a user's first run)
  cold   the bytecode kept, the page cache emptied of the artifact, the venv's packages, the repo and the bytecode
         (/proc/sys/vm/drop_caches where writable, else posix_fadvise(DONTNEED) on those files)
  warm   the same again with everything in the page cache: the issue's "<= 5 s with a warm page cache"
A row: first_token_s (the first byte on stdout: tokens stream there, progress and stats go to stderr),
total_s, new_triton_entries (Triton cache folders beyond the artifact's: a compiled kernel or launcher), and
from the run's stats line: load_s (Engine.load), prefill_s, capture_s (the decode graph, captured after the first
token is out) and decode_s.  Writes OUT/startup.json; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def evict(paths: list[Path]) -> str:
    """Empty the page cache of the files under paths; returns the method used."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for root in paths:
        for p in ([root] if root.is_file() else root.rglob("*") if root.is_dir() else []):
            try:
                if p.is_file() and not p.is_symlink():
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
            except OSError:
                continue
    return "posix_fadvise"


def one_run(art: Path, pycache: Path, prompt_ids: str, new_tokens: int, device: str,
            profile: Path | None = None) -> dict:
    """One fresh `kdtree run ART`; with profile, under cProfile (stats written there; its times are inflated)."""
    with tempfile.TemporaryDirectory(prefix="kdtree-triton-") as triton_dir:
        # a user's Python keeps bytecode: a PYTHONDONTWRITEBYTECODE of the calling shell would make every run "first"
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONDONTWRITEBYTECODE")}
        env.update(TRITON_CACHE_DIR=triton_dir, PYTHONPYCACHEPREFIX=str(pycache), PYTHONPATH=str(REPO),
                   PYTHONUNBUFFERED="1")
        prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
        cmd = [sys.executable, *prof, "-m", "runtime.cli", "run", str(art), "--device", device, "--prompt-ids",
               prompt_ids, "--max-new-tokens", str(new_tokens)]
        errfile = Path(triton_dir) / "stderr.txt"  # a file, not a pipe: a full pipe would stall the run
        with open(errfile, "wb") as errf:
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, env=env, cwd=str(REPO))
            first = os.read(proc.stdout.fileno(), 1)
            first_s = time.perf_counter() - t0
            proc.communicate(timeout=600)
            total_s = time.perf_counter() - t0
        err = errfile.read_text(errors="replace")
        entries = sum(1 for p in Path(triton_dir).iterdir() if p.is_dir())
    if proc.returncode:
        raise RuntimeError(f"kdtree run failed (rc {proc.returncode}): {err[-1500:]}")
    stats = {}
    for line in reversed(err.splitlines()):
        if line.startswith("{"):
            stats = json.loads(line)
            break
    return {"first_token_s": round(first_s, 2) if first else None, "total_s": round(total_s, 2),
            "triton_entries": entries, "prefill_s": stats.get("prefill_s"), "decode_s": stats.get("decode_s"),
            "load_s": stats.get("load_s"), "capture_s": stats.get("capture_s"), "new_tokens": stats.get("new_tokens"),
            "spec": stats.get("spec"),
            "warned": "KernelCacheWarning" in err}


def profile_run(art: Path, pycache: Path, out: Path, prompt_ids: str, device: str) -> None:
    """A warm run of one new token under cProfile; the top functions by cumulative and own time to a text file."""
    import io
    import pstats

    with tempfile.TemporaryDirectory(prefix="kdtree-prof-") as tmp:
        stats_file = Path(tmp) / "run.prof"
        row = one_run(art, pycache, prompt_ids, 1, device, profile=stats_file)
        buf = io.StringIO()
        st = pstats.Stats(str(stats_file), stream=buf)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(40)
    (out / "startup-profile.txt").write_text(f"warm run under cProfile: {row}\n{buf.getvalue()}")
    print(f"wrote {out / 'startup-profile.txt'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--art", required=True, help="a `kdtree build` artifact (built with the warm-up)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8,9,10,11")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (to try the script)")
    ap.add_argument("--profile", action="store_true",
                    help="then one more warm run under cProfile: OUT/startup-profile.txt (where the seconds go)")
    a = ap.parse_args()
    art = Path(a.art)
    manifest = json.loads((art / "manifest.json").read_text())
    shipped = manifest.get("triton_cache", {}).get("entries", 0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kdtree-pycache-") as pycache:
        method = None
        for case in ("first", "cold", "warm"):
            if case == "cold":
                drivers = [*Path("/usr/lib/x86_64-linux-gnu").glob("libcuda*"),
                           *Path("/usr/lib/x86_64-linux-gnu").glob("libnvidia*")]
                method = evict([art, REPO, Path(pycache), *map(Path, site.getsitepackages()), *drivers])
            row = {"run": case, **one_run(art, Path(pycache), a.prompt_ids, a.max_new_tokens, a.device)}
            row["new_triton_entries"] = row.pop("triton_entries") - shipped
            rows.append(row)
        extra = {"artifact": str(art), "triton_cache": manifest.get("triton_cache"), "evict": method,
                 "command": f"python -m runtime.cli run ART --device {a.device} --prompt-ids ... --max-new-tokens "
                            f"{a.max_new_tokens}", "goal_first_token_s": 5.0}
        path = write_result("startup", rows, extra, a.out)
        if a.profile:
            profile_run(art, Path(pycache), path.parent, a.prompt_ids, a.device)
    print(f"wrote {path}; page cache emptied by {method}; artifact ships {shipped} Triton cache entries")
    print_table(rows, ["run", "first_token_s", "total_s", "new_triton_entries", "load_s", "prefill_s", "capture_s",
                       "decode_s", "spec", "warned"])


if __name__ == "__main__":
    main()
