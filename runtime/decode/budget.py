"""Budget per round (`--budget auto`): the cost curve, and the bucket each round verifies, chosen on the device.

A DDTree round builds its tree at B_max, the session's budget.  Nodes come in score order and the tree of
budget b is the first b + 1 of them (plugins/tree_build/reference.py), so a round may verify any prefix.
Buckets: b in 1, 2, 4, ..., B_max (the powers of two below B_max, then B_max).  For bucket b the round
expects

  E(b) = sum over live requests of (1 + s_b * sum_{i=1..b} exp(score_i))    score_i: node i's path log-prob

tokens (the drafter's own estimate: node i's path is accepted with the probability the drafter gives
it, the bonus always comes; s_b scales it) at a cost of T(b) + C µs: T(b) the verify, accept and commit
of b + 1 nodes per request, C the rest of the round (drafter, tree_build at B_max, this choice, fixed
costs).  The round verifies argmax_b E(b) / (T(b) + C), ties to the smaller bucket.  `choose` computes
it with torch ops on the device, with no host read, so a captured round picks its own bucket: one
CUDA-graph IF node per bucket (runtime/decode/conditional.py).

s_b calibrates the drafter per bucket: its probabilities are not the target's acceptance (at T = 0 a
node is accepted when it is the target's argmax, whatever probability the drafter gave it; an
under-confident drafter would make every round verify too small a tree, and one whose deep nodes are
over-confident too large a one).  A round that verified bucket B measures every bucket b <= B: nodes
come in score order with parents first, so the accepted path's nodes with index <= b are exactly what
the tree of b nodes would have accepted (at T = 0).  Per bucket, the accepted and the predicted extra
tokens (beyond the bonus, summed over requests) go into two decayed sums (DECAY per measuring round,
both starting at 1); s_b is their ratio, within [S_MIN, S_MAX]; a bucket no round has measured yet
takes the largest measured bucket's s below it (1 if none).  Kept on the device with the rest.

CostCurve: the buckets, T per bucket and C in µs, and where they came from; its JSON is
{"buckets": [...], "verify_us": [...], "fixed_us": C, "source": "..."}.  A session takes the curve
it is given, else ART/autotune/<curve_name>/curve.json, else measures its own and stores it there
when the artifact folder is writable (runtime/decode/autotune.py).  Buckets missing from a curve are
interpolated linearly in b (`cost_at`); a bucket beyond its range is an error.
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

AUTOTUNE_DIR = "autotune"  # beside the artifact's manifest; not listed in it (measured at run time)
CURVE_FILE = "curve.json"
DECAY = 0.9  # per round, of the accepted / predicted sums behind the calibration s (~10 rounds' memory)
S_MIN, S_MAX = 0.25, 4.0


class CurveError(KdtreeError):
    """A cost curve (JSON or in memory) is malformed; the message names the file and key."""


def default_buckets(b_max: int) -> tuple[int, ...]:
    """1, 2, 4, ... below b_max, then b_max."""
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
    fixed_us: float  # C: the rest of a round (drafter, tree_build, choice, launches)
    source: str = ""  # how it was obtained (measured where, or a file)

    def __post_init__(self) -> None:
        problem = _problem(self.buckets, self.verify_us, self.fixed_us)
        if problem:
            raise CurveError(f"cost curve: {problem}")

    def cost_at(self, buckets: tuple[int, ...], where: str = "cost curve") -> list[float]:
        """T(b) + C in µs for each b, linear in b between the curve's buckets."""
        lo, hi = self.buckets[0], self.buckets[-1]
        out = []
        for b in buckets:
            if not lo <= b <= hi:
                raise CurveError(f"{where}: covers budgets {lo}..{hi}, the session needs {b}")
            j = next(i for i, x in enumerate(self.buckets) if x >= b)
            if self.buckets[j] == b:
                t = self.verify_us[j]
            else:
                (b0, t0), (b1, t1) = (self.buckets[j - 1], self.verify_us[j - 1]), (self.buckets[j], self.verify_us[j])
                t = t0 + (t1 - t0) * (b - b0) / (b1 - b0)
            out.append(t + self.fixed_us)
        return out

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "verify_us": [round(t, 3) for t in self.verify_us],
                "fixed_us": round(self.fixed_us, 3), "source": self.source}

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
        problem = _problem(tuple(b), tuple(float(x) for x in t), float(c))
        if problem:
            raise CurveError(f"{where}: {problem}")
        return cls(tuple(b), tuple(float(x) for x in t), float(c), str(d.get("source", "")))

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


def _problem(buckets: tuple, verify_us: tuple, fixed_us: float) -> str | None:
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


