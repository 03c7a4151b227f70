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
