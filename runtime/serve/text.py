"""TextStream: a request's generated ids -> the text to send, cut at the first stop string.

The rule is Engine.generate's (runtime/engine/engine.py): stop tokens are not shown; text that could
still be the start of a stop string is held back; a stop string ends the text before it.  Here the
ids arrive per round, pushed by the server, and a hit tells the caller to end the request.
"""

from __future__ import annotations

from core.tokenizer import StreamDecoder, Tokenizer


class TextStream:
    def __init__(self, tok: Tokenizer, stop_ids: tuple[int, ...], stop_texts: tuple[str, ...]):
        self.decoder = StreamDecoder(tok, skip=stop_ids)
        self.stop_texts = stop_texts
        self.hold = max((len(t) for t in stop_texts), default=1) - 1  # chars a stop string may still complete
        self.pending = ""
        self.stopped = False  # a stop string was found: nothing more is sent

    def push(self, tokens: list[int]) -> str:
        """Text completed by these ids, safe to send now."""
        if self.stopped:
            return ""
        for t in tokens:
            self.pending += self.decoder.push(t)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest once the request ended."""
        if self.stopped:
            return ""
        self.pending += self.decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        hits = [i for i in (self.pending.find(t) for t in self.stop_texts) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        cut = len(self.pending) if final or not self.stop_texts else max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out
