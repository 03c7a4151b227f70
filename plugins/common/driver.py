"""Results of cuda-python driver calls (cuda.bindings.driver), checked in one place.

Each driver call returns (CUresult, *values); `checked` returns the values (None, the one value, or a tuple)
or raises `error` naming what failed and the CUresult, so a caller states only what it was doing."""

from __future__ import annotations

_PDL_REFUSED: set[int] = set()  # device indices where the driver or the bindings refused the PDL attribute once


def checked(cu, res, what: str, error: type[Exception] = RuntimeError):
    """The values of the driver result `res` (cu: the cuda.bindings.driver module), else
    error(f"{what} failed: <CUresult name>")."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise error(f"{what} failed: {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


class Functions:
    """The kernels of one loaded module (cu: cuda.bindings.driver, module: a CUmodule) by name, each looked up once,
    with its dynamic shared-memory ceiling raised where a launch asks for more than the 48 KB every kernel has.
    what names the module in errors."""

    def __init__(self, cu, module, what: str):
        self.cu, self.module, self.what = cu, module, what
        self._funcs: dict[str, object] = {}  # kernel name -> CUfunction
        self._smem: dict[str, int] = {}  # kernel name -> the dynamic shared memory granted above the default

    def get(self, name: str, smem: int = 0):
        """The CUfunction of kernel `name`, allowed `smem` bytes of dynamic shared memory; RuntimeError naming the
        module and the kernel where it is not in the module or the driver refuses the size."""
        func = self._funcs.get(name)
        if func is None:
            func = self._funcs[name] = checked(self.cu, self.cu.cuModuleGetFunction(self.module, name.encode()),
                                               f"{self.what}: cuModuleGetFunction {name}")
        if smem > 48 * 1024 and self._smem.get(name, 0) < smem:
            attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            checked(self.cu, self.cu.cuFuncSetAttribute(func, attr, smem),
                    f"{self.what}: cuFuncSetAttribute {name} (dynamic shared memory {smem} B)")
            self._smem[name] = smem
        return func


def pdl_refused(device_index: int) -> bool:
    """Whether a PDL launch on CUDA device `device_index` was refused before (launch goes plain there from then on)."""
    return device_index in _PDL_REFUSED


def launch(cu, func, grid: int | tuple[int, int], threads: int, smem: int, stream, args: tuple, types: tuple,
           pdl: bool, what: str, device_index: int = -1, cooperative: bool = False) -> bool:
    """One launch of the driver function `func` on `stream` (grid x 1 x 1, or gx x gy x 1, CTAs of `threads`) of CUDA
    device `device_index`; with pdl through cuLaunchKernelEx with programmatic stream serialization (the kernel must
    wait for its predecessor grid before reading anything: griddepcontrol.wait).  Returns whether it went with PDL:
    False when pdl was not asked, or was refused on this device by the driver or the bindings, now (this launch then
    goes plain) or before (recorded per device: every later launch there goes plain without asking).
    cooperative: a cooperative launch too (every CTA resident at once, as a grid-wide barrier needs), which has no
    plain form: a refusal is a RuntimeError naming `what`."""
    gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
    pdl = pdl and device_index not in _PDL_REFUSED
    if pdl or cooperative:
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
        config.sharedMemBytes, config.hStream = smem, stream
        ids = cu.CUlaunchAttributeID
        attrs = ([_attribute(cu, ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                             "programmaticStreamSerializationAllowed")] if pdl else []) \
            + ([_attribute(cu, ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, "cooperative")] if cooperative else [])
        config.attrs, config.numAttrs = attrs, len(attrs)
        try:
            err = cu.cuLaunchKernelEx(config, func, (args, types), 0)[0]
        except (TypeError, ValueError, RuntimeError, AttributeError):  # bindings without the Ex launch's types
            err = None
        if err == cu.CUresult.CUDA_SUCCESS:
            return pdl
        if cooperative:
            raise RuntimeError(f"{what} failed: cooperative cuLaunchKernelEx {getattr(err, 'name', err)}")
        _PDL_REFUSED.add(device_index)
    checked(cu, cu.cuLaunchKernel(func, gx, gy, 1, threads, 1, 1, smem, stream, (args, types), 0), what)
    return False


def _attribute(cu, attr_id, field: str):
    """A launch attribute `attr_id` with its value's `field` set to 1."""
    attr = cu.CUlaunchAttribute()
    attr.id = attr_id
    setattr(attr.value, field, 1)
    return attr
