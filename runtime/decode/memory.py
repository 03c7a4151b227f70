"""Will a decode session fit?  Its dominant allocations, estimated before anything is allocated.

A session (runtime/decode/session.py) allocates, once, for b requests of up to `capacity` tokens and
N = budget + 1 tree nodes: the target's latent cache (layers x b x (capacity + N + a) rows of d_qk)
and the forward's scratch, the drafter's context cache, the round buffers (the ancestor mask is
b x N x ceil(N / 64) words), and per round the verify logits (b x N x v fp32) and the draft logits
(b x D x v fp32).  On CPU, tree_build's reference also builds an N x N ancestor table per request
(~9 N^2 bytes).  The sum is compared with the memory the device can still give (CUDA: free plus
what torch's caching allocator holds unused; CPU: MemAvailable), so an impossible request is refused
in one line naming its flag instead of failing inside an allocation (or after minutes of swapping).
The estimate ignores activations of one layer and small buffers: it is a floor, checked with 10 %
headroom.
"""

from __future__ import annotations

import torch

from plugins.common.bitmask import mask_words
from runtime.decode.params import InvalidParam

HEADROOM = 1.1


def session_bytes(target, drafter, batch: int, capacity: int, n: int, a: int, prefill_chunk: int) -> dict[str, int]:
    """{"cache": ..., "tree": ...} bytes a session of these sizes needs at least (see the module doc)."""
    cfg, item = target.cfg, torch.tensor([], dtype=target.dtype).element_size()
    rows = capacity + n + a
    cache = cfg.num_layers * batch * (rows + max(n, prefill_chunk)) * cfg.d_qk * item
    if drafter is not None and hasattr(drafter, "cache_bytes"):  # a drafter's own context cache, when it says
        cache += drafter.cache_bytes(batch, rows)
    v = cfg.vocab_size
    tree = batch * n * mask_words(n) * 8 + batch * n * v * 4 + batch * a * v * 4
    if target.device.type == "cpu" and n > 1:
        tree += 9 * n * n  # tree_build reference: dense N x N ancestors + their 64-bit padded words
    return {"cache": int(cache), "tree": int(tree)}


def available_bytes(device: torch.device) -> int | None:
    """Memory the device can still give this process (None: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits(parts: dict[str, int], device: torch.device, budget: int, capacity: int,
               available: int | None = None) -> None:
    """Raise InvalidParam naming the flag whose part dominates when the parts do not fit the device."""
    have = available_bytes(device) if available is None else available
    need = sum(parts.values())
    if have is None or need * HEADROOM <= have:
        return
    where = "GPU memory" if device.type == "cuda" else "memory"
    if parts["tree"] >= parts["cache"]:
        raise InvalidParam("budget", f"budget {budget} needs ~{parts['tree'] / 1e9:.1f} GB for its tree (mask and "
                           f"logits of {budget + 1} nodes) on top of the cache; {have / 1e9:.1f} GB of {where} "
                           f"are available: use a smaller budget")
    raise InvalidParam("max_new_tokens", f"prompt + max_new_tokens ({capacity} tokens per request) need "
                       f"~{parts['cache'] / 1e9:.1f} GB of KV cache; {have / 1e9:.1f} GB of {where} are available: "
                       f"ask for fewer tokens")
