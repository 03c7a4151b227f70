"""INT4 packer/unpacker against compressed-tensors; FP8 block dequantisation against its formula."""

from __future__ import annotations

import pytest
import torch

from core.quant_fp8 import dequantize_fp8_block
from core.quant_int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4


@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (33, 96), (128, 256)])
def test_int4_pack_roundtrip_and_agrees_with_compressed_tensors(shape):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(shape[0])
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0], shape[1] // 8)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(helpers.pack_to_int32(q, 4), packed)
    assert torch.equal(helpers.unpack_from_int32(packed, 4, torch.Size(shape)), q)


def test_int4_layout_is_lsb_first_offset_coded():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 6, 7]], dtype=torch.int8)
    word = int(pack_int4(q)[0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [0, 1, 8, 9, 10, 11, 14, 15]


def test_int4_dequantize_and_quantize():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    q, s = quantize_int4(w, 32)
    deq = dequantize_int4(pack_int4(q), s, 32)
    assert torch.equal(deq, q.float() * s.repeat_interleave(32, dim=1))
    assert (deq - w).abs().max() <= s.max() / 2 + 1e-6
    q4, s4 = quantize_int4(w, 32, scale_mantissa_bits=4)
    exact = q4.float() * s4.repeat_interleave(32, dim=1)
    assert torch.equal(exact.bfloat16().float(), exact)  # 4-bit scales: exact in bf16


def test_fp8_block_dequant_matches_formula():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 200, generator=g) * 2).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) + 0.5
    got = dequantize_fp8_block(w, s, (128, 128))
    for o, i in [(0, 0), (127, 127), (128, 0), (299, 199), (150, 130)]:
        assert got[o, i] == w[o, i].float() * s[o // 128, i // 128]
    with pytest.raises(ValueError, match="weight_scale_inv shape"):
        dequantize_fp8_block(w, s[:2], (128, 128))


def test_fp8_block_checkpoint_loads_dequantised(tiny, tmp_path):
    """A tiny checkpoint rewritten as FP8 e4m3 with 32x32 block scales loads to the formula and runs."""
    import json
    import shutil

    from decoding import decode, load_pair
    from safetensors.torch import load_file, save_file

    from core.config import load_config
    from core.loader import WeightLoader
    from core.weight_map import target_specs
    from runtime.decode.params import SamplingParams

    src = tiny.get("kimi")
    dst = tmp_path / "fp8"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    expected = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(dst / shard))
        for name in list(tensors):
            t = tensors[name]
            if t.dim() == 2 and "proj" in name:
                blocks = t.float().unflatten(0, (-1, 32)).unflatten(2, (-1, 32))  # [o/32, 32, i/32, 32]
                s = blocks.abs().amax(dim=(1, 3)) / 448.0  # [o/32, i/32]
                fp8 = (blocks / s[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.float8_e4m3fn)
                tensors[name] = fp8
                tensors[name[: -len(".weight")] + ".weight_scale_inv"] = s
                index["weight_map"][name[: -len(".weight")] + ".weight_scale_inv"] = shard
                expected[name] = fp8.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)
        save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg_raw = json.loads((dst / "config.json").read_text())
    cfg_raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}
    (dst / "config.json").write_text(json.dumps(cfg_raw))

    cfg = load_config(dst)
    loader = WeightLoader(dst, cfg.tensor_prefix, cfg.quant)
    spec = next(s for s in target_specs(cfg) if s.ckpt == "model.layers.1.self_attn.kv_b_proj.weight")
    assert loader.storage(spec) == "fp8"
    assert torch.equal(loader.load(spec, torch.float32), expected[spec.ckpt])
    model = load_pair(dst, dtype=torch.float32).target  # through the build: the artifact holds the dequantised kv_b
    h, p, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    kv_b = expected[spec.ckpt].view(h, -1, c)  # [h, p+u, c]
    attn = model.w.layers[1].attn
    assert torch.equal(attn.w_uk, kv_b[:, :p]) and torch.equal(attn.w_uv, kv_b[:, p:])
    outs, _ = decode(model, None, [[1, 2, 3]], SamplingParams(4))
    assert len(outs[0]) == 4
