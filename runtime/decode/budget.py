"""Budget per round (`--budget auto`): the cost curve, and the bucket each round verifies, chosen on the device.

A DDTree round builds its tree at B_max, the session's budget.  Nodes come in score order and the tree of
budget b is the first b + 1 of them (plugins/tree_build/reference.py), so a round may verify any prefix.
Buckets: b in 1, 2, 4, ..., B_max (the powers of two below B_max, then B_max).  For bucket b the round
expects

  E(b) = sum over live requests of (1 + s_b * sum_{i=1..b} exp(score_i))    score_i: node i's path log-prob

tokens (the drafter's own estimate: node i's path is accepted with the probability the drafter gives
it, the bonus always comes; s_b scales it) at a cost of T(b) + C µs: T(b) the verify, accept and commit
of b + 1 nodes per request, C the rest of the round (drafter, tree_build at B_max, this choice, fixed
costs).  The round verifies argmax_b E(b) / (T(b) + C), ties to the smaller bucket.  kdtree::budget_select
(plugins/budget_choice: the torch reference, one Triton program on CUDA) computes it on the device, with
no host read, so a captured round picks its own bucket: one CUDA-graph SWITCH node over the
buckets (runtime/decode/conditional.py; one IF node per bucket where a driver refuses it);
kdtree::budget_observe updates the calibration below.

s_b calibrates the drafter per bucket: its probabilities are not the target's acceptance (at T = 0 a
node is accepted when it is the target's argmax, whatever probability the drafter gave it; an
under-confident drafter would make every round verify too small a tree, and one whose deep nodes are
over-confident too large a one).  A round that verified bucket B measures every bucket b <= B: nodes
come in score order with parents first, so the accepted path's nodes with index <= b are exactly what
the tree of b nodes would have accepted (at T = 0).  Per bucket, the accepted and the predicted extra
tokens (beyond the bonus, summed over requests) go into two decayed sums (DECAY per measuring round,
both starting at 1); s_b is their ratio, within [S_MIN, S_MAX]; a bucket no round has measured yet
takes the largest measured bucket's s below it (1 if none).  Kept on the device with the rest.

The tree actually built (the cap): tree_build's cost grows with the budget it builds (its stage 2 works
on B_PAD-wide rows), so building B_max when the rounds verify far less wastes time every round.  A
session therefore holds one head per bucket j (the cap: the tree built at buckets[j], its prefixes
verifiable), with C_j its cost (the curve's head_us).  A full round (cap B_max) also scores every cap:
the bucket the round would have picked under cap j (argmax over b <= B_j of E(b) / (T(b) + C_j)), its
calibrated expected tokens and its µs go into decayed sums per cap (DECAY per full round); the hint is
the cap with the most tokens per µs, ties to the larger.  The host reads the hint with the round's
tokens (out column a + 5) and runs the next rounds' head at that cap, except every EXPLORE-th round,
which builds the full tree (the only rounds that can see what a larger cap would gain).  Without
head_us every cap costs C: capping never pays and every round builds B_max.

CostCurve: the buckets, T per bucket and C in µs (C_j per cap when measured), and where they came from;
its JSON is {"buckets": [...], "verify_us": [...], "fixed_us": C, "head_us": [...], "source": "..."}
(head_us optional: C_j, the round without verify when the tree is built at bucket j; fixed_us is C at
the largest bucket).  A session takes the curve
it is given, else ART/autotune/<curve_name>/curve.json, else measures its own and stores it there
when the artifact folder is writable (runtime/decode/autotune.py).  Buckets missing from a curve are
interpolated linearly in b (`verify_at`, `head_at`); a bucket beyond its range is an error.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import KdtreeError
from core.staging import staged_dir
from plugins.budget_choice import budget_observe, budget_select, calibration  # the math: plugins/budget_choice

AUTOTUNE_DIR = "autotune"  # beside the artifact's manifest; not listed in it (measured at run time)
CURVE_FILE = "curve.json"
EXPLORE = 8  # every EXPLORE-th round builds the full tree (the caps are scored on those rounds only)
MIN_CAP = 8  # the smallest bucket a tree is capped at (smaller trees save little; each cap is one more graph)


class CurveError(KdtreeError):
    """A cost curve (JSON or in memory) is malformed; the message names the file and key."""


def default_buckets(b_max: int) -> tuple[int, ...]:
    """1, 2, 4, ... below b_max, then b_max.

    Measured, not (yet) taken: buckets of 2^k - 1 nodes from 7 up (a round of 2^k tokens fills the attention's
    64-row blocks and the 8-token tiles that 2^k + 1 tokens pad).  K2.6 rank at 40 layers, H100
    (benchmarks/results/k26-switches-h100.json call 7): T(7) / T(8) 0.895, T(15) / T(16) 0.915, T(31) / T(32) 0.936
    at a 32K cache, 0.988 / 0.990 / 0.981 at 4K; the dropped node costs 1.6 % of tau at 8 and 16, none at 32 (demo
    pair, budget-aligned.json): tokens/s +7 to +10 % at 32K, -0.4 to +2.3 % at 4K.  benchmarks/budget_auto.py with
    those buckets (its curve interpolated at 2^k - 1: exact at 4K, blind to the 32K gain) put auto at 0.951-0.984 of
    the best fixed budget against 0.977-1.079 with these; both families at once (auto choosing per round) would
    need the GPU's measure of twice the graphs and caps."""
    if b_max < 1:
        raise ValueError(f"budget auto: the largest bucket must be >= 1, got {b_max}")
    out, b = [], 1
    while b < b_max:
        out.append(b)
        b *= 2
    return (*out, b_max)


