"""plugins/common/op.py: kdtree ops register without custom_op's wrapper, so calling them imports no torch._dynamo
(1.7-2.8 s of a run's start), and keep the schema custom_op inferred."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import sys, torch
import plugins.layer_fusion, plugins.tree_accept.posterior
x, w = torch.randn(3, 8), torch.rand(8)
torch.ops.kdtree.rms_norm(x, w, 1e-6)
plugins.layer_fusion.silu_mul_op(torch.randn(2, 8), torch.bfloat16)
logits, out = torch.randn(3, 11), torch.empty(3, dtype=torch.int64)
torch.ops.kdtree.posterior(logits, True, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3), out)
assert out.tolist() == logits.argmax(-1).tolist()
print("torch._dynamo" in sys.modules)
"""


def test_op_calls_import_no_dynamo():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=str(REPO),
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["False"]


def test_schema_and_kernels():
    import plugins.kv_commit  # noqa: F401
    import plugins.layer_fusion
    from plugins.common.op import KdtreeOp

    assert isinstance(plugins.layer_fusion.rms_norm_op, KdtreeOp)
    assert str(torch.ops.kdtree.rms_norm.default._schema) == \
        "kdtree::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"
    schema = str(torch.ops.kdtree.kv_commit.default._schema)
    assert schema.startswith("kdtree::kv_commit(Tensor(a0!) cache, Tensor(a1!) cache_lens, Tensor scratch")
    assert schema.endswith("-> ()")
    assert plugins.layer_fusion.rms_norm_op.overload is torch.ops.kdtree.rms_norm.default
    with pytest.raises(ValueError, match="kdtree::rms_norm: register_kernel takes 'cuda'.*got 'cpu'"):
        plugins.layer_fusion.rms_norm_op.register_kernel("cpu")
    # fake kernels (torch.export traces with them): the registered one, and the None of an op that returns nothing
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.ops.kdtree.rms_norm(torch.empty(3, 8), torch.empty(8), 1e-6)
        i32 = dict(dtype=torch.int32)
        none = torch.ops.kdtree.kv_commit(torch.empty(2, 1, 16, 8), torch.zeros(1, **i32), torch.empty(2, 1, 4, 8),
                                          torch.zeros(1, 4, **i32), torch.zeros(1, **i32), None, None, True)
    assert y.shape == (3, 8) and none is None
