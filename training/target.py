"""The demo target: transformers' DeepseekV3ForCausalLM (the Kimi K2 architecture: MLA with q_lora and
YaRN, a dense first layer, sigmoid-routed MoE with e_score_correction_bias and a shared expert), its
training loss, aux-loss-free router balancing, and the export in Kimi's HF layout.

Export (`export_target`): Moonshot's kimi_k2 config dialect, tensors named by core/weight_map.py's
table (one tensor per routed expert); routed experts INT4 compressed-tensors pack-quantized (group 32,
symmetric, bf16 scales), the router's e_score_correction_bias fp32, everything else bf16.
`stored_weights` is that exact rounding; `quantised_copy` puts it back into a model, so the loss of
what the loader will see is measured, not guessed.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from build_pipeline.tiny import write_sharded
from core.config import parse_config
from core.quant_int4 import dequantize_int4, pack_int4, quantize_int4
from core.staging import staged_dir
from core.weight_map import target_specs
from training.recipe import INT4_GROUP, Recipe

SHARD_BYTES = 5_000_000


def hf_config(r: Recipe, specials: dict[str, int]) -> dict:
    """transformers' DeepseekV3Config kwargs for the recipe."""
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": r.yarn_factor,
            "original_max_position_embeddings": r.yarn_original, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    return dict(vocab_size=r.vocab, hidden_size=r.hidden, intermediate_size=r.dense_inter,
                moe_intermediate_size=r.moe_inter, num_hidden_layers=r.layers, num_attention_heads=r.heads,
                num_key_value_heads=r.heads, n_routed_experts=r.experts, n_shared_experts=1,
                num_experts_per_tok=r.top_k, n_group=1, topk_group=1, first_k_dense_replace=1,
                kv_lora_rank=r.kv_lora, q_lora_rank=r.q_lora, qk_rope_head_dim=r.qk_rope, v_head_dim=r.v_head,
                qk_nope_head_dim=r.qk_nope, routed_scaling_factor=r.routed_scale, norm_topk_prob=True,
                rms_norm_eps=1e-5, max_position_embeddings=int(r.yarn_original * r.yarn_factor),
                rope_parameters=rope, num_mtp_layers=0, tie_word_embeddings=False,
                bos_token_id=specials["[BOS]"], eos_token_id=specials["[EOS]"], pad_token_id=specials["[PAD]"])


def build_target(r: Recipe, specials: dict[str, int], seed: int):
    """A freshly initialised fp32 model (transformers' init, seeded)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(**hf_config(r, specials))
    return DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="sdpa").float()


def lm_loss(model, ids: torch.Tensor, autocast: bool = False) -> torch.Tensor:
    """Mean next-token cross-entropy of ids [b, l]."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids[:, :-1]).logits  # [b, l-1, v]
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


class RouterBalance:
    """Aux-loss-free load balancing (DeepSeek-V3): after each step, every MoE layer's
    e_score_correction_bias moves by `rate` towards under-used experts: b += rate * sign(mean - load).
    Records the routing of the forward passes since the last update through hooks on the gates."""

    def __init__(self, model, rate: float):
        self.rate, self.gates, self.counts = rate, [], []
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                i = len(self.gates)
                self.gates.append(gate)
                self.counts.append(torch.zeros(gate.e_score_correction_bias.shape[0]))
                gate.register_forward_hook(lambda mod, inp, out, i=i: self._record(i, out[2]))

    def _record(self, i: int, topk: torch.Tensor) -> None:
        if torch.is_grad_enabled():  # training forwards only
            self.counts[i] += torch.bincount(topk.flatten().cpu(), minlength=self.counts[i].shape[0]).float()

    def update(self) -> float:
        """Apply the bias step; returns the worst layer's max load / mean load (1.0 = balanced)."""
        worst = 1.0
        with torch.no_grad():
            for gate, load in zip(self.gates, self.counts):
                if load.sum() == 0:
                    continue
                mean = load.mean()
                gate.e_score_correction_bias += self.rate * torch.sign(mean - load).to(
                    gate.e_score_correction_bias.device)
                worst = max(worst, float(load.max() / mean))
                load.zero_()
        return worst


