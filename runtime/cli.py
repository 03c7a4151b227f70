"""`kdtree` command line (typer): run, inspect, make-tiny.

Every command prints one line `error: ...` and exits 1 on bad input; `--json` prints one JSON object.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from build_pipeline.errors import KdtreeError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Kimi K2.x inference with DDTree speculation.")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(1)


def _guard(fn):
    """Turn expected user errors into one line and exit code 1."""
    try:
        return fn()
    except (KdtreeError, ValueError, FileExistsError, FileNotFoundError) as exc:
        _fail(str(exc))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


@app.command()
def run(
    model_dir: Path = typer.Argument(..., help="checkpoint directory (config.json, *.safetensors, tokenizer)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt text"),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="prompt token ids, e.g. 1,2,3"),
    chat: bool = typer.Option(False, "--chat", help="wrap --prompt in Kimi's chat markers"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter directory"),
    spec: str = typer.Option("none", "--spec", help="none (plain AR) | chain (DFlash) | ddtree"),
    budget: int = typer.Option(16, "--budget", help="ddtree: tree nodes per round besides the root"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Generate from a prompt: plain AR, or speculative (--spec chain|ddtree with --drafter)."""

    def go():
        import torch

        from runtime.drafter import load_target_and_drafter
        from runtime.generate import SamplingParams, Stats, generate_ar
        from runtime.model import load_target
        from runtime.spec import SpecConfig, SpecStats, generate_spec
        from runtime.tokenizer import StreamDecoder, Tokenizer

        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of --prompt and --prompt-ids")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        if spec not in ("none", "chain", "ddtree"):
            raise ValueError(f"--spec must be none, chain or ddtree, got {spec!r}")
        if spec != "none" and drafter is None:
            raise ValueError(f"--spec {spec} needs --drafter DIR")
        spec_cfg = SpecConfig(spec, budget) if spec != "none" else None
        tok = Tokenizer.load(model_dir)
        if prompt_ids is not None:
            ids = _parse_ids(prompt_ids)
        else:
            ids = tok.chat(prompt) if chat else tok.encode(prompt)
        if spec_cfg is None:
            model, draft_model = load_target(model_dir, device=device, progress=not as_json), None
        else:
            model, draft_model = load_target_and_drafter(model_dir, drafter, device=device, progress=not as_json)
        bad = [i for i in ids if not 0 <= i < model.cfg.vocab_size]
        if bad:
            raise ValueError(f"--prompt-ids: ids {bad[:5]} outside the vocabulary [0, {model.cfg.vocab_size})")
        stops = tok.stop_ids(model.cfg.eos_token_ids)
        params = SamplingParams(max_new_tokens, temperature, seed, stops)
        if spec_cfg is None:
            stats: Stats = Stats()
            stream = generate_ar(model, ids, params, stats)
        else:
            stats = SpecStats()
            stream = generate_spec(model, draft_model, ids, params, spec_cfg, stats)
        out: list[int] = []
        text_out = StreamDecoder(tok, skip=stops)
        for t in stream:
            out.append(t)
            if not as_json:
                sys.stdout.write(text_out.push(t))
                sys.stdout.flush()
        text = tok.decode([t for t in out if t not in stops])
        if not as_json:
            sys.stdout.write(text_out.flush())
        if as_json:
            typer.echo(json.dumps({"token_ids": out, "text": text, "stats": stats.as_dict()}))
        else:
            typer.echo("")
            typer.echo(json.dumps(stats.as_dict()), err=True)

    _guard(go)


@app.command()
def inspect(model_dir: Path = typer.Argument(...), as_json: bool = typer.Option(False, "--json")) -> None:
    """Print the parsed config, parameter count and memory by component (config.json only)."""

    def go():
        from build_pipeline.config import load_config
        from build_pipeline.model_stats import component_bytes, component_params, kv_bytes_per_token

        cfg = load_config(model_dir)
        params, nbytes = component_params(cfg), component_bytes(cfg)
        report = {"config": cfg.to_dict(), "params": params, "total_params": sum(params.values()),
                  "bytes": nbytes, "total_bytes": sum(nbytes.values()),
                  "kv_cache_bytes_per_token": kv_bytes_per_token(cfg)}
        if as_json:
            typer.echo(json.dumps(report))
            return
        typer.echo(f"model_type {cfg.model_type}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                   f"{cfg.num_heads} heads, {cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), "
                   f"vocab {cfg.vocab_size}, quant {cfg.quant.kind if cfg.quant else 'none'}")
        typer.echo(f"{'component':<16}{'params':>18}{'GB':>10}")
        for k in params:
            typer.echo(f"{k:<16}{params[k]:>18,}{nbytes[k] / 1e9:>10.3f}")
        typer.echo(f"{'total':<16}{report['total_params']:>18,}{report['total_bytes'] / 1e9:>10.3f}")
        typer.echo(f"latent KV cache: {report['kv_cache_bytes_per_token']:,} bytes per token (bf16)")

    _guard(go)


@app.command("make-tiny")
def make_tiny_cmd(
    out: Path = typer.Argument(..., help="output directory"),
    drafter_for: Optional[Path] = typer.Option(None, "--drafter-for", help="write a DFlash drafter for this target"),
    preset: str = typer.Option("kimi", "--preset", help="kimi | small | grouped | no-q-lora | dense2"),
    int4: bool = typer.Option(False, "--int4", help="routed experts INT4 (compressed-tensors pack-quantized)"),
    kimi25: bool = typer.Option(False, "--kimi25", help="Kimi K2.5/K2.6 multimodal layout"),
    dialect: str = typer.Option("hf", "--dialect", help="config dialect: hf or kimi_k2"),
    seed: int = typer.Option(0, "--seed"),
    force: bool = typer.Option(False, "--force", help="replace OUT if it exists"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Write a tiny random model in the exact real checkpoint layout (plus a small tokenizer), or with
    --drafter-for TARGET a tiny random DFlash drafter for that target."""

    def go():
        from build_pipeline.tiny import make_tiny
        from build_pipeline.tiny_drafter import make_tiny_drafter

        if drafter_for is not None:
            path = make_tiny_drafter(drafter_for, out, seed=seed, force=force)
            info = {"out": str(path), "drafter_for": str(drafter_for)}
        else:
            path = make_tiny(out, preset=preset, int4=int4, kimi25=kimi25, dialect=dialect, seed=seed, force=force)
            info = {"out": str(path), "preset": preset, "int4": int4, "kimi25": kimi25}
        if as_json:
            typer.echo(json.dumps(info))
        else:
            typer.echo(f"wrote {path}")

    _guard(go)


if __name__ == "__main__":
    app()
