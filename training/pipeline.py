"""`train_demo`: corpus -> tokenizer -> target -> INT4 export -> drafter -> export -> tau, under one folder.

Each stage skips what a previous run finished (corpus manifest, tokenizer, token arrays, exported
models) and the two training phases resume from their checkpoints, so re-running the same command
continues an interrupted run.  Layout of `out`:
  corpus/            shards, manifest.json, LICENSE-corpus.txt
  tokenizer/         tokenizer.json, tokenizer_config.json
  tokens-{train,eval}.npy
  ckpt/              target.pt, drafter.pt (resumable state)
  target-report.json the target's held-out losses, written with its export: a run that finds both
                     continues from the export (the drafter phase needs no target checkpoint, so the
                     two phases can run on different machines or calls)
  target/, drafter/  the shipped pair (the real layouts; `Engine.load(target, drafter=drafter)`)
  loss.jsonl, loss.png, report.json
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from core.fingerprint import embedding_fingerprint
from training import corpus as corpus_mod
from training.drafter import (
    TrainableDrafter,
    dflash_loss,
    drafter_config,
    expected_chain_tau,
    export_drafter,
    sample_anchors,
)
from training.loop import (
    Phase,
    encode_split,
    fixed_windows,
    plot_losses,
    random_windows,
    read_log,
    run_phase,
    write_log,
)
from training.recipe import Recipe
from training.target import (
    RouterBalance,
    build_target,
    export_target,
    lm_loss,
    load_exported,
    quantised_copy,
    tap_features,
)
from training.tokenizer import MASK, special_ids, train_tokenizer


def train_demo(out: str | Path, recipe: Recipe, steps: int, drafter_steps: int, device: str = "cpu", seed: int = 0,
               ckpt_every: int = 100, eval_every: int = 100, eval_windows: int = 64, stop_at: int | None = None,
               corpus_root: Path | None = None, measure: bool = True, progress: bool = True,
               stop_at_phase: str | None = None,
               log: Callable[[str], None] = print) -> dict:
    """Run (or resume) the whole recipe; returns report.json's content.  stop_at: end the current
    phase at that step (an interruption, for the resume test); stop_at_phase="target": stop once the
    target is exported (a later run, here or elsewhere, trains the drafter on that export)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    dev = torch.device(device)
    autocast = dev.type == "cuda"
    cdir, tdir = out / "corpus", out / "tokenizer"
    if not (cdir / "manifest.json").is_file():
        m = corpus_mod.build_corpus(cdir, corpus_root)
        log(f"corpus: {m['train_files']} train files ({m['train_chars']:,} chars), {m['eval_files']} held out")
    manifest = json.loads((cdir / "manifest.json").read_text())
    if not (tdir / "tokenizer_config.json").is_file():
        train_tokenizer((t for _, t in corpus_mod.read_split(cdir, "train")), recipe.vocab, tdir)
    from core.tokenizer import Tokenizer

    tok = Tokenizer.load(tdir)
    if tok.vocab_size != recipe.vocab:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens, the recipe wants {recipe.vocab}")
    specials = special_ids(tdir)
    arrays = {}
    for split in ("train", "eval"):
        path = out / f"tokens-{split}.npy"
        if not path.is_file():
            np.save(path, encode_split(tok, corpus_mod.read_split(cdir, split), specials["[EOS]"]))
        arrays[split] = np.load(path)
    log(f"tokens: train {len(arrays['train']):,}, eval {len(arrays['eval']):,}")
    eval_ids = fixed_windows(arrays["eval"], recipe.seq_len + 1, eval_windows).to(dev)

    # ---- target
    model = build_target(recipe, specials, seed).to(dev)

    def eval_target(m=model) -> dict:
        m.eval()
        with torch.no_grad():
            chunks = eval_ids.split(8)  # [<= 8, l] each: the mean over windows, weighted by chunk size
            loss = sum(float(lm_loss(m, c, autocast)) * len(c) for c in chunks) / len(eval_ids)
        m.train()
        return {"eval_loss": round(loss, 5)}

    report: dict = {"recipe": recipe.__dict__, "seed": seed, "device": device, "corpus": {
        k: manifest[k] for k in ("python_version", "held_out_modules", "train_files", "eval_files", "sha256")},
        "tokens": {k: len(v) for k, v in arrays.items()}}
    exported, target_report = out / "target", out / "target-report.json"
    if (exported / "config.json").is_file() and target_report.is_file():
        # the target was trained and exported by an earlier run (possibly on another machine, without
        # its optimiser checkpoint): continue from the export, which is what the drafter trains on anyway
        report["target"] = json.loads(target_report.read_text())
        if report["target"]["steps"] != steps:
            raise ValueError(f"{exported} was exported after {report['target']['steps']} target steps, not "
                             f"--steps {steps}: remove it (and {target_report.name}) to train again")
        shipped = load_exported(model, exported).eval()
        rows = {"target": read_log(out).get("target", []), "drafter": []}
        log(f"target: continuing from {exported} ({steps} steps)")
    else:
        balance = RouterBalance(model, recipe.bias_update)

        def target_step(gen: torch.Generator, step: int):
            ids = random_windows(arrays["train"], recipe.batch, recipe.seq_len + 1, gen).to(dev)
            return lm_loss(model, ids, autocast), {}

        tphase = Phase("target", list(model.parameters()), model.state_dict, model.load_state_dict, target_step,
                       recipe.lr, recipe.warmup, steps, recipe.weight_decay,
                       after_step=lambda: {"max_load": round(balance.update(), 3)}, eval_fn=eval_target)
        model.train()
        rows = {"target": run_phase(tphase, out / "ckpt", seed, ckpt_every, eval_every, stop_at, progress, log),
                "drafter": []}
        if stop_at is not None and stop_at < steps:
            write_log(rows, out)
            return report
        model.eval()
        shipped = quantised_copy(model)
        report["target"] = {"steps": steps, "eval_loss_trained": eval_target()["eval_loss"],
                            "eval_loss_int4_shipped": eval_target(shipped)["eval_loss"],
                            "bytes_estimate": recipe.target_bytes()}
        log(f"target held-out loss: trained {report['target']['eval_loss_trained']:.4f}, "
            f"as shipped (bf16 + INT4 experts) {report['target']['eval_loss_int4_shipped']:.4f}")
        license_text = corpus_mod.license_note(tuple(manifest["held_out_modules"]))
        export_target(model, exported, tdir, {"LICENSE-corpus.txt": license_text})
        write_log(rows, out)
        target_report.write_text(json.dumps(report["target"], indent=2) + "\n")
    if stop_at_phase == "target":
        return report

    # ---- drafter, trained on the features of the target as shipped
    for p in shipped.parameters():
        p.requires_grad_(False)
    dconf = drafter_config(recipe, json.loads(shipped.config.to_json_string()), specials[MASK])
    drafter = TrainableDrafter(dconf, recipe.hidden, seed).to(dev)
    layer_ids = tuple(dconf["dflash_config"]["target_layer_ids"])
    embed, head = shipped.model.embed_tokens.weight, shipped.lm_head.weight
    weights = recipe.pos_weights()

    def drafter_batch(ids: torch.Tensor, anchors: torch.Tensor):
        feats = tap_features(shipped, ids, layer_ids, autocast)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            logits = drafter(feats, ids, anchors, embed, head)
        return dflash_loss(logits, ids, anchors, weights)

    def drafter_step(gen: torch.Generator, step: int):
        ids = random_windows(arrays["train"], recipe.batch, recipe.seq_len, gen).to(dev)
        anchors = sample_anchors(recipe.batch, recipe.seq_len, recipe.anchors, recipe.block, gen).to(dev)
        loss, acc = drafter_batch(ids, anchors)
        return loss, {"acc1": round(float(acc[0]), 4)}

    def eval_drafter() -> dict:
        gen = torch.Generator().manual_seed(seed)
        ids = eval_ids[:, :-1]
        anchors = sample_anchors(len(ids), ids.shape[1], recipe.anchors, recipe.block, gen).to(dev)
        with torch.no_grad():
            loss, acc = drafter_batch(ids, anchors)
        return {"eval_loss": round(float(loss), 5), "eval_acc_by_depth": [round(a, 4) for a in acc.tolist()],
                "eval_chain_tau_proxy": round(expected_chain_tau(acc), 3)}

    dphase = Phase("drafter", list(drafter.parameters()), drafter.state_dict, drafter.load_state_dict, drafter_step,
                   recipe.d_lr, recipe.warmup, drafter_steps, recipe.weight_decay, eval_fn=eval_drafter)
    rows["drafter"] = run_phase(dphase, out / "ckpt", seed, ckpt_every, eval_every, None, progress, log)
    report["drafter"] = {"steps": drafter_steps, **(rows["drafter"][-1] if rows["drafter"] else {}),
                         "bytes_estimate": recipe.drafter_bytes()}
    export_drafter(drafter, out / "drafter", embedding_fingerprint(embed))
    write_log(rows, out)
    note = plot_losses(rows, out / "loss.png")
    if note:
        log(note)
        report["plot"] = note
    if measure:
        from training.measure import heldout_prompts, measure_pair

        prompts = heldout_prompts(cdir, 4)
        report["measure"] = measure_pair(out / "target", out / "drafter", prompts, [4, 16, 64], [0.0],
                                         max_new_tokens=48)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