class LayerTap:
    """The residual stream after each decoder layer in layer_ids, captured on every forward of `model`
    (forward hooks, until remove())."""

    def __init__(self, model, layer_ids: tuple[int, ...] | list[int]):
        self.layer_ids, self.got = tuple(layer_ids), {}
        self.hooks = [model.model.layers[i].register_forward_hook(
            lambda mod, inp, out, i=i: self.got.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in self.layer_ids]

    def feats(self) -> torch.Tensor:
        """[b, l, len(layer_ids) * hidden] of the last forward, in the model's dtype."""
        return torch.cat([self.got[i] for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def tap_features(model, ids: torch.Tensor, layer_ids: tuple[int, ...], autocast: bool = False) -> torch.Tensor:
    """ids [b, l] -> the residual stream after each decoder layer in layer_ids, concatenated:
    [b, l, len(layer_ids) * hidden] fp32 (what runtime/model/target.py returns as features)."""
    tap = LayerTap(model, layer_ids)
    try:
        with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            model.model(input_ids=ids)
    finally:
        tap.remove()
    return tap.feats().float()


def stored_weights(model) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict in Moonshot's kimi_k2 dialect with quantization_config, {checkpoint name: tensor as
    stored}); routed experts as weight_packed / weight_scale / weight_shape."""
    from build_pipeline.tiny import compressed_tensors_config, moonshot_dialect

    config = moonshot_dialect(json.loads(model.config.to_json_string()))
    config.pop("architectures", None)
    config.update(architectures=["DeepseekV3ForCausalLM"], quantization_config=compressed_tensors_config())
    cfg = parse_config(config)
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for spec in target_specs(cfg):
        name = spec.ckpt
        if ".mlp.experts." in name:
            layer, rest = name.split(".mlp.experts.")
            j, proj = rest.split(".")[:2]
            fused = state[f"{layer}.mlp.experts.gate_up_proj"][int(j)]  # [2i, d]
            w = {"gate_proj": fused[: fused.shape[0] // 2], "up_proj": fused[fused.shape[0] // 2:],
                 "down_proj": state[f"{layer}.mlp.experts.down_proj"][int(j)]}[proj]
            q, s = quantize_int4(w, INT4_GROUP, scale_mantissa_bits=8)  # scales exact in bf16
            stem = name[: -len(".weight")]
            out[stem + ".weight_packed"] = pack_int4(q)
            out[stem + ".weight_scale"] = s.to(torch.bfloat16)
            out[stem + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        elif name.endswith("e_score_correction_bias"):
            out[name] = state[name].float()
        else:
            out[name] = state[name].to(torch.bfloat16)
    return config, out


def quantised_copy(model):
    """A copy of `model` (fp32) holding exactly the function of its export: bf16 weights, INT4 experts."""
    _, stored = stored_weights(model)
    return _fill_from_stored(copy.deepcopy(model), stored)


def load_exported(model, folder: str | Path):
    """`model` (build_target's architecture) filled from an export_target folder: the shipped function,
    as quantised_copy gives it, read back from disk (a run continuing after the target was exported).
    Reads only the shards the index names, inside `folder`, through safetensors (no pickle)."""
    from safetensors.torch import load_file

    folder = Path(folder).resolve()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    stored: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        path = (folder / fname).resolve()
        if path.parent != folder:
            raise ValueError(f"{folder}/model.safetensors.index.json: shard {fname!r} is outside the folder")
        stored.update(load_file(str(path)))
    missing = set(model.state_dict()) - set(stored) - {
        k for k in model.state_dict() if ".mlp.experts." in k or k.endswith("rotary_emb.inv_freq")}
    if missing:
        raise ValueError(f"{folder}: the export lacks {sorted(missing)[:3]}")
    return _fill_from_stored(model, stored)


def _fill_from_stored(q, stored: dict[str, torch.Tensor]):
    """Copy the stored tensors (bf16 / fp32, INT4 experts dequantised) into model q, in place; returns q."""
    state = q.state_dict()
    with torch.no_grad():
        for name, t in stored.items():
            if name in state:
                state[name].copy_(t.float())
        for layer_i, layer in enumerate(q.model.layers):
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            for j in range(experts.gate_up_proj.shape[0]):
                p = f"model.layers.{layer_i}.mlp.experts.{j}."
                w = {k: dequantize_int4(stored[p + k + ".weight_packed"], stored[p + k + ".weight_scale"], INT4_GROUP)
                     for k in ("gate_proj", "up_proj", "down_proj")}
                experts.gate_up_proj[j].copy_(torch.cat([w["gate_proj"], w["up_proj"]]))
                experts.down_proj[j].copy_(w["down_proj"])
    return q


def export_target(model, out: str | Path, tokenizer_dir: str | Path, extra_files: dict[str, str]) -> Path:
    """Write the checkpoint (config.json, sharded safetensors + index, tokenizer, extra text files)
    to `out`, atomically; returns `out`."""
    out = Path(out)
    config, tensors = stored_weights(model)
    with staged_dir(out) as stage:
        write_sharded(stage, tensors.items(), SHARD_BYTES)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (stage / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}, indent=2) + "\n")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / f, stage / f)
        for fname, text in extra_files.items():
            (stage / fname).write_text(text)
    return out
