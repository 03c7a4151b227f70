"""`kdtree build`: per-rank artifacts, the content-addressed cache, ONNX graphs checked on the CPU."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from build_pipeline import artifact_cache
from build_pipeline.build import build, ensure_built
from build_pipeline.config import load_config
from build_pipeline.errors import KdtreeError
from build_pipeline.export_onnx import layer_weights
from build_pipeline.moe_layout import dequantize_kernel_layout
from build_pipeline.plan import ParallelPlan
from build_pipeline.safetensors_file import SafetensorsFile
from plugins.bitmask import pack_mask
from runtime.artifact import is_artifact, load_rank
from runtime.attention import mla_forward
from runtime.generate import SamplingParams, generate_ar
from runtime.layers import rms_norm, swiglu_mlp
from runtime.model import TargetModel, load_target
from runtime.moe import moe_forward
from runtime.weights import MoEWeights, load_target_weights

@pytest.fixture
def kcache(tmp_path, monkeypatch) -> Path:
    """A fresh KDTREE_CACHE per test."""
    root = tmp_path / "kcache"
    monkeypatch.setenv("KDTREE_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def k25(tiny) -> str:
    return tiny.get("kimi", int4=True, kimi25=True)


@pytest.fixture(scope="module")
def built(k25, tmp_path_factory):
    """Artifacts of the tiny INT4 kimi_k25 model for tp 1 (with a drafter), tp 2 and tp 2 --ep, built
    once into a module-wide cache (the cache-behaviour tests use their own fresh cache)."""
    from build_pipeline.tiny_drafter import make_tiny_drafter

    root = tmp_path_factory.mktemp("kcache-shared")
    drafter = make_tiny_drafter(k25, root.parent / "k25-drafter")
    old = os.environ.get("KDTREE_CACHE")
    os.environ["KDTREE_CACHE"] = str(root)
    try:
        yield {(tp, ep): build(k25, tp=tp, ep=ep, archs="none", progress=False,
                               drafter_dir=drafter if tp == 1 else None)
               for tp, ep in [(1, False), (2, False), (2, True)]}
    finally:
        if old is None:
            os.environ.pop("KDTREE_CACHE", None)
        else:
            os.environ["KDTREE_CACHE"] = old


def _entries(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] if root.exists() else []


def _rank_tensors(art: Path, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((art / f"rank{rank}").glob("*.safetensors")):
        sf = SafetensorsFile(f)
        out.update({k: sf.tensor(k) for k in sf.keys()})
    return out


# ---- cache behaviour ----
def test_build_then_cache_hit_is_fast(k25, kcache):
    first = build(k25, tp=1, archs="none", progress=False)
    assert not first.cache_hit and is_artifact(first.art_dir)
    assert first.art_dir.parent == kcache
    cached = float("inf")
    for _ in range(3):  # best of 3: the CI machine's 2 cores are shared
        t0 = time.perf_counter()
        second = build(k25, tp=1, archs="none", progress=False)
        cached = min(cached, time.perf_counter() - t0)
    assert second.cache_hit and second.art_dir == first.art_dir
    assert cached < 0.05 * first.seconds, (cached, first.seconds)
    m = second.manifest
    assert m["plan"] == {"tp": 1, "ep": False} and m["model"]["num_layers"] == 4
    assert all(len(f["sha256"]) == 64 for f in m["ranks"]["0"]["files"])
    assert (first.art_dir / "tokenizer" / "tiktoken.model").is_file()
    assert ensure_built(k25, archs="none") == first.art_dir


def test_corrupted_file_is_detected_and_rebuilt(k25, kcache):
    first = build(k25, tp=1, archs="none", progress=False)
    victim = first.art_dir / "rank0" / "layer.001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert artifact_cache.verify(first.art_dir) is not None
    again = build(k25, tp=1, archs="none", progress=False)
    assert not again.cache_hit and artifact_cache.verify(again.art_dir) is None
    victim = again.art_dir / "rank0" / "globals.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    assert not build(k25, tp=1, archs="none", progress=False).cache_hit


def test_interrupted_build_leaves_nothing_complete(k25, kcache, monkeypatch):
    import build_pipeline.build as b

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash while exporting")

    with monkeypatch.context() as m:
        m.setattr(b, "export_rank", boom)
        with pytest.raises(RuntimeError, match="simulated crash"):
            build(k25, tp=2, archs="none", progress=False)
    assert _entries(kcache) == [] and not list(kcache.glob(".stage-*"))
    assert not build(k25, tp=2, archs="none", progress=False).cache_hit


def test_bad_inputs_fail_with_one_line(k25, kcache, tmp_path):
    with pytest.raises(KdtreeError, match="--tp 3: num_attention_heads 4 is not divisible by 3"):
        build(k25, tp=3, archs="none", progress=False)
    with pytest.raises(KdtreeError, match="MODEL_DIR"):
        build(tmp_path / "nope", progress=False)
    with pytest.raises(KdtreeError, match="--arch 'gfx90a'"):
        build(k25, archs="gfx90a", progress=False)
    with pytest.raises(KdtreeError, match="--budgets"):
        build(k25, archs="none", budgets="16,x", progress=False)
    assert _entries(kcache) == []


def test_tensorrt_backend_needs_tensorrt(k25, kcache):
    try:
        import tensorrt  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("TensorRT and a GPU are present")
    except ImportError:
        pass
    with pytest.raises(KdtreeError, match=r"--backend tensorrt needs TensorRT >= 10.9 and a GPU"):
        build(k25, backend="tensorrt", archs="none", progress=False)


# ---- per-rank weights ----
@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)])
def test_load_rank_equals_plan_sliced_reference(k25, built, tp, ep):
    art = built[tp, ep].art_dir
    cfg = load_config(k25)
    full = load_target_weights(k25, cfg, torch.float32, progress=False)
    plan = ParallelPlan(tp, ep)
    h_l, (v0, v1) = plan.local_heads(cfg), plan.vocab_range(cfg, 1 % tp)
    bundle = load_rank(art, 1 % tp)
    r, w = bundle.rank, bundle.weights
    assert torch.equal(w.embed, full.embed[v0:v1]) and torch.equal(w.lm_head, full.lm_head[v0:v1])
    for lw, fw in zip(w.layers, full.layers):
        assert torch.equal(lw.attn.w_uk, fw.attn.w_uk[r * h_l:(r + 1) * h_l])
        assert torch.equal(lw.attn.w_uv, fw.attn.w_uv[r * h_l:(r + 1) * h_l])
        assert torch.equal(lw.attn.o, plan.shard("layers.0.attn.o", fw.attn.o, r))
        assert torch.equal(lw.attn.kv_a, fw.attn.kv_a)
        if isinstance(fw.mlp, MoEWeights):
            first, count = plan.local_experts(cfg, r)
            w13 = fw.mlp.w13[first:first + count]  # [e_l, 2i, d]
            w2 = fw.mlp.w2[first:first + count]
            if not ep:
                i = cfg.moe_intermediate_size
                gate, up = plan.shard("layers.1.moe.w13", w13[:, :i], r), plan.shard("layers.1.moe.w13", w13[:, i:], r)
                w13, w2 = torch.cat([gate, up], dim=1), plan.shard("layers.1.moe.w2", w2, r)
            assert torch.equal(lw.mlp.w13, w13) and torch.equal(lw.mlp.w2, w2)
            assert torch.equal(lw.mlp.gate, fw.mlp.gate) and lw.mlp.gate.dtype == torch.float32
            k = lw.mlp.int4  # the packed kernel-layout experts the CUDA path reads
            assert k is not None and k.w13.dtype == torch.int32 and k.w13.shape[:2] == lw.mlp.w13.shape[:2]
            assert torch.equal(dequantize_kernel_layout(k.w2, k.w2_scale, w2.shape[-1]), w2)
    files = {e["path"] for e in bundle.manifest["ranks"][str(r)]["files"]}
    assert files and all(p.startswith(f"rank{r}/") for p in files)


def test_tp1_artifact_generates_the_same_tokens(k25, built):
    bundle = load_rank(built[1, False].art_dir, 0)
    params = SamplingParams(max_new_tokens=8)
    prompt = [5, 17, 300, 42, 9]
    ref = list(generate_ar(load_target(k25, progress=False), prompt, params))
    got = list(generate_ar(TargetModel(bundle.cfg, bundle.weights), prompt, params))
    assert got == ref and len(ref) > 0
    assert bundle.drafter_dir is not None and (bundle.drafter_dir / "config.json").is_file()
    assert bundle.manifest["drafter"]["dir"] == "drafter"
    from build_pipeline.drafter_config import load_drafter_config
    from runtime.drafter import load_drafter
    taps = load_drafter_config(bundle.drafter_dir).target_layer_ids
    target = TargetModel(bundle.cfg, bundle.weights, feature_layers=taps)
    assert load_drafter(bundle.drafter_dir, target, progress=False).block_size == 8
    from runtime.tokenizer import Tokenizer
    assert Tokenizer.load(bundle.tokenizer_dir).vocab_size > 0


# ---- ONNX graphs vs the torch reference ----
@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)])
def test_onnx_graphs_match_torch_reference(k25, built, tp, ep):
    from build_pipeline.onnx_ops import GraphRunner, OrtRunner

    res = built[tp, ep]
    art, cfg = res.art_dir, load_config(k25)
    model = load_target(k25, progress=False)
    g = torch.Generator().manual_seed(0)
    b, n, l_max, d, dq = 2, 3, 6, cfg.hidden_size, cfg.d_qk
    x = torch.randn(b, n, d, generator=g)
    lens = torch.tensor([6, 2], dtype=torch.int32)
    cache = torch.randn(b, l_max, dq, generator=g)
    dense = torch.rand(b, n, n, generator=g) < 0.5
    mask = pack_mask(dense | torch.eye(n, dtype=torch.bool))  # any subset of earlier nodes, self included
    positions = lens[:, None].long() + torch.arange(n)
    cos, sin = model.rope.cos_sin(positions, torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (b, n), generator=g)

    scratch = torch.zeros(b, n, dq)
    lw0, lw1 = model.w.layers[0], model.w.layers[1]
    want = {
        "embed": torch.nn.functional.embedding(tokens, model.w.embed),
        "attn": mla_forward(cfg, lw1.attn, model.rope, rms_norm(x, lw1.attn_norm, cfg.rms_norm_eps), cos, sin,
                            cache, lens, scratch, mask),
        "mlp": swiglu_mlp(rms_norm(x, lw0.mlp_norm, cfg.rms_norm_eps), lw0.mlp.gate_up, lw0.mlp.down),
        "moe": moe_forward(cfg, lw1.mlp, rms_norm(x, lw1.mlp_norm, cfg.rms_norm_eps)),
        "head": model.logits(rms_norm(x, model.w.norm, cfg.rms_norm_eps)),
    }
    got: dict[str, list[torch.Tensor]] = {k: [] for k in want}
    tree_kv = []
    for r in range(tp):
        tensors = _rank_tensors(art, r)
        graphs = {Path(e["path"]).stem: art / e["path"] for e in res.manifest["ranks"][str(r)]["graphs"]}
        assert set(graphs) == set(want)
        acts = {"x": x, "cos": cos, "sin": sin, "cache": cache, "cache_lens": lens, "tree_mask": mask,
                "tokens": tokens}
        layer = {"attn": 1, "mlp": 0, "moe": 1}
        for name, path in graphs.items():
            runner = GraphRunner(path)
            weights = layer_weights(tensors, layer[name]) if name in layer else tensors
            feeds = {k: v for k, v in {**weights, **acts}.items() if k in runner.input_names}
            outs = runner.run(feeds)
            got[name].append(next(iter(outs.values())))
            if name in ("embed", "head", "mlp"):  # no kdtree:: nodes: onnxruntime runs them as well
                ort_out = next(iter(OrtRunner(path).run(feeds).values()))
                assert torch.allclose(ort_out, got[name][-1], rtol=1e-5, atol=1e-5), name
            if name == "attn":
                tree_kv.append(outs["tree_kv"])
    for name, parts in got.items():
        total = torch.cat(parts, dim=-1) if name == "head" else sum(parts)
        err = (total - want[name]).abs().max().item()
        assert err <= 1e-4 * max(1.0, want[name].abs().max().item()), (name, err)
    for t in tree_kv:
        assert torch.allclose(t, scratch, atol=1e-5)


# ---- kernels ----
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_kernels_compile_to_cubin_without_a_gpu(tmp_path):
    from build_pipeline.compile_kernels import compile_all, compile_cuda

    src = tmp_path / "plugins" / "demo" / "scale.cu"
    src.parent.mkdir(parents=True)
    src.write_text('extern "C" __global__ void scale(float* x, float s, int n) {\n'
                   '  int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= s; }\n')
    import build_pipeline.compile_kernels as ck

    old = ck.PLUGINS
    ck.PLUGINS = tmp_path / "plugins"
    try:
        rec = compile_cuda(src, "sm_90", tmp_path / "out")[0]
    finally:
        ck.PLUGINS = old
    cubin = (tmp_path / "out" / rec["cubin"]).read_bytes()
    assert cubin[:4] == b"\x7fELF" and b".version" in (tmp_path / "out" / rec["ptx"]).read_bytes()
    recs = compile_all(tmp_path / "tri", ("sm_90",), (16,), progress=False, modules=["tests.aot_demo_kernels"])
    assert [r["name"] for r in recs] == ["add_one_b16"] and recs[0]["kind"] == "triton"
    meta = json.loads((tmp_path / "tri" / recs[0]["meta"]).read_text())
    assert meta["target"][1] == 90 and (tmp_path / "tri" / recs[0]["cubin"]).read_bytes()[:4] == b"\x7fELF"


def test_cli_build_json(k25, kcache, tmp_path):
    from typer.testing import CliRunner

    from runtime.cli import app

    out = tmp_path / "ART"
    args = ["build", k25, "--out", str(out), "--tp", "2", "--arch", "none", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["artifact"] == str(out) and is_artifact(out) and summary["plan"]["tp"] == 2
    again = json.loads(CliRunner().invoke(app, args).stdout)
    assert again["cache_hit"] and again["key"] == summary["key"]
    for bad, needle in [(["--tp", "3"], "--tp 3: num_attention_heads"), (["--backend", "onnx"], "--backend"),
                        (["--drafter", str(tmp_path / "none")], "drafter")]:
        r = CliRunner().invoke(app, ["build", k25, "--arch", "none", *bad])
        assert r.exit_code == 1 and needle in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert _entries(kcache) == [next(iter(_entries(kcache)))]  # failures added no entry
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    r = CliRunner().invoke(app, ["build", k25, "--arch", "none", "--out", str(tmp_path / "mine")])
    assert r.exit_code == 1 and "--out" in r.stderr and (tmp_path / "mine" / "notes.txt").is_file()
