"""plugins/common: the device facts the launch heuristics read, and the flat byte workspace."""

from __future__ import annotations

import pytest
import torch

from plugins.common import driver
from plugins.common.device import DEFAULT_SMS, RATES, device_facts, facts_for
from plugins.common.workspace import ALIGN, carve, workspace_bytes


def test_device_facts_without_cuda_are_the_h200s():
    for dev in ("cpu", torch.device("meta"), None):
        f = device_facts(dev)
        assert f.sms == DEFAULT_SMS == 132 and f.capability == (9, 0)
        assert f.bytes_per_flop == pytest.approx(4.25e12 / 687e12)


def test_copy_rate_without_cuda_is_the_h200s_and_the_benchmarks_divide_by_it(monkeypatch):
    from benchmarks import common
    from plugins.common.device import copy_bytes_per_s
    for dev in ("cpu", torch.device("meta"), None):
        assert copy_bytes_per_s(dev) == RATES[(9, 0)][0] == common.HBM_BYTES_PER_S
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert common.roofline_us(4.25e6) == pytest.approx(1.0)  # 4.25 MB at 4.25 TB/s
    assert common.roofline_us(0.0, 687e6) == pytest.approx(1.0)  # or the tensor rate's floor


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


class _FakeDriver:
    """The few cuda.bindings.driver names plugins/common/driver.launch uses; cuLaunchKernelEx refuses when told to."""

    class CUresult:
        CUDA_SUCCESS, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_NOT_SUPPORTED = 0, 500, 801

    class CUlaunchAttributeID:
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
        CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2

    class _Value:
        programmaticStreamSerializationAllowed = 0
        cooperative = 0

    class CUlaunchAttribute:
        def __init__(self):
            self.value = _FakeDriver._Value()

    class CUlaunchConfig:
        pass

    def __init__(self, refuse: bool):
        self.refuse, self.calls, self.attrs = refuse, [], []

    def cuLaunchKernelEx(self, config, func, args, extra):
        self.calls.append("ex")
        self.attrs.append(sorted(a.id for a in config.attrs[:config.numAttrs]))
        return (self.CUresult.CUDA_ERROR_NOT_SUPPORTED if self.refuse else self.CUresult.CUDA_SUCCESS,)

    def cuLaunchKernel(self, *a):
        self.calls.append("plain")
        return (self.CUresult.CUDA_SUCCESS,)

    class CUfunction_attribute:
        CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def cuModuleGetFunction(self, module, name):
        self.calls.append(("get", name.decode()))
        found = name.decode() in module
        return (self.CUresult.CUDA_SUCCESS if found else self.CUresult.CUDA_ERROR_NOT_FOUND, "f_" + name.decode())

    def cuFuncSetAttribute(self, func, attr, value):
        self.calls.append(("smem", func, value))
        return (self.CUresult.CUDA_ERROR_NOT_SUPPORTED if value > 227 * 1024 else self.CUresult.CUDA_SUCCESS,)


def test_a_cooperative_launch_carries_its_attribute_and_a_refusal_raises(monkeypatch):
    """driver.launch(cooperative=True): cuLaunchKernelEx with the cooperative attribute (and PDL's where asked); it has
    no plain form, so a refused one raises naming the launch, and PDL is not marked refused by it."""
    monkeypatch.setattr(driver, "_PDL_REFUSED", set())
    ok = _FakeDriver(refuse=False)
    assert not driver.launch(ok, None, 4, 128, 0, None, (), (), False, "test", 0, cooperative=True)
    assert driver.launch(ok, None, 4, 128, 0, None, (), (), True, "test", 0, cooperative=True)
    assert ok.calls == ["ex", "ex"] and ok.attrs == [[2], [2, 6]]
    refuses = _FakeDriver(refuse=True)
    with pytest.raises(RuntimeError, match="barrier: failed: cooperative"):
        driver.launch(refuses, None, 4, 128, 0, None, (), (), True, "barrier:", 1, cooperative=True)
    assert refuses.calls == ["ex"] and not driver.pdl_refused(1)


def test_a_refused_pdl_launch_goes_plain_and_is_remembered_per_device(monkeypatch):
    monkeypatch.setattr(driver, "_PDL_REFUSED", set())
    ok = _FakeDriver(refuse=False)
    assert driver.launch(ok, None, 4, 128, 0, None, (), (), True, "test", 0) and ok.calls == ["ex"]
    refuses = _FakeDriver(refuse=True)
    assert not driver.launch(refuses, None, (4, 2), 128, 0, None, (), (), True, "test", 1)
    assert refuses.calls == ["ex", "plain"] and driver.pdl_refused(1) and not driver.pdl_refused(0)
    assert not driver.launch(refuses, None, 4, 128, 0, None, (), (), True, "test", 1)  # not asked again there
    assert refuses.calls == ["ex", "plain", "plain"]
    assert driver.launch(ok, None, 4, 128, 0, None, (), (), True, "test", 0)  # device 0 keeps it
    assert not driver.launch(ok, None, 4, 128, 0, None, (), (), False, "test", 0) and ok.calls[-1] == "plain"


def test_a_module_s_functions_are_looked_up_once_and_get_the_shared_memory_they_ask_above_48_kb():
    """driver.Functions: one cuModuleGetFunction a kernel; the dynamic shared-memory ceiling set only above the 48 KB
    default and only when a launch asks for more than was granted; errors name the module, the kernel and the size."""
    cu = _FakeDriver(refuse=False)
    fns = driver.Functions(cu, {"k1", "k2"}, "mod (cache)")
    assert fns.get("k1") == "f_k1" and fns.get("k1", 48 * 1024) == "f_k1"
    assert cu.calls == [("get", "k1")]
    fns.get("k1", 100_000)
    fns.get("k1", 60_000)  # below what was granted: no call
    fns.get("k1", 120_000)
    fns.get("k2", 100_000)
    assert cu.calls == [("get", "k1"), ("smem", "f_k1", 100_000), ("smem", "f_k1", 120_000), ("get", "k2"),
                        ("smem", "f_k2", 100_000)]
    with pytest.raises(RuntimeError, match=r"mod \(cache\): cuModuleGetFunction k3 failed"):
        fns.get("k3")
    with pytest.raises(RuntimeError, match=r"cuFuncSetAttribute k2 \(dynamic shared memory 300000 B\) failed"):
        fns.get("k2", 300_000)
