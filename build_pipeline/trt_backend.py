"""Backend `tensorrt`: each rank's ONNX graphs -> serialized TensorRT engines.

Needs TensorRT >= 10.9 (for `tensorrt.plugin`, the Python plugin registration) and a GPU; neither can
be installed on the build machines here, so this path is written against the documented API and is
untested: `require_tensorrt` fails with one clear line instead.  The kdtree:: custom-op nodes are
served by plugins registered from `plugins/<op>/trt_plugin.py` (imported here when present).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from core.errors import KdtreeError

MIN_VERSION = (10, 9)
PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def require_tensorrt():
    """The tensorrt module, or KdtreeError('--backend tensorrt needs TensorRT >= 10.9 and a GPU: <why>')."""
    prefix = "--backend tensorrt needs TensorRT >= 10.9 and a GPU: "
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise KdtreeError(prefix + f"`import tensorrt` failed ({exc})") from None
    version = tuple(int(v) for v in trt.__version__.split(".")[:2])
    if version < MIN_VERSION:
        raise KdtreeError(prefix + f"found TensorRT {trt.__version__}")
    import torch

    if not torch.cuda.is_available():
        raise KdtreeError(prefix + "no CUDA device is available")
    return trt


def build_engines(stage: Path, graphs: dict[int, list[str]]) -> dict[int, list[str]]:
    """Build engines/rank{r}/<graph>.engine from each rank's graphs; returns relative paths per rank."""
    trt = require_tensorrt()
    for p in sorted(PLUGINS.glob("*/trt_plugin.py")):
        importlib.import_module(f"plugins.{p.parent.name}.trt_plugin")  # registers through tensorrt.plugin
    logger = trt.Logger(trt.Logger.WARNING)
    out: dict[int, list[str]] = {}
    for rank, paths in graphs.items():
        rel_dir = Path("engines") / f"rank{rank}"
        (stage / rel_dir).mkdir(parents=True, exist_ok=True)
        out[rank] = []
        for rel in paths:
            builder = trt.Builder(logger)
            network = builder.create_network(0)
            parser = trt.OnnxParser(network, logger)
            if not parser.parse_from_file(str(stage / rel)):
                errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
                raise KdtreeError(f"TensorRT could not parse {rel}: {errors}")
            config = builder.create_builder_config()
            config.set_flag(trt.BuilderFlag.BF16)
            engine = builder.build_serialized_network(network, config)
            if engine is None:
                raise KdtreeError(f"TensorRT failed to build an engine from {rel}")
            target = rel_dir / (Path(rel).stem + ".engine")
            (stage / target).write_bytes(bytes(engine))
            out[rank].append(target.as_posix())
    return out
