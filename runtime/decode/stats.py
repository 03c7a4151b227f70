"""DecodeStats: the one record of a generation (AR or speculative, one rank or many).

`as_dict` is what `--json` prints and `Engine.last_stats` holds: token counts and times, rounds,
tau (tokens per round, bonus included), the accept-length histogram, per-stage time where the
stages were timed (eager rounds; None when graphs replayed them), plus the host loop's numbers
and the run's settings in `extra`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

STAGES = ("draft", "build", "verify", "accept", "commit")


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    accept_lens: list[int] = field(default_factory=list)  # per round and live request
    stage_s: dict[str, float] | None = None  # seconds per stage, when timed
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        rounds = len(self.accept_lens)
        d = {"prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
             "prefill_s": round(self.prefill_s, 6), "decode_s": round(self.decode_s, 6),
             "decode_tokens_per_s": round(self.new_tokens / self.decode_s, 3) if self.decode_s > 0 else None,
             "rounds": rounds, "tau": round(sum(self.accept_lens) / rounds, 4) if rounds else None,
             "accept_len_histogram": dict(sorted(Counter(self.accept_lens).items())),
             "stage_ms": {k: round(1e3 * v, 3) for k, v in self.stage_s.items()} if self.stage_s else None}
        d.update(self.extra)
        return d
