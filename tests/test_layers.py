"""The package layers, checked from the source: no import cycle, and no module importing from a layer
above its own (every import counts, module level or inside a function).

Layers, lowest first (a module may import its own layer and the ones below):
  core                     config, safetensors, name table, loader, quant formats, plan, tokenizer, errors
  plugins.common           what several ops share (bitmask, precision, packed keys, device properties, rng)
  plugins.<op>             one custom op; imports core and plugins.common only, never another op
  build_pipeline           `kdtree build`: shards, export, kernels, cache
  runtime.parallel         Comm, rank processes
  runtime.model            weights, layers, attention, MoE, caches, target and drafter forward
  runtime.load             the one load_models: checkpoint -> build cache -> artifact -> weights
  runtime.decode           params, stats, prefill, the static round, the session loop, graphs
  runtime.engine           the Engine front door (one rank or many)
  runtime.serve            `kdtree serve`: the OpenAI-compatible server over the Engine
  runtime (cli, bench)     the command line
  training                 the demo pair's recipe (corpus, tokenizer, training, export); nothing imports it
  benchmarks, tests        may import anything
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "plugins", "build_pipeline", "runtime", "training")
LAYERS = ("core", "plugins.common", "plugins.*", "build_pipeline", "runtime.parallel", "runtime.model",
          "runtime.load", "runtime.decode", "runtime.engine", "runtime.serve", "runtime", "training")


def layer_of(module: str) -> tuple[int, str]:
    """(rank, name) of a module's layer; plugins.<op> layers are distinct per op at one rank."""
    parts = module.split(".")
    if parts[0] == "plugins":
        if len(parts) == 1:
            return LAYERS.index("plugins.common"), "plugins"
        if parts[1] in ("common",):
            return LAYERS.index("plugins.common"), "plugins.common"
        return LAYERS.index("plugins.*"), "plugins." + parts[1]
    if parts[0] == "runtime" and len(parts) > 1 and "runtime." + parts[1] in LAYERS:
        return LAYERS.index("runtime." + parts[1]), "runtime." + parts[1]
    return LAYERS.index(parts[0]), parts[0]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (resolved to the longest known module name)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n] if n in stack else [m, n])
            elif state.get(n) is None:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_from_a_layer_above():
    bad = []
    for m, deps in sorted(graph().items()):
        rank, name = layer_of(m)
        for d in sorted(deps):
            d_rank, d_name = layer_of(d)
            if d_rank > rank or (d_rank == rank and name.startswith("plugins.") and d_name != name
                                 and name != "plugins.common"):
                bad.append(f"{m} ({name}) imports {d} ({d_name})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_layer_table_covers_every_module():
    for m in modules():
        layer_of(m)  # raises ValueError for a module outside every layer
