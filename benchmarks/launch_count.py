"""A decode round's kernel launches, modelled on the CPU: every op the round dispatches, by call site.

The GPU profile (benchmarks/layer_fusion.py, k26_rank.py) is the measurement; this is the model used to find
and remove launches when no GPU is lent, and to predict a change's count before it runs on one.  One rank of a
preset with random weights (bf16, CPU) runs one eager AR step and one DDTree round with every CUDA branch of the
Python code taken: `Tensor.is_cuda` reads True for the round, so the fused kernels of plugins/layer_fusion and the
fp32-output GEMMs (aten::mm.dtype, computed here by upcasting) are what dispatches.  A
TorchDispatchMode then counts, per op and per call site (the innermost frames of this repository):

- an aten op that writes memory counts one kernel (views, empty allocations and metadata count none); ops that
  read a value back to the host (item, nonzero, ...) are listed apart: a captured round must have none;
- a kdtree:: op counts the kernels its CUDA launcher starts (KDTREE_LAUNCHES; the launchers' grids, checked
  against the H200 profile of layer-fusion.json).

What this does not see: cuBLAS's split-K reduce kernels and the graph's memcpy nodes (cuBLAS picks them per shape
on the device), and launches a CUDA-only path makes outside the ops above.  Compare with the profile's count
when one exists (--compare prints the last measured counts beside the model's).

    python3 benchmarks/launch_count.py                                   # tiny-kimi, AR + DDTree-16 (seconds)
    python3 benchmarks/launch_count.py --models tiny-kimi,kimi-k2.6 --out benchmarks/results   # + a TP8 rank (~4 min)
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.bench_rank import prime_session, rewind_session  # noqa: E402
from runtime.decode.params import SpecConfig  # noqa: E402
from runtime.decode.session import DecodeSession  # noqa: E402
from runtime.load.synthetic import draw_models  # noqa: E402
from runtime.parallel.solo import SoloRankComm  # noqa: E402

aten = torch.ops.aten

# kernels each kdtree:: op's CUDA launcher starts (read from the launchers; the H200 profile agrees)
KDTREE_LAUNCHES = {
    "tree_verify_mla": 2,  # split + combine (plugins/tree_verify_mla/launcher.py)
    "moe_w4a16": 4,  # route, gate_up, down, combine (plugins/moe_w4a16/launch_v3.py)
    "tree_build": 8,  # lse partials, 4 radix passes, gather, sort, tree (plugins/tree_build/topk_kernel.py)
    "kv_commit": 2,  # copy rows, advance lens (plugins/kv_commit/kernel.py; 1 with advance=False)
    "drafter_attention": 2,  # split + combine (plugins/drafter_attention/kernel.py; 1 with one split)
    "skinny_gemm": 1,  # one kernel (plugins/skinny_gemm/launch.py; one-token GEMMs, runtime/model/layers.py)
}


def launches(op: str, args: tuple) -> int:
    """Kernels a kdtree:: op's launcher starts for these arguments."""
    if op == "kv_commit" and args[-1] is False:  # advance=False: the caller's round_emit advances the lengths
        return 1
    return KDTREE_LAUNCHES.get(op, 1)


# the model against the H200's count, once: this script run on a worktree of d276429 (the commit of the last tiny
# profile; rename prime_session / rewind_session to _prime / _rewind there) and that profile (layer-fusion.json)
CALIBRATION = {"commit": "d276429", "tiny-kimi model": {"ar": 120, "ddtree-16": 224},
               "tiny-kimi H200 profile": {"ar": 138, "ddtree-16": 259},
               "missing from the model": "cuBLAS split-K reduce kernels, the graph's memcpy nodes"}
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.lift_fresh.default, aten._unsafe_view.default, aten.sym_size.int,
             aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default, aten.is_same_size.default}
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.item.default, aten.equal.default}
REPO_DIRS = tuple(str(ROOT / d) for d in ("runtime", "plugins", "core"))