@dataclass(frozen=True)
class CostCurve:
    buckets: tuple[int, ...]  # tree budgets b (nodes besides the root), strictly increasing, >= 1
    verify_us: tuple[float, ...]  # T(b): verify + accept + commit of a round of b + 1 nodes per request
    fixed_us: float  # C: the rest of a round (drafter, tree_build at the largest bucket, choice, launches)
    source: str = ""  # how it was obtained (measured where, or a file)
    head_us: tuple[float, ...] = ()  # C_j: that rest with the tree built at bucket j (empty: C at every bucket)

    def __post_init__(self) -> None:
        problem = _problem(self.buckets, self.verify_us, self.fixed_us, self.head_us)
        if problem:
            raise CurveError(f"cost curve: {problem}")

    def cost_at(self, buckets: tuple[int, ...], where: str = "cost curve") -> list[float]:
        """T(b) + C in µs for each b, linear in b between the curve's buckets (C: the head's cost with the
        tree built at buckets[-1])."""
        c = self.head_at(buckets[-1:], where)[0]
        return [t + c for t in self.verify_at(buckets, where)]

    def verify_at(self, buckets: tuple[int, ...], where: str = "cost curve") -> list[float]:
        """T(b) in µs for each b, linear in b between the curve's buckets."""
        return _interpolate(self.buckets, self.verify_us, buckets, where)

    def head_at(self, buckets: tuple[int, ...], where: str = "cost curve") -> list[float]:
        """C_j in µs with the tree built at each of `buckets` (linear in b between the curve's; fixed_us at
        every bucket when the curve has no head_us)."""
        if not self.head_us:
            self.verify_at(buckets, where)  # the range check
            return [self.fixed_us] * len(buckets)
        return _interpolate(self.buckets, self.head_us, buckets, where)

    def to_dict(self) -> dict:
        d = {"buckets": list(self.buckets), "verify_us": [round(t, 3) for t in self.verify_us],
             "fixed_us": round(self.fixed_us, 3), "source": self.source}
        if self.head_us:
            d["head_us"] = [round(t, 3) for t in self.head_us]
        return d

    @classmethod
    def from_dict(cls, d, where: str = "cost curve") -> "CostCurve":
        """d: the JSON object; where names it in errors (a file path)."""
        if not isinstance(d, dict):
            raise CurveError(f"{where}: must be a JSON object, got {type(d).__name__}")
        for key in ("buckets", "verify_us", "fixed_us"):
            if key not in d:
                raise CurveError(f"{where}: key {key!r} is missing")
        b, t, c = d["buckets"], d["verify_us"], d["fixed_us"]
        if not isinstance(b, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in b):
            raise CurveError(f"{where}: key 'buckets' must be a list of integers, got {b!r}")
        if not isinstance(t, list) or not all(_is_num(x) for x in t):
            raise CurveError(f"{where}: key 'verify_us' must be a list of numbers, got {t!r}")
        if not _is_num(c):
            raise CurveError(f"{where}: key 'fixed_us' must be a number, got {c!r}")
        h = d.get("head_us", [])
        if not isinstance(h, list) or not all(_is_num(x) for x in h):
            raise CurveError(f"{where}: key 'head_us' must be a list of numbers, got {h!r}")
        problem = _problem(tuple(b), tuple(float(x) for x in t), float(c), tuple(float(x) for x in h))
        if problem:
            raise CurveError(f"{where}: {problem}")
        return cls(tuple(b), tuple(float(x) for x in t), float(c), str(d.get("source", "")),
                   tuple(float(x) for x in h))

    @classmethod
    def load(cls, path: str | Path) -> "CostCurve":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CurveError(f"{path}: no such cost curve file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CurveError(f"{path}: unreadable cost curve ({type(exc).__name__}: {exc})") from None
        return cls.from_dict(d, str(path))

    def save(self, folder: str | Path) -> Path:
        """Write folder/curve.json atomically (the folder replaced whole, core/staging.py); returns the file."""
        with staged_dir(folder) as stage:
            (stage / CURVE_FILE).write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return Path(folder) / CURVE_FILE


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _interpolate(at: tuple[int, ...], values: tuple[float, ...], buckets: tuple[int, ...], where: str) -> list[float]:
    """values (given at the buckets `at`) at each of `buckets`, linear in b between them."""
    lo, hi = at[0], at[-1]
    out = []
    for b in buckets:
        if not lo <= b <= hi:
            raise CurveError(f"{where}: covers budgets {lo}..{hi}, the session needs {b}")
        j = next(i for i, x in enumerate(at) if x >= b)
        if at[j] == b:
            out.append(values[j])
        else:
            (b0, t0), (b1, t1) = (at[j - 1], values[j - 1]), (at[j], values[j])
            out.append(t0 + (t1 - t0) * (b - b0) / (b1 - b0))
    return out


def _problem(buckets: tuple, verify_us: tuple, fixed_us: float, head_us: tuple = ()) -> str | None:
    """What is wrong with these fields (naming the JSON key), or None."""
    if not buckets:
        return "key 'buckets' is empty"
    if buckets[0] < 1 or any(b1 <= b0 for b0, b1 in zip(buckets, buckets[1:])):
        return f"key 'buckets' must be strictly increasing integers >= 1, got {list(buckets)}"
    if len(verify_us) != len(buckets):
        return f"key 'verify_us' has {len(verify_us)} values for {len(buckets)} buckets"
    if not all(math.isfinite(t) and t >= 0 for t in verify_us):
        return f"key 'verify_us' must be finite and >= 0, got {list(verify_us)}"
    if not (math.isfinite(fixed_us) and fixed_us >= 0):
        return f"key 'fixed_us' must be finite and >= 0, got {fixed_us}"
    if verify_us[0] + fixed_us <= 0:
        return "a round must cost > 0 µs (verify_us[0] + fixed_us is 0)"
    if head_us and len(head_us) != len(buckets):
        return f"key 'head_us' has {len(head_us)} values for {len(buckets)} buckets"
    if not all(math.isfinite(t) and t >= 0 for t in head_us):
        return f"key 'head_us' must be finite and >= 0, got {list(head_us)}"
    if head_us and any(verify_us[0] + c <= 0 for c in head_us):
        return "a round must cost > 0 µs (verify_us[0] + a head_us value is 0)"
    return None


def device_label(device) -> str:
    """"cpu", or the CUDA device's name ("NVIDIA H200")."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def curve_name(device, dtype: torch.dtype, graphs: bool, batch: int, b_max: int) -> str:
    """The folder name of a measured curve under ART/autotune/: what decides T(b) besides the artifact,
    e.g. nvidia-h200-bfloat16-graphs-b1-B256."""
    label = re.sub(r"[^A-Za-z0-9]+", "-", device_label(device)).strip("-").lower()
    return f"{label}-{str(dtype).replace('torch.', '')}-{'graphs' if graphs else 'eager'}-b{batch}-B{b_max}"


class BucketChoice:
    """A session's device state for choosing the bucket: persistent tensors a captured round reads."""

    def __init__(self, buckets: tuple[int, ...], device):
        self.buckets = tuple(buckets)
        nb = len(self.buckets)
        self.sizes = torch.tensor(self.buckets, dtype=torch.int64, device=device)  # [nb]
        self.force = torch.full((1,), -1, dtype=torch.int64, device=device)  # [1] -1 choose; i bucket i; nb none
        self.pick = torch.zeros((), dtype=torch.int64, device=device)  # [] this round's bucket (nb: none)
        self.hot = torch.zeros(nb, dtype=torch.bool, device=device)  # [nb] hot[i] == (pick == i): IF predicates
        # [2, nb] per bucket, decayed: (accepted, predicted) extra tokens within its first b nodes, over the
        # rounds that verified a tree at least that large
        self.seen = torch.ones(2, nb, dtype=torch.float32, device=device)
        self.covered = torch.zeros(nb, dtype=torch.bool, device=device)  # [nb] ever measured
        self.extra = torch.zeros(nb, dtype=torch.float32, device=device)  # [nb] this round's predictions
        # [cap j, bucket b] T(b) + C_j: a round's µs with the tree built at bucket j, verifying bucket b
        self.cap_cost = torch.ones(nb, nb, dtype=torch.float32, device=device)
        # [2, nb] per cap, decayed over full rounds: (expected tokens, µs) of the bucket it would have picked
        self.value = torch.zeros(2, nb, dtype=torch.float32, device=device)
        self.hint = torch.full((), nb - 1, dtype=torch.int64, device=device)  # [] the cap to build next
        self.caps = tuple(i for i, x in enumerate(self.buckets) if x >= min(MIN_CAP, self.buckets[-1]))  # indices
        self.curve: CostCurve | None = None

    @property
    def cost_us(self) -> torch.Tensor:
        """[nb] T(b) + C of a full round (the tree built at the largest bucket)."""
        return self.cap_cost[-1]

    def snapshot(self) -> tuple[torch.Tensor, ...]:
        """Copies of the calibration state (and the caps' values), for `restore` (a session's frozen warm-up
        and measurement)."""
        return self.seen.clone(), self.covered.clone(), self.value.clone(), self.hint.clone()

    def restore(self, snapshot: tuple[torch.Tensor, ...]) -> None:
        """The calibration state of `snapshot` back, and the choice no longer forced."""
        for dst, src in zip((self.seen, self.covered, self.value, self.hint), snapshot):
            dst.copy_(src)
        self.force.fill_(-1)

    def set_curve(self, curve: CostCurve) -> None:
        """Copy T(b) + C_j of this session's buckets and caps to the device (outside any capture: a host copy);
        the caps' values start over (they were scored on another curve)."""
        where = f"cost curve ({curve.source})" if curve.source else "cost curve"
        verify, head = curve.verify_at(self.buckets, where), curve.head_at(self.buckets, where)
        cap_cost = [[t + c for t in verify] for c in head]  # [cap, bucket] in fp64, then rounded once
        self.cap_cost.copy_(torch.tensor(cap_cost, dtype=torch.float32))
        self.value.zero_()
        self.hint.fill_(len(self.buckets) - 1)
        self.curve = curve

    def scale(self) -> torch.Tensor:
        """s [nb] fp32: per bucket, accepted over predicted extra tokens of the last rounds that verified it
        (module doc); a bucket never verified takes the largest verified bucket's below it (1 if none)."""
        return calibration(self.seen, self.covered)

    def select(self, scores: torch.Tensor, live: torch.Tensor, cap: int | None = None) -> None:
        """pick = choose(...) among the buckets up to `cap` (an index; None: all) at that cap's cost, unless
        force >= 0 (then force), hot = one-hot of pick (all false for nb); extra = every bucket's predicted
        extra tokens, kept for observe (scores past the cap's tree are stale: those buckets are never picked).
        A full round also scores every cap and updates the hint (module doc).  One kdtree::budget_select
        (plugins/budget_choice: one Triton program on CUDA)."""
        nb = len(self.buckets)
        budget_select(scores, live, self.sizes, self.seen, self.covered, self.force, self.cap_cost, self.value,
                      self.hint, self.extra, self.pick, self.hot, nb - 1 if cap is None else cap, self.caps[0])

    def observe(self, accept_len: torch.Tensor, accept_idx: torch.Tensor, verified: int) -> None:
        """After the round's accept: accept_len [b] int32 (0 for frozen requests), accept_idx [b, a] int32 (the
        accepted path's node indices, root first), verified the bucket size the round verified.  Nodes come in
        score order with parents first, so the path's nodes with index <= b are what a tree of b nodes would
        have accepted (at T = 0 exactly): each bucket no larger than the verified one is measured by this
        round.  One kdtree::budget_observe."""
        budget_observe(accept_len, accept_idx, self.sizes, verified, self.extra, self.seen, self.covered)
