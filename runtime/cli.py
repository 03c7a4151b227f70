"""`kdtree` command line (typer): run, build, inspect, make-tiny.

Every command prints one line `error: ...` and exits 1 on bad input; `--json` prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from core.errors import KdtreeError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Kimi K2.x inference with DDTree speculation.")


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(1)


# API field -> this CLI's flag, for runtime/decode/params.InvalidParam (the one validation of decode arguments)
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "spec": "--spec", "budget": "--budget"}


def _guard(fn):
    """Turn expected user errors into one line and exit code 1."""
    from runtime.decode.params import InvalidParam

    try:
        return fn()
    except InvalidParam as exc:
        _fail(str(exc).replace(exc.name, FLAGS.get(exc.name, exc.name), 1))
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
    model_dir: Path = typer.Argument(..., help="`kdtree build` artifact or checkpoint directory"),
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
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="CUDA: replay captured graphs of a round"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks: starts one process per rank (or runs as one "
                           "rank of torchrun's)"),
    ep: bool = typer.Option(False, "--ep", help="with --tp: routed experts whole per rank (expert parallel)"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (fp32 on CPU, bf16 on CUDA) | float32 | float64 | bfloat16"),
    build: bool = typer.Option(False, "--build", help="take a checkpoint dir through `kdtree build`'s cache "
                               "(built once, then a cache hit) and run the artifact; every load of a checkpoint "
                               "dir does, so the flag only says it"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Generate from a prompt: plain AR, or speculative (--spec chain|ddtree with --drafter)."""

    def go():
        import torch

        from core.tokenizer import StreamDecoder
        from runtime import Engine
        from runtime.decode.params import SamplingParams, SpecConfig
        from runtime.load.artifact import is_artifact

        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of --prompt and --prompt-ids")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        if dtype not in ("auto", "float32", "float64", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32, float64 or bfloat16, got {dtype!r}")
        SamplingParams(max_new_tokens, temperature, seed)  # bad decode arguments fail before the load
        SpecConfig(spec, budget)
        if spec != "none" and drafter is None and not is_artifact(model_dir):
            raise ValueError(f"--spec {spec} needs --drafter DIR")
        eng = Engine.load(model_dir, device=device, drafter=drafter, spec=spec, budget=budget, graphs=graphs,
                          progress=not as_json, tp=tp, ep=ep,
                          dtype=None if dtype == "auto" else getattr(torch, dtype))
        if eng.rank != 0:  # under torchrun: every rank decodes, rank 0 alone prints
            sys.stdout = open(os.devnull, "w")
        tok = eng.tokenizer
        if tok is None:
            raise ValueError(f"{model_dir}: no tokenizer (expected tiktoken.model or tokenizer.json)")
        if prompt_ids is not None:
            ids = _parse_ids(prompt_ids)
        else:
            ids = tok.chat(prompt) if chat else tok.encode(prompt)
        bad = [i for i in ids if not 0 <= i < eng.cfg.vocab_size]
        if bad:
            raise ValueError(f"--prompt-ids: ids {bad[:5]} outside the vocabulary [0, {eng.cfg.vocab_size})")
        stops, _ = eng.stop_ids()
        stream = eng.generate_ids(ids, max_new_tokens, temperature, seed=seed)
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
            typer.echo(json.dumps({"token_ids": out, "text": text, "stats": eng.last_stats}))
        else:
            typer.echo("")
            typer.echo(json.dumps(eng.last_stats), err=True)

    _guard(go)


