"""`kdtree` command line (typer): run, build, inspect, make-tiny.

Every command prints one line `error: ...` and exits 1 on bad input; `--json` prints one JSON object.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional


def bytecode_prefix(package_dir: Path | None, env: dict[str, str]) -> str | None:
    """Where this process should keep Python bytecode, or None to leave Python's default.

    Where site-packages has no writable __pycache__ (a read-only image: the H200's), Python compiles the
    bytecode of every module it imports at every start and cannot keep it (6 s of a 12 s `kdtree run` on the
    tiny model there); then $XDG_CACHE_HOME/kdtree/pycache (~/.cache/kdtree/pycache) keeps it, unless
    PYTHONPYCACHEPREFIX (or -X pycache_prefix) already chose a place.  package_dir: torch's package folder."""
    if sys.pycache_prefix is not None or env.get("PYTHONPYCACHEPREFIX") or package_dir is None:
        return None
    cache = package_dir / "__pycache__"
    if os.access(cache if cache.is_dir() else package_dir, os.W_OK):
        return None
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "kdtree" / "pycache")


def _keep_bytecode() -> None:
    """Applies bytecode_prefix before torch is imported (sys.pycache_prefix is read at every import; the
    environment variable carries it to rank and build subprocesses)."""
    spec = importlib.util.find_spec("torch")
    prefix = bytecode_prefix(Path(spec.origin).parent if spec and spec.origin else None, dict(os.environ))
    if prefix is not None and not sys.dont_write_bytecode:
        sys.pycache_prefix = prefix
        os.environ["PYTHONPYCACHEPREFIX"] = prefix


_keep_bytecode()

import typer  # noqa: E402  (after the bytecode prefix: typer imports a few hundred modules)
from typer._click.exceptions import UsageError  # noqa: E402
from typer.core import TyperGroup  # noqa: E402

from core.errors import KdtreeError  # noqa: E402


class _OneErrorPath(TyperGroup):
    """A command line typer cannot parse (a bad flag value, an unknown option, a missing argument) fails
    like every other error: one `error:` line (and {"error": ...} on stdout under --json), exit 1.  (typer
    vendors click: its parse errors are typer._click's UsageError.)"""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta["kdtree_json"] = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            _fail(exc.format_message(), ctx.meta.get("kdtree_json", False))


app = typer.Typer(cls=_OneErrorPath, add_completion=False, no_args_is_help=True,
                  help="Kimi K2.x inference with DDTree speculation.")


def _fail(msg: str, as_json: bool = False) -> None:
    """The one error path: `error: MSG` on stderr, {"error": MSG} on stdout under --json, exit 1."""
    typer.echo(f"error: {msg}", err=True)
    if as_json:
        typer.echo(json.dumps({"error": msg}))
    raise typer.Exit(1)


# API field -> this CLI's flag, for runtime/decode/params.InvalidParam (the one validation of decode arguments)
FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "spec": "--spec", "budget": "--budget",
         "seed": "--seed", "budget_curve": "--budget-curve"}


