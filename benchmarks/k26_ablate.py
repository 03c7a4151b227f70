"""What each op class costs inside the captured K2.6 round: the AR step and a DDTree round timed with one class of
ops replaced by a stand-in that launches nothing (one rank, loaded once; timing only, the tokens are meaningless).

The per-kernel profile cannot say this: with programmatic dependent launch a kernel starts while its predecessor
runs and waits inside (griddepcontrol.wait), so its profiled duration includes that wait and the durations of a
step add up to more than the step.  The step's drop when a class is removed is what the class costs the round,
launch gaps and overlaps included.

Classes (the target's forward; the speculative ops are never touched, the drafter only where it calls the same
functions: under "gemm" its MLP GEMMs (layers.swiglu_mlp) and its logits (the target's lm_head) go too):
  attention  kdtree::tree_verify_mla (split + combine kernels): no-op, its output keeps the workspace's values
  mla_glue   the latent norms + rope, the q and v absorptions (layer_fusion's three MLA kernels): zeros stand in
  norms      the target's add_rms_norm after attention and after the MLP (2 per layer): the residual passes unchanged
  moe        the routed experts (route, gate_up, down, combine + shared down): the MoE input stands in for its output
  gemm       every dense GEMM of the target (cuBLAS or skinny_gemm; lm_head included): zeros stand in

    python3 benchmarks/k26_ablate.py --out DIR [--ablate none,attention,mla_glue,norms,moe,gemm] [--context 4096]
        [--budget 16] [--iters 10] [--layers N] [--source tiny-kimi --tp 1 --context 512]
Writes OUT/k26-ablate.json; prints each class's share of the step next to the step.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_rank_arguments, parse_combinations, print_table, write_result  # noqa: E402

_ZEROS: dict[tuple, object] = {}  # (shape, dtype, device) -> a zero tensor reused by every stand-in call


def _zeros(shape, dtype, device):
    import torch
    key = (tuple(shape), dtype, device)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros(key[0], dtype=dtype, device=device)
    return _ZEROS[key]


def _linear(x, w, c=None, out_dtype=None):
    return c if c is not None else _zeros((*x.shape[:-1], w.shape[0]), out_dtype or x.dtype, x.device)


def _patches(name: str) -> list[tuple[object, str, object]]:
    """(module, attribute, stand-in) of one class."""
    from runtime.model import attention, layers, moe, target
    return {
        "attention": [(attention, "tree_verify_mla", lambda *a, **k: None)],
        "mla_glue": [(attention, "mla_rope_kv", lambda *a, **k: None),
                     (attention, "mla_q_absorb", lambda q, w_uk, cos, sin, interleave: _zeros(
                         (q.shape[0], q.shape[1], w_uk.shape[2] + 2 * cos.shape[-1]), q.dtype, q.device)),
                     (attention, "mla_v_absorb", lambda o, w_uv: _zeros((o.shape[0], o.shape[1], w_uv.shape[1]),
                                                                        o.dtype, o.device))],
        "norms": [(target, "add_rms_norm", lambda x, a, w, eps: (x, x))],
        "moe": [(moe, "moe_w4a16", lambda x, *a, **k: x)],
        "gemm": [(m, "linear", _linear) for m in (attention, layers, moe, target)],
    }[name]


CLASSES = ("attention", "mla_glue", "norms", "moe", "gemm")


@contextmanager
def ablated(names: frozenset[str]):
    """The target's forward with the named classes replaced by their stand-ins (restored on exit)."""
    saved = []
    try:
        for name in names:
            for module, attr, stand_in in _patches(name):
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, stand_in)
        yield
    finally:
        for module, attr, real in reversed(saved):
            setattr(module, attr, real)
        _ZEROS.clear()


def parse_ablations(text: str) -> list[tuple[str, frozenset[str]]]:
    """"none,attention,moe+gemm" -> [("none", {}), ("attention", {...}), ("moe+gemm", {...})]; an unknown class
    is a ValueError naming it and the known ones."""
    return parse_combinations(text, CLASSES, "--ablate", "class", {"none": frozenset()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rank_arguments(ap)
    ap.add_argument("--ablate", default="none," + ",".join(CLASSES))
    ap.add_argument("--budget", type=int, default=16)
    a = ap.parse_args()
    settings = parse_ablations(a.ablate)

    import torch

    from runtime.bench_rank import load_rank_models, step_us
    from runtime.decode.graphs import GraphPool
    from runtime.decode.params import SpecConfig

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        raise SystemExit("k26_ablate: needs a CUDA device (it times captured CUDA graphs)")
    target, drafter, _, _ = load_rank_models(a.source, a.tp, 0, a.layers, 0, dev, True)
    pool = GraphPool(dev)
    specs = {"ar": SpecConfig("none", 1), f"ddtree{a.budget}": SpecConfig("ddtree", a.budget)}
    rows = []
    for name, names in settings:
        row = {"ablated": name}
        with ablated(names):
            for key, spec in specs.items():
                row[f"{key}_step_us"] = step_us(target, drafter, spec, a.context, a.iters, pool)
                torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    base = rows[0]
    for row in rows:
        for key in specs:
            row[f"{key}_share_us"] = round(base[f"{key}_step_us"] - row[f"{key}_step_us"], 1)
            row[f"{key}_share"] = round(row[f"{key}_share_us"] / base[f"{key}_step_us"], 3)
    extra = {"source": a.source, "tp": a.tp, "layers": target.cfg.num_layers, "context": a.context,
             "budget": a.budget, "iters": a.iters, "classes": __doc__.split("Classes")[1].split("\n\n")[0].strip(),
             "timing": "runtime/bench_rank.step_us: the whole step captured in a CUDA graph, replayed; share = the "
                       "first row's step minus this row's"}
    path = write_result("k26-ablate", rows, extra, a.out)
    print(f"wrote {path}")
    cols = ["ablated"] + [f"{k}_{c}" for k in specs for c in ("step_us", "share_us", "share")]
    print_table(rows, cols)


if __name__ == "__main__":
    main()
