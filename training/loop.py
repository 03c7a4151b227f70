"""The resumable training loop of both phases (target, then drafter), plus data and logging.

Determinism: every step's batch comes from a generator seeded by (seed, phase, step), the models are
initialised from the seed, and a checkpoint holds the parameters, buffers (router biases), the
optimiser state and the log rows so far; a run resumed from step n therefore replays steps n+1.. as
the uninterrupted run did (bitwise on the CPU).  `stop_at` ends a phase early without changing its
schedule (what an interruption looks like; the tests use it).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from core.progress import Progress


@dataclass
class Phase:
    """One optimisation phase.  step_fn(batch_generator, step) -> (loss tensor, {extra log values})."""
    name: str
    params: list[torch.nn.Parameter]
    state: Callable[[], dict]  # what to checkpoint besides the optimiser (model state_dict)
    load_state: Callable[[dict], None]
    step_fn: Callable[[torch.Generator, int], tuple[torch.Tensor, dict]]
    lr: float
    warmup: int
    steps: int
    weight_decay: float = 0.1
    after_step: Callable[[], dict] | None = None  # e.g. router balancing; returns extra log values
    eval_fn: Callable[[], dict] | None = None
    rows: list[dict] = field(default_factory=list)


def lr_at(step: int, base: float, warmup: int, total: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine from base to base / 10 at `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(total - warmup, 1)
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def step_generator(seed: int, phase: str, step: int) -> torch.Generator:
    salt = sum((i + 1) * ord(ch) for i, ch in enumerate(phase))
    return torch.Generator().manual_seed(seed * 1_000_003 + salt * 10_007 + step)


def run_phase(ph: Phase, ckpt_dir: Path, seed: int, ckpt_every: int, eval_every: int,
              stop_at: int | None = None, progress: bool = True, log: Callable[[str], None] = print) -> list[dict]:
    """Run (or resume) a phase to ph.steps (or stop_at); returns its log rows."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / f"{ph.name}.pt"
    opt = torch.optim.AdamW(ph.params, lr=ph.lr, betas=(0.9, 0.95), weight_decay=ph.weight_decay)
    start = 0
    if ckpt.is_file():
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)
        ph.load_state(saved["model"])
        opt.load_state_dict(saved["opt"])
        start, ph.rows = saved["step"], saved["rows"]
        log(f"[{ph.name}] resumed from step {start} ({ckpt})")
    end = ph.steps if stop_at is None else min(stop_at, ph.steps)
    bar = Progress(end - start, f"train {ph.name}", enabled=progress and end > start)
    t0 = time.monotonic()
    for step in range(start, end):
        lr = lr_at(step, ph.lr, ph.warmup, ph.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss, extra = ph.step_fn(step_generator(seed, ph.name, step), step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = float(torch.nn.utils.clip_grad_norm_(ph.params, 1.0))
        opt.step()
        row = {"step": step + 1, "loss": round(float(loss.detach()), 5), "lr": lr, "grad_norm": round(grad, 4),
               "elapsed_s": round(time.monotonic() - t0, 2), **extra}
        if ph.after_step is not None:
            row.update(ph.after_step())
        if ph.eval_fn is not None and ((step + 1) % eval_every == 0 or step + 1 == ph.steps):
            row.update(ph.eval_fn())
        ph.rows.append(row)
        bar.desc = f"{ph.name} {row['loss']:.3f}"
        bar.advance()
        if (step + 1) % ckpt_every == 0 or step + 1 == end:
            _save(ckpt, {"model": ph.state(), "opt": opt.state_dict(), "step": step + 1, "rows": ph.rows})
    bar.close()
    return ph.rows


def _save(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# ---- data
def encode_split(tok, docs: list[tuple[str, str]], eos: int) -> np.ndarray:
    """The documents' tokens, each followed by eos, as one uint16 array (vocabularies < 65536)."""
    out: list[int] = []
    for _, text in docs:
        out += tok.encode(text)
        out.append(eos)
    return np.asarray(out, dtype=np.uint16)


def random_windows(tokens: np.ndarray, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, length] int64 windows at seeded random offsets."""
    if len(tokens) <= length:
        raise ValueError(f"{len(tokens)} tokens do not hold a window of {length}")
    starts = torch.randint(0, len(tokens) - length, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64))


def fixed_windows(tokens: np.ndarray, length: int, max_windows: int) -> torch.Tensor:
    """Up to max_windows consecutive non-overlapping [length] windows from the start (the eval set)."""
    n = min(max_windows, len(tokens) // length)
    if n == 0:
        raise ValueError(f"{len(tokens)} eval tokens do not hold one window of {length}")
    return torch.from_numpy(tokens[: n * length].astype(np.int64).reshape(n, length))


# ---- log and plot
def write_log(rows_by_phase: dict[str, list[dict]], out: Path) -> Path:
    path = out / "loss.jsonl"
    with open(path, "w") as f:
        for phase, rows in rows_by_phase.items():
            f.writelines(json.dumps({"phase": phase, **row}) + "\n" for row in rows)
    return path


def read_log(out: Path) -> dict[str, list[dict]]:
    """write_log's rows back, by phase ({} when there is no log)."""
    path, rows = out / "loss.jsonl", {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row.pop("phase"), []).append(row)
    return rows


def plot_losses(rows_by_phase: dict[str, list[dict]], path: Path) -> str | None:
    """A PNG of the train (and eval) loss of each phase; None and a note when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no loss plot (pip install matplotlib)"
    phases = [p for p, rows in rows_by_phase.items() if rows]
    fig, axes = plt.subplots(1, max(len(phases), 1), figsize=(6 * max(len(phases), 1), 4), squeeze=False)
    for ax, phase in zip(axes[0], phases):
        rows = rows_by_phase[phase]
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=0.8, label="train")
        ev = [r for r in rows if "eval_loss" in r]
        if ev:
            ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="held-out")
        ax.set(title=f"{phase} loss", xlabel="step", ylabel="cross-entropy (nats)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
