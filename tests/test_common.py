"""plugins/common: the device facts the launch heuristics read, and the flat byte workspace."""

from __future__ import annotations

import pytest
import torch

from plugins.common.device import DEFAULT_SMS, RATES, device_facts, facts_for
from plugins.common.workspace import ALIGN, carve, workspace_bytes


def test_device_facts_without_cuda_are_the_h200s():
    for dev in ("cpu", torch.device("meta"), None):
        f = device_facts(dev)
        assert f.sms == DEFAULT_SMS == 132 and f.capability == (9, 0)
        assert f.bytes_per_flop == pytest.approx(4.25e12 / 687e12)


def test_device_facts_table():
    blackwell = facts_for(188, (12, 0))  # RTX PRO 6000 Blackwell: ~1.8 TB/s over ~500 TFLOP/s
    assert blackwell.sms == 188 and blackwell.bytes_per_flop == pytest.approx(1.792e12 / 500e12)
    assert facts_for(100, (8, 6)).bytes_per_flop == pytest.approx(RATES[(9, 0)][0] / RATES[(9, 0)][1])  # default row


def test_workspace_carves_aligned_views_and_names_a_short_buffer():
    specs = [((3,), torch.int32), ((2, 5), torch.float64), ((7,), torch.bfloat16)]
    need = workspace_bytes(specs)
    assert need == 3 * ALIGN
    buf = torch.zeros(need + 100, dtype=torch.uint8)
    a, b, c = carve(buf, specs, "op", "call")
    assert (a.shape, b.shape, c.shape) == ((3,), (2, 5), (7,)) and b.dtype == torch.float64
    assert [t.data_ptr() - buf.data_ptr() for t in (a, b, c)] == [0, ALIGN, 2 * ALIGN]
    b.fill_(1.5)
    assert torch.equal(buf[ALIGN:ALIGN + 80].view(torch.float64), torch.full((10,), 1.5, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"op: workspace holds {need - 1} bytes, this call \(b 2\) needs {need}"):
        carve(buf[:need - 1], specs, "op", "b 2")
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        carve(torch.zeros(need, dtype=torch.int32), specs, "op", "b 2")
