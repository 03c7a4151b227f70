"""Results of cuda-python driver calls (cuda.bindings.driver), checked in one place.

Each driver call returns (CUresult, *values); `checked` returns the values (None, the one value, or a tuple)
or raises `error` naming what failed and the CUresult, so a caller states only what it was doing."""

from __future__ import annotations


def checked(cu, res, what: str, error: type[Exception] = RuntimeError):
    """The values of the driver result `res` (cu: the cuda.bindings.driver module), else
    error(f"{what} failed: <CUresult name>")."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise error(f"{what} failed: {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None