def _guard(fn, as_json: bool = False):
    """Turn expected user errors into one line and exit code 1 (JSON too under --json)."""
    from runtime.decode.params import InvalidParam

    try:
        return fn()
    except InvalidParam as exc:
        _fail(str(exc).replace(exc.name, FLAGS.get(exc.name, exc.name), 1), as_json)
    except (KdtreeError, ValueError) as exc:
        _fail(str(exc), as_json)
    except OSError as exc:  # a path that is a file, not a folder, unwritable, ...: the path and the reason
        _fail(f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc), as_json)


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
    spec: Optional[str] = typer.Option(None, "--spec", help="none (plain AR) | chain (DFlash) | ddtree; default "
                                       "ddtree with a drafter (--drafter or the artifact's), else none"),
    budget: Optional[str] = typer.Option(None, "--budget", help="ddtree: tree nodes per round besides the root, "
                                         "or auto / auto:B_MAX: chosen per round on the device among 1, 2, 4, ..., "
                                         "B_MAX (default 256) by expected tokens per second (default: auto on "
                                         "cuda, 16 on cpu)"),
    budget_curve: Optional[Path] = typer.Option(None, "--budget-curve", help="with --budget auto: the cost curve "
                                                "JSON to choose with (default: stored under the artifact's "
                                                "autotune/, else measured on first use and stored there)"),
    allow_special: bool = typer.Option(False, "--allow-special", help="read special-token strings in --prompt "
                                       "(<|im_end|>, ...) as control tokens; default: plain text"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="CUDA: replay captured graphs of a round"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks: starts one process per rank (or runs as one "
                           "rank of torchrun's)"),
    ep: bool = typer.Option(False, "--ep", help="with --tp: routed experts whole per rank (expert parallel)"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (fp32 on CPU, bf16 on CUDA) "
                              "| float32 | float64 | bfloat16"),
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
        from runtime.decode.params import SamplingParams, SpecConfig, default_budget
        from runtime.load.artifact import is_artifact

        if (prompt is None) == (prompt_ids is None):
            raise ValueError("give exactly one of --prompt and --prompt-ids")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        if dtype not in ("auto", "float32", "float64", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32, float64 or bfloat16, got {dtype!r}")
        if chat and prompt_ids is not None:
            raise ValueError("--chat wraps --prompt text; it does not apply to --prompt-ids")
        from runtime.decode.budget import CostCurve

        SamplingParams(max_new_tokens, temperature, seed)  # bad decode arguments fail before the load
        want = SpecConfig.of(spec or "ddtree", default_budget(device) if budget is None else budget)
        curve = CostCurve.load(budget_curve) if budget_curve is not None else None
        if curve is not None and not want.auto:
            raise ValueError("--budget-curve applies to --budget auto")
        if spec not in (None, "none") and drafter is None and not is_artifact(model_dir):
            raise ValueError(f"--spec {spec} needs --drafter DIR")
        if spec == "none" and drafter is not None:
            raise ValueError("--drafter is unused with --spec none (drop one of them)")
        if budget is not None and spec not in (None, "ddtree"):
            raise ValueError(f"--budget applies to --spec ddtree, not --spec {spec}")
        if budget is not None and spec is None and drafter is None and not (Path(model_dir) / "drafter").is_dir():
            raise ValueError("--budget applies to --spec ddtree, which needs a drafter (--drafter DIR)")
        # spec None: Engine.load's rule (ddtree with a drafter, else none), as from Python
        t_load = time.perf_counter()
        eng = Engine.load(model_dir, device=device, drafter=drafter, spec=spec, budget=budget,
                          graphs=graphs, progress=not as_json, tp=tp, ep=ep,
                          dtype=None if dtype == "auto" else getattr(torch, dtype), budget_curve=curve)
        load_s = round(time.perf_counter() - t_load, 3)
        if eng.rank != 0:  # under torchrun: every rank decodes, rank 0 alone prints
            sys.stdout = open(os.devnull, "w")
        tok = eng.tokenizer
        if tok is None:
            raise ValueError(f"{model_dir}: no tokenizer (expected tiktoken.model or tokenizer.json)")
        if prompt_ids is not None:
            ids = _parse_ids(prompt_ids)
        else:
            ids = tok.chat(prompt, allowed_special=allow_special) if chat else tok.encode(prompt, allow_special)
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
        st = {**eng.last_stats, "load_s": load_s}
        if as_json:
            typer.echo(json.dumps({"token_ids": out, "text": text, "stats": st}))
        else:
            typer.echo("")
            if st.get("tau") is not None and st.get("decode_tokens_per_s") is not None:
                typer.echo(f"{st['new_tokens']} tokens in {st['rounds']} rounds: tau {st['tau']:.2f} tokens/round, "
                           f"{st['decode_tokens_per_s']:.1f} tokens/s decode ({st.get('spec', '')}, {st['device']})",
                           err=True)
            typer.echo(json.dumps(st), err=True)

    _guard(go, as_json)


@app.command()
def bench(
    path: Path = typer.Argument(..., help="`kdtree build` artifact or checkpoint directory"),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter directory"),
    budgets: Optional[str] = typer.Option(None, "--budgets", help="DDTree budgets to measure (default 1,4,16,64; "
                                          "with --rank-only 1,2,4,...,256); auto or auto:B_MAX adds a row of the "
                                          "per-round choice"),
    budget_curve: Optional[Path] = typer.Option(None, "--budget-curve", help="the cost curve JSON of the auto "
                                                "rows (default: stored or measured, see kdtree run)"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="prompt text (default: a fixed sentence)"),
    out: Optional[Path] = typer.Option(None, "--out", help="write OUT/bench-<name>.json"),
    name: Optional[str] = typer.Option(None, "--name", help="result name (default: the model folder's name)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of the table"),
    rank_only: bool = typer.Option(False, "--rank-only", help="one TP rank at true size on one GPU: PATH is a "
                                   "--synthetic preset (drawn in GPU memory) or a synthetic artifact"),
    tp: int = typer.Option(8, "--tp", help="with --rank-only: the TP degree of the rank"),
    rank: int = typer.Option(0, "--rank", help="with --rank-only: which rank"),
    layers: Optional[int] = typer.Option(None, "--layers", help="with --rank-only and a preset: depth"),
    contexts: str = typer.Option("4096,32768", "--contexts", help="with --rank-only: cache lengths"),
) -> None:
    """AR vs chain vs DDTree tokens/s, tau, per-stage us, host overhead per round, graphs on vs off.
    With --rank-only: one rank's step, T(N), drafter and per-op profile at each cache length."""

    def go():
        import torch

        from runtime.bench import format_table, run_bench, write_result

        if rank_only:
            from runtime.bench_rank import bench_rank_cli

            return bench_rank_cli(str(path), tp, rank, layers, contexts, budgets, out, as_json)

        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available")
        from runtime.decode.budget import CostCurve
        from runtime.decode.params import InvalidParam, SpecConfig

        try:
            bs = tuple(SpecConfig.of("ddtree", b.strip()).budget_label for b in (budgets or "1,4,16,64").split(",")
                       if b.strip())
        except InvalidParam:
            raise ValueError(f"--budgets must be comma-separated integers >= 1 or auto[:B_MAX], got {budgets!r}") \
                from None
        if not bs:
            raise ValueError(f"--budgets must be integers >= 1 or auto[:B_MAX], got {budgets!r}")
        curve = CostCurve.load(budget_curve) if budget_curve is not None else None
        if curve is not None and not any(isinstance(b, str) for b in bs):
            raise ValueError("--budget-curve applies to auto rows: add auto to --budgets")
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if name is not None and (Path(name).name != name or name in ("", ".", "..")):
            raise ValueError(f"--name must be a plain file name (it lands in --out), got {name!r}")
        if out is not None and out.exists() and not out.is_dir():
            raise ValueError(f"--out {out}: exists and is not a folder")
        if budgets is not None and drafter is None and not (Path(path) / "drafter").is_dir():
            raise ValueError("--budgets needs a drafter (--drafter DIR, or an artifact built with one): without one "
                             "bench measures AR only")
        result = run_bench(path, drafter, bs, max_new_tokens, device, prompt, progress=not as_json, budget_curve=curve)
        if out is not None:
            written = write_result(result, out, name or Path(path).name)
            result["written"] = str(written)
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(format_table(result))
            if out is not None:
                typer.echo(f"wrote {result['written']}")

    _guard(go, as_json)


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

    _guard(go, as_json)


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
    warm: bool = typer.Option(True, "--warm/--no-warm", help="on a CUDA machine: decode the artifact in every "
                              "mode (AR, chain, DDTree at each budget) and ship the Triton kernels that compiled, "
                              "so `kdtree run` on a GPU of this arch compiles none (no effect without CUDA)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON summary"),
    force: bool = typer.Option(False, "--force", help="rebuild even on a cache hit; replace a non-artifact --out"),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="no checkpoint: one rank with random weights "
                                            "of a preset (kimi-k2.6 | tiny-kimi) written to --out"),
    rank: int = typer.Option(0, "--rank", help="with --synthetic: the rank to make"),
    layers: Optional[int] = typer.Option(None, "--layers", help="with --synthetic: depth (default the preset's)"),
    seed: int = typer.Option(0, "--seed", help="with --synthetic: weights seed"),
    draw_device: str = typer.Option("cpu", "--device", help="with --synthetic: draw on cpu or cuda (fast; other "
                                    "numbers than cpu for the same seed)"),
) -> None:
    """Build per-rank artifacts (sharded weights, ONNX graphs, AOT kernels) through the KDTREE_CACHE cache;
    with --synthetic PRESET, one rank of random weights in the same layout (build_pipeline/synthetic.py)."""

    def go():
        from build_pipeline.build import build

        if synthetic is not None:
            from build_pipeline.synthetic import build_synthetic

            if model_dir is not None or drafter is not None or ep or backend != "native":
                raise ValueError("--synthetic takes no MODEL_DIR, --drafter, --ep or --backend")
            if draw_device not in ("cpu", "cuda"):
                raise ValueError(f"--device must be cpu or cuda, got {draw_device!r}")
            res = build_synthetic(synthetic, out, tp=tp, rank=rank, layers=layers, seed=seed, progress=not as_json,
                                  force=force, device=draw_device)
            s = res.summary()
            layers_made = res.manifest["model"]["num_layers"]
            hit, detail = "unchanged", f"synthetic {synthetic} tp {tp} rank {rank}, {layers_made} layers"
        else:
            if model_dir is None:
                raise ValueError("give MODEL_DIR (or --synthetic PRESET)")
            res = build(model_dir, out=out, drafter_dir=drafter, tp=tp, ep=ep, backend=backend, archs=arch,
                        budgets=budgets, progress=not as_json, force=force, warm=warm)
            s = res.summary()
            hit, detail = "cache hit", f"tp {tp}{' ep' if ep else ''}, {s['graphs']} graphs, {s['kernels']} kernels"
        if as_json:
            typer.echo(json.dumps(s))
        else:
            typer.echo(f"{hit if res.cache_hit else 'built'} {s['artifact']} in {s['seconds']:.2f}s: {detail}, "
                       f"{s['bytes'] / 1e6:.1f} MB")

    _guard(go, as_json)


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

    _guard(go, as_json)