def call_site(depth: int = 2) -> str:
    """The innermost `depth` frames of this repository's runtime / plugins / core: 'file.py:line fn' each."""
    frames, f = [], sys._getframe(2)
    while f is not None and len(frames) < depth:
        name = f.f_code.co_filename
        if name.startswith(REPO_DIRS):
            frames.append(f"{Path(name).name}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return " <- ".join(frames) or "?"


class LaunchCount(TorchDispatchMode):
    """Counts the kernels of every op dispatched under it: (op, call site) -> kernels; host reads apart."""

    def __init__(self, depth: int = 2, stub: tuple[str, ...] = ()):
        """stub: ops (qualified names) counted but not run, their first argument's zeros returned (an op whose
        values do not steer the round, e.g. the MoE, whose CPU reference is slow at K2.6 size)."""
        super().__init__()
        self.depth, self.stub = depth, stub
        self.kernels: collections.Counter[tuple[str, str]] = collections.Counter()
        self.host_reads: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if func in HOST_READS:
            self.host_reads[(name, call_site(self.depth))] += 1
        elif name.startswith("kdtree::"):
            self.kernels[(name, call_site(self.depth))] += launches(name.split("::")[1], args)
        elif func not in NO_KERNEL and not func.is_view:
            self.kernels[(name, call_site(self.depth))] += 1
        if name in self.stub:
            return torch.zeros_like(args[0])
        if func in (aten.mm.dtype, aten.bmm.dtype):  # the CUDA-only fp32-output GEMMs: the same values here
            a, b = args[0], args[1]
            return (torch.mm if func is aten.mm.dtype else torch.bmm)(a.float(), b.float()).to(args[2])
        return func(*args, **kwargs)

    def total(self) -> int:
        return sum(self.kernels.values())

    def by_op(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for (op, _), n in self.kernels.items():
            out[op] += n
        return out


@contextmanager
def cuda_branches():
    """Every `x.is_cuda` of the Python code reads True, and the fp32-output GEMMs count as available."""
    from runtime.model import layers
    saved = (torch.Tensor.__dict__.get("is_cuda"), layers._MM_OUT_DTYPE)
    torch.Tensor.is_cuda = property(lambda self: True)
    layers._MM_OUT_DTYPE = True
    try:
        yield
    finally:
        if saved[0] is None:
            del torch.Tensor.is_cuda
        else:
            torch.Tensor.is_cuda = saved[0]
        layers._MM_OUT_DTYPE = saved[1]


def count_round(target, drafter, mode: str, budget: int, context: int, depth: int = 2,
                stub: tuple[str, ...] = ()) -> LaunchCount:
    """One eager round (the step a graph captures) after a warm one, counted."""
    spec = SpecConfig.of(mode, budget)
    sess = DecodeSession(target, drafter, spec, 1, context + 64 * 8 * 4)
    prime_session(sess, context)
    with cuda_branches():
        with LaunchCount(depth, stub):  # warm (first-call allocations), not kept
            sess.raw_step(True)
        rewind_session(sess, context)
        counter = LaunchCount(depth, stub)
        with counter:
            sess.raw_step(True)
    return counter


def count_preset(preset: str, layers: int | None, context: int, budget: int, depth: int) -> dict:
    comm = SoloRankComm(0, 8, torch.device("cpu")) if preset == "kimi-k2.6" else None
    target, drafter = draw_models(preset, comm, layers=layers, dtype=torch.bfloat16, device="cpu")
    stub = ("kdtree::moe_w4a16",) if preset == "kimi-k2.6" else ()  # 384 experts' CPU reference: minutes a call
    out = {"layers": target.cfg.num_layers, "stubbed": list(stub), "rounds": {}}
    for mode, name in (("none", "ar"), ("ddtree", f"ddtree-{budget}")):
        c = count_round(target, drafter, mode, budget, context, depth, stub)
        out["rounds"][name] = {"kernels": c.total(), "by_op": dict(c.by_op().most_common()),
                               "sites": [{"op": op, "site": s, "kernels": n} for (op, s), n in c.kernels.most_common()],
                               "host_reads": [{"op": op, "site": s, "count": n}
                                              for (op, s), n in c.host_reads.most_common()]}
    return out


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _print(name: str, res: dict, sites: int) -> None:
    for rnd, r in res["rounds"].items():
        print(f"== {name} {rnd}: {r['kernels']} kernels ({res['layers']} layers), host reads: "
              f"{sum(h['count'] for h in r['host_reads'])}")
        for s in r["sites"][:sites]:
            print(f"{s['kernels']:4d}  {s['op']:<34} {s['site']}")
        for h in r["host_reads"]:
            print(f"HOST {h['count']:3d}  {h['op']:<30} {h['site']}")


def count_model(preset: str, context: int, budget: int, depth: int, sites: int) -> dict:
    """A preset's rounds at its own depth; kimi-k2.6 (61 layers, too slow to run on a CPU at full depth) at 2 and 3
    layers (layer 0 dense, the rest MoE), the MoE layer's increment extrapolated to the full depth."""
    if preset != "kimi-k2.6":
        res = count_preset(preset, None, context, budget, depth)
        _print(preset, res, sites)
        res["kernels_per_layer"] = {k: round(r["kernels"] / res["layers"], 1) for k, r in res["rounds"].items()}
        return res
    two, three = (count_preset(preset, n, context, budget, depth) for n in (2, 3))
    _print(f"{preset} (3 layers)", three, sites)
    full = 61
    out = {"layers_counted": [2, 3], "full_layers": full, "stubbed": three["stubbed"], "rounds": three["rounds"],
           "per_moe_layer": {}, "extrapolated": {}}
    for k in three["rounds"]:
        per = three["rounds"][k]["kernels"] - two["rounds"][k]["kernels"]
        total = two["rounds"][k]["kernels"] + (full - 2) * per
        out["per_moe_layer"][k] = per
        out["extrapolated"][k] = {"kernels": total, "kernels_per_layer": round(total / full, 1)}
        print(f"{preset} {k}: {per} kernels per MoE layer; {total} at {full} layers ({total / full:.1f} per layer)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny-kimi", help="presets, comma-separated (kimi-k2.6: counted at 2 and "
                                                           "3 layers, extrapolated to 61)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2, help="call-site frames kept per op")
    ap.add_argument("--sites", type=int, default=25, help="call sites printed per round")
    ap.add_argument("--out", default=None, help="folder for launch-count.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    doc = {"benchmark": "launch-count", "kind": "model (CPU dispatch count), not a GPU measurement",
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git_commit": _git_commit(),
           "context": a.context, "budget": a.budget, "torch": torch.__version__, "kdtree_launches": KDTREE_LAUNCHES,
           "calibration": CALIBRATION,
           "models": {m: count_model(m, a.context, a.budget, a.depth, a.sites) for m in a.models.split(",") if m}}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "launch-count.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
