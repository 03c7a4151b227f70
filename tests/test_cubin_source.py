"""plugins/common/cubin.source_text: a CUDA source's quoted includes of plugins/ headers inlined (what NVRTC compiles
without an include path and what the kernel cache key hashes), escapes refused, and the inlined text compiling to the
same SASS as nvcc's own include of the header (no GPU)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from plugins.common import cubin

TREE_VERIFY = cubin.PLUGINS / "tree_verify_mla" / "tree_verify_wgmma.cu"
HEADER = cubin.PLUGINS / "common" / "cuda" / "hopper.cuh"


def test_the_kernel_sources_include_the_shared_header_and_get_it_inlined():
    others = ("skinny_gemm/skinny_wgmma.cu", "skinny_gemm/skinny_gemm.cu", "moe_w4a16/moe_v3.cu",
              "moe_w4a16/moe_wgmma.cu")
    for source in (TREE_VERIFY, *(cubin.PLUGINS / f for f in others)):
        assert b'#include "../common/cuda/hopper.cuh"' in source.read_bytes()
        text = cubin.source_text(source)
        # no include left active (moe_w4a16's fragment_ops.cuh includes hopper.cuh again: left as a comment)
        assert not re.search(rb"^[ \t]*#[ \t]*include", text, re.MULTILINE) and HEADER.read_bytes() in text
        assert text.count(b"__device__ __forceinline__ void pdl_wait()") == 1


def test_includes_inline_once_and_refuse_paths_outside_plugins(tmp_path, monkeypatch):
    root = tmp_path / "plugins"
    (root / "op").mkdir(parents=True)
    (root / "common").mkdir()
    (root / "common" / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (root / "common" / "b.cuh").write_text("#pragma once\nint b;\n")
    src = root / "op" / "k.cu"
    src.write_text('#include "../common/a.cuh"\n#include "../common/b.cuh"  // again\nint k;\n')
    monkeypatch.setattr(cubin, "PLUGINS", root.resolve())
    text = cubin.source_text(src).decode()
    assert text.count("int b;") == 1 and text.index("int b;") < text.index("int a;") < text.index("int k;")
    assert '// #include "../common/b.cuh"' in text  # the second include left as a comment
    (tmp_path / "outside.cuh").write_text("int x;\n")
    src.write_text('#include "../../outside.cuh"\n')
    with pytest.raises(cubin.CubinUnavailable, match=r'k\.cu: #include "\.\./\.\./outside\.cuh" is not a file under'):
        cubin.source_text(src)
    src.write_text('#include "../common/missing.cuh"\n')
    with pytest.raises(cubin.CubinUnavailable, match="missing.cuh"):
        cubin.source_text(src)


def test_a_header_change_changes_the_cache_key(tmp_path, monkeypatch):
    root = tmp_path / "plugins"
    (root / "op").mkdir(parents=True)
    (root / "h.cuh").write_text("int h = 1;\n")
    src = root / "op" / "k.cu"
    src.write_text('#include "../h.cuh"\n')
    monkeypatch.setattr(cubin, "PLUGINS", root.resolve())
    first = cubin.source_text(src)
    (root / "h.cuh").write_text("int h = 2;\n")
    assert cubin.source_text(src) != first and src.read_bytes() == b'#include "../h.cuh"\n'


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_inlined_text_compiles_to_the_same_sass_as_the_include(tmp_path):
    from test_pdl_order_sass import _cuobjdump
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    arch = cubin.compile_arch(TREE_VERIFY.read_bytes(), "sm_90")
    by_path = tmp_path / "path.cubin"
    subprocess.run([shutil.which("nvcc"), "-O3", "-std=c++17", "-cubin", f"-arch={arch}", "-o", str(by_path),
                    str(TREE_VERIFY)], check=True)
    inlined = tmp_path / "inlined.cubin"
    inlined.write_bytes(cubin._nvcc(cubin.source_text(TREE_VERIFY), TREE_VERIFY.name, arch))  # the text NVRTC gets
    sass = [subprocess.run([tool, "-sass", str(f)], check=True, capture_output=True, text=True).stdout
            for f in (by_path, inlined)]
    assert sass[0] == sass[1] and "HGMMA" in sass[0]