@app.command()
def serve(
    path: Path = typer.Argument(..., help="`kdtree build` artifact or checkpoint directory"),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter directory"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", help="0: any free port (the printed URL says which)"),
    tp: int = typer.Option(1, "--tp", help="tensor-parallel ranks (one process per rank)"),
    max_batch: int = typer.Option(8, "--max-batch", help="requests decoded together (continuous batching)"),
    max_queue: int = typer.Option(64, "--max-queue", help="requests waiting for a slot before 429"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="prompt + max_tokens per request "
                                                "(default min(max_position_embeddings, 4096))"),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="require `Authorization: Bearer KEY` on /v1/*"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    spec: Optional[str] = typer.Option(None, "--spec", help="default none | chain | ddtree (a request's `spec` "
                                       "field overrides it; default ddtree with a drafter, else none)"),
    budget: Optional[str] = typer.Option(None, "--budget", help="default DDTree budget: B, or auto / auto:B_MAX "
                                         "(chosen per round on the device; a request's `budget` overrides it; "
                                         "default: auto on cuda, 16 on cpu)"),
    graphs: bool = typer.Option(True, "--graphs/--no-graphs", help="CUDA: replay captured graphs of a round"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (fp32 on CPU, bf16 on CUDA) "
                              "| float32 | float64 | bfloat16"),
    name: Optional[str] = typer.Option(None, "--served-model-name", help="model id of /v1/models (default: "
                                       "the folder's name)"),
) -> None:
    """OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, streaming) with continuous batching."""

    def go():
        import torch

        from runtime.decode.params import default_budget, parse_budget
        from runtime.serve.server import serve as run_server

        if device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        if dtype not in ("auto", "float32", "float64", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32, float64 or bfloat16, got {dtype!r}")
        if not 0 <= port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {port}")
        size, auto = parse_budget(default_budget(device) if budget is None else budget)  # a bad one fails here
        code = run_server(path, drafter, host, port, tp, max_batch, max_queue, max_model_len, api_key, device, spec,
                          f"auto:{size}" if auto else size, graphs, None if dtype == "auto" else getattr(torch, dtype),
                          name, echo=typer.echo)
        raise typer.Exit(code)

    _guard(go)


if __name__ == "__main__":
    app()