@app.command()
def bench(
    path: Path = typer.Argument(..., help="`kdtree build` artifact or checkpoint directory"),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter directory"),
    budgets: str = typer.Option("1,4,16,64", "--budgets", help="DDTree budgets to measure"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt text (default: a fixed sentence)"),
    out: Optional[Path] = typer.Option(None, "--out", help="write OUT/bench-<name>.json"),
    name: Optional[str] = typer.Option(None, "--name", help="result name (default: the model folder's name)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of the table"),
) -> None:
    """AR vs chain vs DDTree tokens/s, tau, per-stage us, host overhead per round, graphs on vs off."""

    def go():
        import torch

        from runtime.bench import format_table, run_bench, write_result

        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        try:
            bs = tuple(int(b) for b in budgets.split(",") if b.strip())
        except ValueError:
            raise ValueError(f"--budgets must be comma-separated integers, got {budgets!r}") from None
        if not bs or min(bs) < 1:
            raise ValueError(f"--budgets must be integers >= 1, got {budgets!r}")
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        result = run_bench(path, drafter, bs, max_new_tokens, device, prompt, progress=not as_json)
        if out is not None:
            written = write_result(result, out, name or Path(path).name)
            result["written"] = str(written)
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(format_table(result))
            if out is not None:
                typer.echo(f"wrote {result['written']}")

    _guard(go)


@app.command()
def inspect(model_dir: Path = typer.Argument(...), as_json: bool = typer.Option(False, "--json")) -> None:
    """Print the parsed config, parameter count and memory by component (config.json only)."""

    def go():
        from core.config import load_config
        from core.model_stats import component_bytes, component_params, kv_bytes_per_token

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


@app.command("build")
def build_cmd(
    model_dir: Optional[Path] = typer.Argument(None, help="checkpoint directory (config.json, *.safetensors, "
                                               "tokenizer); omitted with --synthetic"),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter directory (copied into ART)"),
    out: Optional[Path] = typer.Option(None, "--out", help="artifact folder (default: the cache entry)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks"),
    ep: bool = typer.Option(False, "--ep", help="routed experts whole per rank (expert parallel)"),
    backend: str = typer.Option("native", "--backend", help="native | tensorrt"),
    arch: str = typer.Option("sm_90", "--arch", help="CUDA archs to compile for, e.g. sm_90,sm_120 (or none)"),
    budgets: str = typer.Option("16,32,64", "--budgets", help="tree budgets to specialise kernels for"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON summary"),
    force: bool = typer.Option(False, "--force", help="rebuild even on a cache hit; replace a non-artifact --out"),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="no checkpoint: one rank with random weights "
                                            "of a preset (kimi-k2.6 | tiny-kimi) written to --out"),
    rank: int = typer.Option(0, "--rank", help="with --synthetic: the rank to make"),
    layers: Optional[int] = typer.Option(None, "--layers", help="with --synthetic: depth (default the preset's)"),
    seed: int = typer.Option(0, "--seed", help="with --synthetic: weights seed"),
) -> None:
    """Build per-rank artifacts (sharded weights, ONNX graphs, AOT kernels) through the KDTREE_CACHE cache;
    with --synthetic PRESET, one rank of random weights in the same layout (build_pipeline/synthetic.py)."""

    def go():
        from build_pipeline.build import build

        if synthetic is not None:
            from build_pipeline.synthetic import build_synthetic

            if model_dir is not None or drafter is not None or ep or backend != "native":
                raise ValueError("--synthetic takes no MODEL_DIR, --drafter, --ep or --backend")
            res = build_synthetic(synthetic, out, tp=tp, rank=rank, layers=layers, seed=seed, progress=not as_json,
                                  force=force)
            s = res.summary()
            layers_made = res.manifest["model"]["num_layers"]
            hit, detail = "unchanged", f"synthetic {synthetic} tp {tp} rank {rank}, {layers_made} layers"
        else:
            if model_dir is None:
                raise ValueError("give MODEL_DIR (or --synthetic PRESET)")
            res = build(model_dir, out=out, drafter_dir=drafter, tp=tp, ep=ep, backend=backend, archs=arch,
                        budgets=budgets, progress=not as_json, force=force)
            s = res.summary()
            hit, detail = "cache hit", f"tp {tp}{' ep' if ep else ''}, {s['graphs']} graphs, {s['kernels']} kernels"
        if as_json:
            typer.echo(json.dumps(s))
        else:
            typer.echo(f"{hit if res.cache_hit else 'built'} {s['artifact']} in {s['seconds']:.2f}s: {detail}, "
                       f"{s['bytes'] / 1e6:.1f} MB")

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
