"""Where a decode round's copy-like kernels come from: each one counted under the call site that launched it.

One rank of a preset with random weights drawn on the device (default: a TP8 rank of kimi-k2.6 at 4 layers, bf16),
its AR step and DDTree-16 round run eagerly (the captured graphs replay the same kernels) at a 4K cache under
torch.profiler with Python stacks.  A kernel is tied to the aten op that launched it (the profiler's correlation:
the op's `kernels`); the op's call site is the innermost frame of this repo among its parents (the profiler keeps
Python frames as parent events, not on the op).  On CPU (a dry run of the script) the aten copy ops are counted
instead of kernels.  Prints per round the sites by count; --out writes copy-sites.json.

    python3 benchmarks/copy_sites.py [--preset kimi-k2.6] [--layers 4] [--out DIR]     # on the GPU
    python3 benchmarks/copy_sites.py --preset tiny-kimi --device cpu                    # dry run
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.bench_rank import prime_session, rewind_session  # noqa: E402
from runtime.decode.params import SpecConfig  # noqa: E402
from runtime.decode.session import DecodeSession  # noqa: E402
from runtime.load.synthetic import draw_models  # noqa: E402
from runtime.parallel.solo import SoloRankComm  # noqa: E402

COPY_KERNELS = ("copy", "Memcpy", "memcpy", "CatArray", "index", "scatter", "gather", "elementwise_kernel<128")
COPY_OPS = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy", "aten::cat", "aten::index")
REPO_DIRS = ("runtime/", "plugins/")


def call_site(ev) -> str:
    """The innermost repo frames (up to 3) among the event's parents: 'file.py(line): function' each."""
    frames, p = [], ev.cpu_parent
    while p is not None and len(frames) < 3:
        if any(d in p.name for d in REPO_DIRS) and "copy_sites" not in p.name:
            frames.append(p.name.split("/")[-1] if "/" in p.name else p.name)
        p = p.cpu_parent
    return " <- ".join(frames) or "?"


def sites_of(prof, on_gpu: bool) -> collections.Counter:
    sites: collections.Counter[tuple[str, str]] = collections.Counter()
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        if on_gpu:
            for k in ev.kernels:
                if any(c in k.name for c in COPY_KERNELS):
                    sites[(k.name[:60], f"{ev.name} @ {call_site(ev)}")] += 1
        elif ev.name in COPY_OPS:
            sites[(ev.name, call_site(ev))] += 1
    return sites


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k2.6")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    comm = SoloRankComm(0, 8, dev) if a.preset == "kimi-k2.6" else None
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, drafter = draw_models(a.preset, comm, layers=a.layers, dtype=dtype, device=dev)
    doc = {"preset": a.preset, "layers": a.layers, "context": a.context, "device": str(dev), "rounds": {}}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                            else [])
    for spec in (SpecConfig.of("none", 16), SpecConfig.of("ddtree", 16)):
        sess = DecodeSession(target, drafter, spec, 1, a.context + 64 * 8 * 4)
        prime_session(sess, a.context)
        for _ in range(2):  # warm: Triton compiles, cuBLAS picks its kernels
            rewind_session(sess, a.context)
            sess.raw_step(True)
        rewind_session(sess, a.context)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities, with_stack=True) as prof:
            sess.raw_step(True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        sites = sites_of(prof, dev.type == "cuda")
        name = "ar" if spec.mode == "none" else f"ddtree-{spec.budget}"
        doc["rounds"][name] = [{"kernel": k, "site": s, "count": c} for (k, s), c in sites.most_common()]
        print(f"== {name}: {sum(sites.values())} copy-like {'kernels' if dev.type == 'cuda' else 'ops'} "
              f"({a.preset}, {a.layers} layers)")
        for (k, s), c in sites.most_common(25):
            print(f"{c:4d}  {k:<60}  {s}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "copy-sites.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
