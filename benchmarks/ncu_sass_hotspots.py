"""The SASS instructions where a kernel's warps are sampled most, from Nsight Compute's source page as CSV
(`ncu --section SourceCounters --page source --print-source sass --csv ...`): the first place to look when a
kernel sits far from its roofline and the stall ratios alone do not say which load or barrier it waits on.

    ncu ... --page source --print-source sass --csv python3 calls.py > page.csv
    python3 benchmarks/ncu_sass_hotspots.py page.csv [--top 25]
Prints, per kernel in the page, the top instructions by warp-stall samples (share of the kernel's samples, the
stall columns that hold most of them, the SASS text).  Column names differ across ncu versions: the sample column
is the first whose name holds "Sampling" and "All" (else "Samples"), the text column "Source".
"""

from __future__ import annotations

import argparse
import csv
import io
import sys


def _pick(header: list[str], *needles: str) -> int | None:
    for i, h in enumerate(header):
        if all(n.lower() in h.lower() for n in needles):
            return i
    return None


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def hotspots(text: str, top: int) -> list[str]:
    """CSV text of one or more source pages (each starts with a header row holding "Source") -> report lines."""
    lines, block = [], []
    blocks: list[tuple[str, list[list[str]]]] = []
    title = pending = ""
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if row[0].strip() == "Kernel Name":  # the next page's kernel (ncu prints it before the page's header)
            pending = " ".join(c for c in row[1:] if c)[:120]
            continue
        if any(c.strip() == "Source" for c in row):  # a new page's header
            if block:
                blocks.append((title, block))
            block, title = [row], pending
            continue
        if block:
            block.append(row)
    if block:
        blocks.append((title, block))
    if not blocks:
        return ["no source page found (was --page source --csv given, and SourceCounters collected?)"]
    for title, rows in blocks:
        header, body = rows[0], rows[1:]
        src = _pick(header, "Source")
        smp = _pick(header, "Sampling", "All")
        if smp is None:
            smp = _pick(header, "Samples")
        if src is None or smp is None:
            lines.append(f"{title}: columns not found in {header[:12]}")
            continue
        stall_cols = [i for i, h in enumerate(header) if "stall" in h.lower() and i != smp]
        total = sum(_num(r[smp]) for r in body if len(r) > smp) or 1.0
        lines.append(f"== {title or 'kernel'}: {int(total)} samples, {len(body)} instructions")
        ranked = sorted((r for r in body if len(r) > max(src, smp)), key=lambda r: -_num(r[smp]))[:top]
        for r in ranked:
            worst = sorted(((_num(r[i]), header[i]) for i in stall_cols if i < len(r)), reverse=True)[:2]
            why = ", ".join(f"{h.split('(')[0].strip()} {v:.0f}" for v, h in worst if v > 0)
            lines.append(f"{100 * _num(r[smp]) / total:5.1f}%  {r[src].strip()[:70]:<70}  {why}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("page", help="the CSV ncu printed (- for stdin)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    text = sys.stdin.read() if a.page == "-" else open(a.page, encoding="utf-8", errors="replace").read()
    print("\n".join(hotspots(text, a.top)))


if __name__ == "__main__":
    main()
