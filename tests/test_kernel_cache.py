"""The artifact's Triton kernel cache on the CPU: the folder format both ways, the serve-or-warn decision,
integrity of the shipped files, and a CPU build warming nothing (the GPU side: test_kernel_cache_gpu.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from build_pipeline.artifact_cache import hash_tree
from build_pipeline.build import build
from build_pipeline.kernel_cache import GROUP_PREFIX, UNWARMED, cache_dir_name, not_warmed, pack, unpack
from core.errors import CheckpointError, KdtreeError
from runtime.load.kernel_cache import KernelCacheWarning, install, why_not

ARCH, TRITON = "sm_90", "3.6.0"


def fake_triton_cache(root: Path) -> Path:
    """Two complete entries in Triton's layout (group files naming children by absolute path), one entry
    whose group lists a file it lacks (an interrupted write), a launcher-only entry and write leftovers."""
    for key, name in (("KEYA", "rms_norm_kernel"), ("KEYB", "tree_accept_kernel")):
        d = root / key
        d.mkdir(parents=True)
        (d / f"{name}.cubin").write_bytes(bytes(range(256)) * 3 + key.encode())
        (d / f"{name}.json").write_text(json.dumps({"name": name, "key": key}))
        (d / f"{name}.ptx").write_text(f"// ptx of {name}")
        children = {f"{name}.{ext}": str(d / f"{name}.{ext}") for ext in ("cubin", "json", "ptx")}
        (d / f"{GROUP_PREFIX}{name}.json").write_text(json.dumps({"child_paths": children}))
        (d / "tmp.pid_1_abc").mkdir()  # Triton's per-write folder, left by a killed process
    broken = root / "KEYC"
    broken.mkdir()
    (broken / f"{GROUP_PREFIX}k.json").write_text(json.dumps({"child_paths": {"k.cubin": str(broken / "k.cubin")}}))
    launcher = root / "KEYD"
    launcher.mkdir()
    (launcher / "__triton_launcher.so").write_bytes(b"\x7fELF fake")
    return root


def test_pack_unpack_roundtrip(tmp_path):
    src = fake_triton_cache(tmp_path / "scratch")
    packed = tmp_path / "art" / cache_dir_name(ARCH)
    assert pack(src, packed) == 3  # KEYC skipped
    assert sorted(p.name for p in packed.iterdir()) == ["KEYA", "KEYB", "KEYD"]
    assert not (packed / "KEYA" / "tmp.pid_1_abc").exists()
    group = json.loads((packed / "KEYA" / f"{GROUP_PREFIX}rms_norm_kernel.json").read_text())
    assert group["child_paths"]["rms_norm_kernel.cubin"] == "rms_norm_kernel.cubin"  # no build machine path

    dest = tmp_path / "user-triton"
    before = {p: p.read_bytes() for p in packed.rglob("*") if p.is_file()}
    assert unpack(packed, dest) == {"entries": 3, "copied": 9}
    assert {p: p.read_bytes() for p in packed.rglob("*") if p.is_file()} == before  # the artifact is only read
    group = json.loads((dest / "KEYA" / f"{GROUP_PREFIX}rms_norm_kernel.json").read_text())
    for child, path in group["child_paths"].items():
        assert Path(path) == dest / "KEYA" / child and Path(path).is_file()
    assert ((dest / "KEYA" / "rms_norm_kernel.cubin").read_bytes()
            == (src / "KEYA" / "rms_norm_kernel.cubin").read_bytes())
    assert not list(dest.rglob("*.tmp"))
    assert unpack(packed, dest)["copied"] == 0  # present already: nothing rewritten
    # a file the user's cache already has (its own JIT compile of the same key) is kept as is
    (dest / "KEYB" / "tree_accept_kernel.ptx").write_text("mine")
    (dest / "KEYB" / f"{GROUP_PREFIX}tree_accept_kernel.json").unlink()
    assert unpack(packed, dest)["copied"] == 1
    assert (dest / "KEYB" / "tree_accept_kernel.ptx").read_text() == "mine"


def test_bad_group_file_names_the_file(tmp_path):
    src = fake_triton_cache(tmp_path / "scratch")
    bad = src / "KEYA" / f"{GROUP_PREFIX}rms_norm_kernel.json"
    bad.write_text("{\"paths\": {}}")
    with pytest.raises(KdtreeError, match=f"{bad}: not a Triton group file"):
        pack(src, tmp_path / "out")
    bad.write_text(json.dumps({"child_paths": {"x.cubin": "/"}}))
    with pytest.raises(KdtreeError, match="child 'x.cubin' has no file name"):
        pack(src, tmp_path / "out2")


def test_why_not():
    m = Path("/a/manifest.json")
    rec = {"warmed": True, "dir": cache_dir_name(ARCH), "arch": ARCH, "triton": TRITON}
    assert why_not(rec, ARCH, TRITON, m) is None
    assert why_not(rec, "sm_120", TRITON, m) == (f"{m}: triton_cache holds kernels for sm_90 with Triton 3.6.0; "
                                                 f"this GPU is sm_120 with Triton 3.6.0")
    assert "this GPU is sm_90 with Triton 3.7.0" in why_not(rec, ARCH, "3.7.0", m)
    assert why_not(not_warmed("no CUDA device at build time"), ARCH, TRITON, m) == \
        f"{m}: triton_cache not warmed (no CUDA device at build time)"
    assert "no triton_cache record" in why_not(None, ARCH, TRITON, m)
    with pytest.raises(CheckpointError, match="manifest.json: triton_cache must be an object"):
        why_not({"warmed": "yes"}, ARCH, TRITON, m)
    with pytest.raises(CheckpointError, match="manifest.json: triton_cache.arch must be a string"):
        why_not({"warmed": True, "dir": "kernels/x", "triton": TRITON}, ARCH, TRITON, m)


def fake_artifact(tmp_path: Path) -> tuple[Path, dict]:
    art = tmp_path / "art"
    pack(fake_triton_cache(tmp_path / "scratch"), art / cache_dir_name(ARCH))
    manifest = {"files": hash_tree(art), "triton_cache": {"warmed": True, "dir": cache_dir_name(ARCH), "arch": ARCH,
                                                           "triton": TRITON, "entries": 3}}
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art, manifest


def test_install_serves_matching_gpu(tmp_path):
    art, manifest = fake_artifact(tmp_path)
    dest = tmp_path / "user-triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert install(art, manifest, ARCH, TRITON, dest) == {"entries": 3, "copied": 9}
    assert (dest / "KEYD" / "__triton_launcher.so").read_bytes() == b"\x7fELF fake"


@pytest.mark.parametrize("arch,version", [("sm_120", TRITON), (ARCH, "3.5.1")])
def test_install_mismatch_warns_and_copies_nothing(tmp_path, arch, version):
    art, manifest = fake_artifact(tmp_path)
    dest = tmp_path / "user-triton"
    with pytest.warns(KernelCacheWarning, match=f"this GPU is {arch} with Triton {version}: Triton kernels compile"):
        assert install(art, manifest, arch, version, dest) is None
    assert not dest.exists()


def test_install_refuses_damaged_or_unlisted_files(tmp_path):
    art, manifest = fake_artifact(tmp_path)
    cubin = art / cache_dir_name(ARCH) / "KEYA" / "rms_norm_kernel.cubin"
    data = bytearray(cubin.read_bytes())
    data[7] ^= 1
    cubin.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="rms_norm_kernel.cubin: sha256 differs"):
        install(art, manifest, ARCH, TRITON, tmp_path / "d1")
    assert not (tmp_path / "d1" / "KEYA" / "rms_norm_kernel.cubin").exists()
    data[7] ^= 1
    cubin.write_bytes(bytes(data))
    stray = art / cache_dir_name(ARCH) / "KEYA" / "extra.so"
    stray.write_bytes(b"not listed")
    with pytest.raises(CheckpointError, match="extra.so: not listed in the manifest"):
        install(art, manifest, ARCH, TRITON, tmp_path / "d2")
    stray.unlink()
    manifest["triton_cache"]["dir"] = "kernels/triton-sm_80"
    with pytest.raises(CheckpointError, match="triton_cache.dir 'kernels/triton-sm_80' lists no files"):
        install(art, manifest, ARCH, TRITON, tmp_path / "d3")
    manifest["triton_cache"]["dir"] = "../outside"
    with pytest.raises(CheckpointError, match="outside the artifact"):
        install(art, manifest, ARCH, TRITON, tmp_path / "d4")


def test_cpu_build_warms_nothing(tiny, tmp_path, monkeypatch):
    """Without a CUDA device a warm build is the unwarmed build (same key: a cache hit), and says why."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine's CPU suite
    model = tiny.get("kimi")
    first = build(model, archs=(), progress=False, warm=True)
    assert first.manifest["triton_cache"] == {"warmed": False, "reason": UNWARMED}
    assert "warm" not in first.manifest["options"]
    assert not any(f.startswith("kernels/triton-") for f in first.manifest["files"])
    assert not (first.art_dir / "kernels").exists() or not list((first.art_dir / "kernels").glob("triton-*"))
    again = build(model, archs=(), progress=False, warm=False)
    assert again.cache_hit and again.manifest["key"] == first.manifest["key"]
    assert first.summary()["triton_cache"]["warmed"] is False


def test_warm_cases_cover_budget_auto():
    """The warm-up decodes `kdtree run`'s CUDA default (budget auto) last, after a fixed-budget case per bucket of
    it, so the buckets' kernels compile in parallel and the cost curve is timed alone; its buckets are the
    runtime's."""
    from build_pipeline.kernel_cache import AUTO_BUCKETS, warm_cases
    from runtime.decode.budget import default_buckets
    from runtime.decode.params import AUTO_MAX_BUDGET

    assert AUTO_BUCKETS == default_buckets(AUTO_MAX_BUDGET)
    cases = warm_cases((16, 48), has_drafter=True)
    assert cases[-1] == {"spec": "ddtree", "budget": "auto"}
    assert [c["budget"] for c in cases if c["spec"] == "ddtree"][:-1] == sorted({48, *AUTO_BUCKETS})
    assert [c["spec"] for c in cases[:2]] == ["none", "chain"]
    assert warm_cases((16,), has_drafter=False) == [{"spec": "none", "budget": 16}]
