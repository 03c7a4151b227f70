"""Run a kernel test module as a script under Triton's interpreter (TRITON_INTERPRET=1 is read when triton is
imported, so it takes a fresh process): the module prints its results as JSON on its last stdout line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def interpreted(module_file: str, *args: str, timeout: int = 600):
    """`python module_file --interpreter *args` with TRITON_INTERPRET=1 and the repo on the path; its JSON."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, module_file, "--interpreter", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreter_shims() -> None:
    """Two gaps of Triton 3.6's interpreter, patched in the worker only (the GPU path never sees
    them): numpy >= 2.3 refuses int() of the 1-element arrays the interpreter uses for loaded
    scalars (loop bounds read from memory), and its dot multiplies bf16 as raw uint16 bits."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    patch_tensor = ti._patch_lang_tensor

    def _patch(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = _patch
    create_dot = ti.InterpreterBuilder.create_dot

    def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def up(x):
            if x.dtype.scalar != tl.bfloat16:
                return x
            return ti.TensorHandle(ti._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32),
                                   tl.float32)
        return create_dot(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    ti.InterpreterBuilder.create_dot = _dot
