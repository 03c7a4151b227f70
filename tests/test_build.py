"""`kdtree build`: per-rank artifacts, the content-addressed cache, ONNX graphs checked on the CPU."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_ref import checkpoint_model, checkpoint_tensors
from decoding import decode

from build_pipeline import artifact_cache
from build_pipeline.build import build, ensure_built
from build_pipeline.export_onnx import layer_weights
from core.config import load_config
from core.errors import KdtreeError
from core.plan import ParallelPlan
from core.safetensors_file import SafetensorsFile
from plugins.common.bitmask import pack_mask
from plugins.moe_w4a16 import dequantize_experts, expert_dims
from runtime.decode.params import SamplingParams
from runtime.load.artifact import is_artifact, read_rank
from runtime.load.models import load_models
from runtime.model.attention import mla_forward
from runtime.model.layers import rms_norm, swiglu_mlp
from runtime.model.moe import moe_forward
from runtime.model.weights import MoEWeights


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
def test_build_then_cache_hit_rebuilds_nothing(k25, kcache):
    first = build(k25, tp=1, archs="none", progress=False)
    assert not first.cache_hit and is_artifact(first.art_dir)
    assert first.art_dir.parent == kcache
    stamp = (first.art_dir / "manifest.json").stat().st_mtime_ns
    second = build(k25, tp=1, archs="none", progress=False)
    # a hit rebuilds nothing (not a timing: the shared CI cores make wall-clock ratios flaky)
    assert second.cache_hit and second.art_dir == first.art_dir and second.manifest == first.manifest
    assert (first.art_dir / "manifest.json").stat().st_mtime_ns == stamp
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
    import build_pipeline.export_onnx as x  # build imports export_rank from it at the export step

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash while exporting")

    with monkeypatch.context() as m:
        m.setattr(x, "export_rank", boom)
        with pytest.raises(RuntimeError, match="simulated crash"):
            build(k25, tp=2, archs="none", progress=False)
    assert _entries(kcache) == [] and not list(kcache.glob(".stage-*"))
    assert not build(k25, tp=2, archs="none", progress=False).cache_hit


def test_a_concurrent_builders_entry_is_kept(k25, kcache):
    """Two processes building the same key: the second to finish keeps the first's entry (which the first may
    be reading: replacing it deleted files under a reader) and drops its own stage."""
    first = build(k25, tp=1, archs="none", progress=False)
    inode = (first.art_dir / "manifest.json").stat().st_ino
    with artifact_cache.staging(kcache, first.art_dir.name) as stage:
        (stage / "rank0").mkdir()
        (stage / "rank0" / "late.bin").write_bytes(b"another builder's late copy")
        got = artifact_cache.commit(stage, kcache, first.art_dir.name, dict(first.manifest))
    assert got == first.art_dir and (got / "manifest.json").stat().st_ino == inode
    assert not stage.exists() and not (got / "rank0" / "late.bin").exists()
    assert artifact_cache.verify(got) is None


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
def test_read_rank_equals_plan_sliced_checkpoint(k25, built, tp, ep):
    """Rank r's weights as read from the artifact are the plan's cut of the checkpoint's own tensors
    (core.loader.WeightLoader, INT4 dequantised exactly); the routed experts are held once, packed."""
    art = built[tp, ep].art_dir
    cfg = load_config(k25)
    full = checkpoint_tensors(k25, torch.float32)
    plan = ParallelPlan(tp, ep)
    h_l, (v0, v1) = plan.local_heads(cfg), plan.vocab_range(cfg, 1 % tp)
    h, p, u, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    bundle = read_rank(art, 1 % tp, "cpu", torch.float32)
    r, w = bundle.rank, bundle.weights
    lm_head = full["embed"] if cfg.tie_word_embeddings else full["lm_head"]
    assert torch.equal(w.embed, full["embed"][v0:v1]) and torch.equal(w.lm_head, lm_head[v0:v1])
    for li, lw in enumerate(w.layers):
        pre = f"layers.{li}."
        kv_b = full[pre + "attn.kv_b"].view(h, p + u, c)  # [h, p+u, c]
        assert torch.equal(lw.attn.w_uk, kv_b[r * h_l:(r + 1) * h_l, :p])
        assert torch.equal(lw.attn.w_uv, kv_b[r * h_l:(r + 1) * h_l, p:])
        assert torch.equal(lw.attn.o, plan.shard("layers.0.attn.o", full[pre + "attn.o"], r))
        assert torch.equal(lw.attn.kv_a, full[pre + "attn.kv_a"])
        if cfg.is_moe_layer(li):
            assert isinstance(lw.mlp, MoEWeights)
            first, count = plan.local_experts(cfg, r)
            ex = [full[pre + f"moe.experts.{j}.{proj}"] for j in range(first, first + count)
                  for proj in ("gate", "up", "down")]
            gate, up, down = (torch.stack(ex[k::3]) for k in range(3))  # [e_l, i, d], [e_l, i, d], [e_l, d, i]
            if not ep:  # each expert cut as its checkpoint key says: gate/up rows, down columns
                gate = torch.stack([plan.shard("layers.1.moe.experts.0.gate", t, r) for t in gate])
                up = torch.stack([plan.shard("layers.1.moe.experts.0.up", t, r) for t in up])
                down = torch.stack([plan.shard("layers.1.moe.experts.0.down", t, r) for t in down])
            w13, w2 = torch.cat([gate, up], dim=1), down  # [e_l, 2i_l, d], [e_l, d, i_l]
            k = lw.mlp.experts  # the one form held: packed kernel layout, no dequantised copy beside it
            assert k.w13.dtype == torch.int32 and k.w2.dtype == torch.int32
            assert k.w13_scale is not None and k.w2_scale is not None
            assert (k.count, expert_dims(k.w13)[1]) == (w13.shape[0], w13.shape[1] // 2)
            assert not any(hasattr(lw.mlp, name) for name in ("w13", "w2", "int4"))
            got13, got2 = dequantize_experts(k.w13, k.w13_scale, k.w2, k.w2_scale, w13.shape[-1])
            assert torch.equal(got13, w13) and torch.equal(got2, w2)
            assert torch.equal(lw.mlp.gate, full[pre + "moe.gate"]) and lw.mlp.gate.dtype == torch.float32
    files = {e["path"] for e in bundle.manifest["ranks"][str(r)]["files"]}
    assert files and all(p.startswith(f"rank{r}/") for p in files)


def test_tp1_artifact_generates_the_checkpoints_tokens(k25, built):
    """The artifact, loaded by load_models with its stored drafter and tokenizer, decodes the tokens of
    the model made straight from the checkpoint's tensors."""
    art = built[1, False].art_dir
    m = load_models(art, dtype=torch.float32)
    assert m.art_dir == art and m.target.dtype == torch.float32
    params = SamplingParams(max_new_tokens=8)
    prompts = [[5, 17, 300, 42, 9]]
    ref, _ = decode(checkpoint_model(k25, torch.float32), None, prompts, params)
    got, _ = decode(m.target, None, prompts, params)
    assert got == ref and len(ref[0]) > 0
    bundle = read_rank(art, 0, "cpu", torch.float32)
    assert bundle.drafter_dir is not None and (bundle.drafter_dir / "config.json").is_file()
    assert bundle.manifest["drafter"]["dir"] == "drafter"
    assert m.drafter is not None and m.drafter.block_size == 8  # the artifact's drafter, no --drafter given
    assert m.tokenizer is not None and m.tokenizer.vocab_size > 0