def extra_tokens(scores: torch.Tensor, live: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """scores [b, N] fp32 path log-probs (root 0), live [b], sizes [nb] int64 buckets -> [nb] fp32: the
    drafter's expected accepted nodes of the first b, summed over live requests (no bonus, no s)."""
    cum = scores[:, 1:].exp().cumsum(1)  # [b, N - 1] sum of path probabilities of nodes 1..i
    return (cum.index_select(1, sizes - 1) * live[:, None].to(cum.dtype)).sum(0)  # [nb]


def expected_tokens(scores: torch.Tensor, live: torch.Tensor, sizes: torch.Tensor, scale=1.0) -> torch.Tensor:
    """E(b) [nb] fp32 of the module doc: live requests + scale * extra_tokens."""
    return live.sum().to(torch.float32) + scale * extra_tokens(scores, live, sizes)


def choose(extra: torch.Tensor, live: torch.Tensor, cost_us: torch.Tensor, scale=1.0) -> torch.Tensor:
    """The bucket index [] int64 maximising expected tokens per µs, (live requests + scale * extra) / cost_us
    (extra [nb] from extra_tokens, cost_us [nb] fp32 = T(b) + C); torch ops on the device, no host read.
    The first maximum wins (the smaller bucket)."""
    return ((live.sum().to(torch.float32) + scale * extra) / cost_us).argmax()


class BucketChoice:
    """A session's device state for choosing the bucket: persistent tensors a captured round reads."""

    def __init__(self, buckets: tuple[int, ...], device):
        self.buckets = tuple(buckets)
        nb = len(self.buckets)
        self.sizes = torch.tensor(self.buckets, dtype=torch.int64, device=device)  # [nb]
        self.index = torch.arange(nb, device=device)  # [nb]
        self.cost_us = torch.ones(nb, dtype=torch.float32, device=device)  # [nb] T + C, set by set_curve
        self.force = torch.full((1,), -1, dtype=torch.int64, device=device)  # [1] -1 choose; i bucket i; nb none
        self.pick = torch.zeros((), dtype=torch.int64, device=device)  # [] this round's bucket (nb: none)
        self.hot = torch.zeros(nb, dtype=torch.bool, device=device)  # [nb] hot[i] == (pick == i): IF predicates
        # [2, nb] per bucket, decayed: (accepted, predicted) extra tokens within its first b nodes, over the
        # rounds that verified a tree at least that large
        self.seen = torch.ones(2, nb, dtype=torch.float32, device=device)
        self.covered = torch.zeros(nb, dtype=torch.bool, device=device)  # [nb] ever measured
        self.extra = torch.zeros(nb, dtype=torch.float32, device=device)  # [nb] this round's predictions
        self.curve: CostCurve | None = None

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the calibration state, for `restore` (a session's frozen warm-up and measurement)."""
        return self.seen.clone(), self.covered.clone()

    def restore(self, snapshot: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The calibration state of `snapshot` back, and the choice no longer forced."""
        self.seen.copy_(snapshot[0])
        self.covered.copy_(snapshot[1])
        self.force.fill_(-1)

    def set_curve(self, curve: CostCurve) -> None:
        """Copy T(b) + C of this session's buckets to the device (outside any capture: a host copy)."""
        cost = curve.cost_at(self.buckets, f"cost curve ({curve.source})" if curve.source else "cost curve")
        self.cost_us.copy_(torch.tensor(cost, dtype=torch.float32))
        self.curve = curve

    def scale(self) -> torch.Tensor:
        """s [nb] fp32: per bucket, accepted over predicted extra tokens of the last rounds that verified it
        (module doc); a bucket never verified takes the largest verified bucket's below it (1 if none)."""
        s = (self.seen[0] / self.seen[1]).clamp(S_MIN, S_MAX)  # [nb]
        known = torch.where(self.covered, self.index, torch.zeros_like(self.index)).cummax(0).values  # [nb]
        return torch.where(self.covered[known], s.gather(0, known), s.new_ones(()))

    def select(self, scores: torch.Tensor, live: torch.Tensor) -> None:
        """pick = choose(...) unless force >= 0 (then force), hot = one-hot of pick (all false for nb);
        extra = every bucket's predicted extra tokens, kept for observe."""
        self.extra.copy_(extra_tokens(scores, live, self.sizes))  # [nb]
        f = self.force[0]
        self.pick.copy_(torch.where(f >= 0, f, choose(self.extra, live, self.cost_us, self.scale())))
        torch.eq(self.index, self.pick, out=self.hot)

    def observe(self, accept_len: torch.Tensor, accept_idx: torch.Tensor, verified: int) -> None:
        """After the round's accept: accept_len [b] int32 (0 for frozen requests), accept_idx [b, a] int32 (the
        accepted path's node indices, root first), verified the bucket size the round verified.  Nodes come in score order with parents first, so the
        path's nodes with index <= b are what a tree of b nodes would have accepted (at T = 0 exactly): each
        bucket no larger than the verified one is measured by this round."""
        a = accept_idx.shape[1]
        slot = torch.arange(a, device=accept_idx.device)  # [a]
        on_path = (slot[None, :] >= 1) & (slot[None, :] < accept_len[:, None])  # [b, a] accepted, past the root
        within = accept_idx[:, :, None].long() <= self.sizes[None, None, :]  # [b, a, nb]
        got = (within & on_path[:, :, None]).sum((0, 1)).to(torch.float32)  # [nb]
        # [nb] buckets inside the verified tree, when a request was live (frozen rounds measure nothing)
        cover = (self.sizes <= verified) & (accept_len.sum() > 0)
        self.covered |= cover
        w = cover.to(torch.float32)  # [nb]
        self.seen.mul_(1 - w * (1 - DECAY)).add_(torch.stack([got, self.extra]) * w)
