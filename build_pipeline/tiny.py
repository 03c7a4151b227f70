"""`kdtree make-tiny`: small random models in the exact layout of the real checkpoints.

The model is built and saved by transformers' `DeepseekV3ForCausalLM.save_pretrained` (sharded,
one tensor per routed expert).  Variants rewrite that output:
- `int4`: routed experts packed by our packer into compressed-tensors `pack-quantized`
  (weight_packed / weight_scale / weight_shape) with its `quantization_config`, as Kimi K2.5/K2.6 ship;
- `kimi25`: Kimi K2.5/K2.6 multimodal layout, config nested in `text_config` (Moonshot's dialect),
  tensors prefixed `language_model.`, plus a small vision tower the stack must skip;
- `dialect="kimi_k2"`: Moonshot's text config (rope_theta + rope_scaling, topk_method, auto_map).
A small tokenizer in Kimi's layout is written beside the weights.  Output appears atomically.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from core.quant_int4 import pack_int4, quantize_int4
from core.staging import staged_dir

INT4_GROUP = 32

_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 512,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}

_BASE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
             n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1,
             kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, v_head_dim=32, qk_nope_head_dim=32,
             routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-5, max_position_embeddings=4096,
             rope_parameters=_YARN, num_mtp_layers=0, tie_word_embeddings=False)

PRESETS: dict[str, dict] = {
    # Kimi-like: n_group 1, YaRN, one dense first layer, q_lora
    "kimi": {},
    # the same, lighter (2 heads, 3 layers): for the long speculative-decoding test matrices
    "small": dict(num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3),
    # group-limited routing (n_group > 1)
    "grouped": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4),
    # q_lora_rank null, plain rope, every layer MoE
    "no-q-lora": dict(q_lora_rank=None, first_k_dense_replace=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # two dense layers, YaRN with mscale != mscale_all_dim (cos/sin attention factor != 1)
    "dense2": dict(first_k_dense_replace=2, num_hidden_layers=5, max_position_embeddings=20480,
                   rope_parameters=dict(_YARN, factor=40.0, mscale=1.0, mscale_all_dim=0.707)),
}


def hf_config_dict(preset: str) -> dict:
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r} is unknown (known: {', '.join(PRESETS)})")
    return dict(_BASE, **PRESETS[preset])


def make_tiny(out: str | Path, preset: str = "kimi", int4: bool = False, kimi25: bool = False,
              dialect: str = "hf", seed: int = 0, twin_dir: str | Path | None = None, force: bool = False) -> Path:
    """Write a tiny checkpoint to `out`; with int4 and twin_dir also its dequantised bf16 twin.

    The INT4 model's experts are quantised with 4-bit-mantissa scales, so every dequantised weight is
    exact in bf16 and the twin holds the very same function in plain bf16 tensors.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    if dialect not in ("hf", "kimi_k2"):
        raise ValueError(f"--dialect must be hf or kimi_k2, got {dialect!r}")
    for target in [out] + ([Path(twin_dir)] if twin_dir else []):
        if target.exists() and not force:
            raise FileExistsError(f"{target}: already exists (pass --force to replace it)")
        if target.exists() and not target.is_dir():  # --force replaces a model folder, never a file
            raise FileExistsError(f"{target}: exists and is not a directory (--force replaces only a folder)")
    kwargs = hf_config_dict(preset)
    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**kwargs)
    model = DeepseekV3ForCausalLM(cfg)
    _randomise(model, seed)
    if int4:
        _round_experts_to_int4(model)
    model = model.to(torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    if twin_dir is not None:
        _save(model, Path(twin_dir), int4=False, kimi25=kimi25, dialect=dialect, force=force)
    return _save(model, out, int4=int4, kimi25=kimi25, dialect=dialect, force=force)


def _save(model, out: Path, int4: bool, kimi25: bool, dialect: str, force: bool) -> Path:
    from build_pipeline.tiny_tokenizer import write_tiny_tokenizer

    with staged_dir(out) as stage:
        hf_dir = stage / "hf"
        model.save_pretrained(hf_dir, max_shard_size="300KB")
        config = json.loads((hf_dir / "config.json").read_text())
        specials = write_tiny_tokenizer(stage, config["vocab_size"])
        config.update(bos_token_id=specials["[BOS]"], eos_token_id=specials["[EOS]"], pad_token_id=specials["[PAD]"])
        if int4 or kimi25:
            _rewrite_tensors(hf_dir, stage, int4=int4, kimi25=kimi25)
        else:
            for f in hf_dir.iterdir():
                if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
                    shutil.move(str(f), stage / f.name)
        if (hf_dir / "generation_config.json").exists():
            gen = json.loads((hf_dir / "generation_config.json").read_text())
            gen.update(bos_token_id=config["bos_token_id"], eos_token_id=config["eos_token_id"])
            (stage / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if dialect == "kimi_k2" or kimi25:
            config = moonshot_dialect(config)
        if int4:
            config["quantization_config"] = compressed_tensors_config()
        if kimi25:
            config = _kimi25_config(config)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shutil.rmtree(hf_dir)
    return out


def _randomise(model, seed: int) -> None:
    """Weights with unit-scale activations and peaked logits, so every layer matters and greedy
    choices have clear margins; router bias and norms non-trivial so their handling is tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 3.0 / math.sqrt(p.shape[-1]))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))


def _round_experts_to_int4(model) -> None:
    """Replace routed-expert weights by their INT4 dequantisation (exact in bf16)."""
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for param in (experts.gate_up_proj, experts.down_proj):  # [e, out, in]
                for e in range(param.shape[0]):
                    q, s = quantize_int4(param[e].float(), INT4_GROUP, scale_mantissa_bits=4)
                    s = s.to(torch.bfloat16).float()
                    param[e].copy_(q.float() * s.repeat_interleave(INT4_GROUP, dim=1))


def _rewrite_tensors(hf_dir: Path, stage: Path, int4: bool, kimi25: bool) -> None:
    """Re-shard the save_pretrained output with INT4 experts and/or the kimi_k25 prefix."""
    from safetensors import safe_open

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    out_tensors: list[tuple[str, torch.Tensor]] = []
    for shard in shards:
        with safe_open(str(hf_dir / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                prefix = "language_model." if kimi25 else ""
                if int4 and ".mlp.experts." in name and name.endswith(".weight"):
                    stem = name[: -len(".weight")]
                    q, s = quantize_int4(t.float(), INT4_GROUP, scale_mantissa_bits=4)
                    out_tensors += [(prefix + stem + ".weight_packed", pack_int4(q)),
                                    (prefix + stem + ".weight_scale", s.to(torch.bfloat16)),
                                    (prefix + stem + ".weight_shape", torch.tensor(list(t.shape), dtype=torch.int64))]
                else:
                    out_tensors.append((prefix + name, t))
    if kimi25:  # a token vision tower and projector: present in the real layout, skipped by the stack
        g = torch.Generator().manual_seed(1)
        out_tensors += [("vision_tower.patch_embed.proj.weight", torch.randn(32, 3, 4, 4, generator=g).bfloat16()),
                        ("mm_projector.proj.0.weight", torch.randn(64, 32, generator=g).bfloat16())]
    write_sharded(stage, out_tensors, 300_000)


def write_sharded(folder: Path, tensors, shard_bytes: int) -> None:
    """(name, tensor) pairs -> model-0000i-of-0000n.safetensors files of about shard_bytes each, in order,
    plus model.safetensors.index.json (the HF sharded-checkpoint layout)."""
    from safetensors.torch import save_file

    files: list[dict[str, torch.Tensor]] = []
    current, size = {}, 0
    for name, t in tensors:
        current[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size > shard_bytes:
            files.append(current)
            current, size = {}, 0
    if current:
        files.append(current)
    weight_map, total = {}, 0
    for i, part in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def moonshot_dialect(c: dict) -> dict:
    """transformers' config.json -> Moonshot's (top-level rope_theta + rope_scaling, remote-code auto_map)."""
    c = dict(c)
    rope = dict(c.pop("rope_parameters"))
    c["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    c["rope_scaling"] = None if kind == "default" else dict(type=kind, **rope)
    c["num_nextn_predict_layers"] = c.pop("num_mtp_layers", 0)
    for k in ("head_dim", "qk_head_dim", "transformers_version", "dtype"):
        c.pop(k, None)
    c.update(model_type="kimi_k2", topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
             torch_dtype="bfloat16", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                               "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    return c


def compressed_tensors_config() -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": INT4_GROUP, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"],
        "kv_cache_scheme": None,
    }


def _kimi25_config(text: dict) -> dict:
    quant = text.pop("quantization_config", None)
    text.pop("auto_map", None)
    c = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "hidden_size": 32, "patch_size": 4, "num_hidden_layers": 1},
        "media_placeholder_token_id": text["pad_token_id"],
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "tie_word_embeddings": False,
    }
    if quant is not None:
        c["quantization_config"] = quant
    return c