# ---- ONNX graphs vs the torch reference ----
@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (2, True)])
def test_onnx_graphs_match_torch_reference(k25, built, tp, ep):
    from build_pipeline.onnx_ops import GraphRunner, OrtRunner

    res = built[tp, ep]
    art, cfg = res.art_dir, load_config(k25)
    model = checkpoint_model(k25, torch.float32)  # the reference: the checkpoint's own tensors, unsharded
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
                            cache, lens, scratch, mask, model.new_cache(b, 1, n).work),
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
    # the plugins' CUDA C (budget auto's setter kernel, the L2 prefetch, moe_w4a16 v3 and its wgmma GEMMs, the skinny
    # GEMMs (mma.sync and wgmma) and the wgmma attention, where the runtime looks for them), then the Triton kernel
    assert [(r["kind"], r["name"]) for r in recs] == [("cuda", "set_conditionals"), ("cuda", "l2_prefetch"),
                                                     ("cuda", "moe_v3"), ("cuda", "moe_wgmma"), ("cuda", "skinny_gemm"),
                                                     ("cuda", "skinny_wgmma"), ("cuda", "tree_verify_wgmma"),
                                                     ("triton", "add_one_b16")]
    assert recs[0]["cubin"] == "kernels/sm_90/graph_conditional/set_conditionals.cubin"
    assert recs[2]["cubin"] == "kernels/sm_90/moe_w4a16/moe_v3.cubin"
    assert recs[3]["cubin"] == "kernels/sm_90/moe_w4a16/moe_wgmma.cubin"  # compiled for sm_90a
    assert recs[5]["cubin"] == "kernels/sm_90/skinny_gemm/skinny_wgmma.cubin"  # compiled for sm_90a
    assert recs[6]["cubin"] == "kernels/sm_90/tree_verify_mla/tree_verify_wgmma.cubin"  # compiled for sm_90a
    from plugins.common.cubin import PLUGINS as SOURCES
    from plugins.common.cubin import source_sha256
    for r in recs[:7]:  # the source version the runtime checks before it registers a cubin
        assert r["source_sha256"] == source_sha256(SOURCES / r["op"] / f"{r['name']}.cu"), r["name"]
    tri = recs[7]
    meta = json.loads((tmp_path / "tri" / tri["meta"]).read_text())
    assert meta["target"][1] == 90 and (tmp_path / "tri" / tri["cubin"]).read_bytes()[:4] == b"\x7fELF"


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


def test_run_path_does_not_import_onnx():
    """onnx (and ml_dtypes) take ~0.5 s to import: only a cache miss, which exports the graphs, may load them; the
    build module, the engine and the CLI (a `kdtree run <checkpoint dir>` hitting the cache) do not."""
    import subprocess
    import sys
    code = ("import sys, build_pipeline.build, runtime.cli, runtime.engine.engine, runtime.load.models; "
            "sys.exit('onnx' in sys.modules)")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:] or "onnx was imported"
