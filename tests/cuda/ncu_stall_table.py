"""Summarise an `ncu --page source --csv --print-source sass` export (measurement tool).

Prints, per profiled kernel in the export: the column sums of every warp-stall
sampling column, the samples per opcode, and the hottest instructions with a
few neighbours each (a spin loop or a wait shows up as a short hot window).
Usage: python3 ncu_stall_table.py EXPORT.csv [top_n]
"""
import csv
import re
import sys
from collections import defaultdict


def blocks(rows):
    """Splits the export into [(kernel name, header, rows)]: a header row names 'Address'."""
    out, name = [], "?"
    for r in rows:
        if r and r[0] == "Kernel Name":
            name = r[1] if len(r) > 1 else "?"
        elif r and any(c.strip() == "Address" for c in r[:3]):
            out.append((name, r, []))
        elif out and r:
            out[-1][2].append(r)
    return out


def num(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def cell(r, i):
    """Row r's number in column i (0 where the row is short or the cell is no number)."""
    return num(r[i]) if len(r) > i else 0.0


def summarise(header, rows, top_n):
    col = {h.strip(): i for i, h in enumerate(header)}
    src = col.get("Source")
    addr = col.get("Address")
    total_col = next((h for h in col if re.search(r"Warp Stall Sampling \(All", h)), None)
    # per-reason sample columns (all samples; the '(Not Issued)' copies are left out)
    stall_cols = [h for h in col if h.startswith("stall_") and "Not Issued" not in h]
    if total_col is None:
        print("no sampling column")
        return
    ti = col[total_col]
    total = sum(cell(r, ti) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} samples in '{total_col}'")
    sums = {h: sum(cell(r, col[h]) for r in rows) for h in stall_cols}
    for h, v in sorted(sums.items(), key=lambda x: -x[1]):
        if v:
            print(f"  {v:10.0f}  {100 * v / max(total, 1):5.1f} %  {h}")
    by_op = defaultdict(float)
    for r in rows:
        if src is not None and len(r) > src:
            words = [w for w in r[src].split() if not w.startswith("@")]  # drop the predicate
            by_op[words[0].split(".")[0] if words else "?"] += cell(r, ti)
    print("samples per opcode:")
    for op, v in sorted(by_op.items(), key=lambda x: -x[1])[:20]:
        print(f"  {v:10.0f}  {100 * v / max(total, 1):5.1f} %  {op}")
    order = sorted(range(len(rows)), key=lambda i: -cell(rows[i], ti))
    # the stall reason columns other than the total, for the per-instruction breakdown
    reasons = [h for h in stall_cols if sums[h]]
    shown = set()
    base = int(rows[0][addr], 16) if addr is not None and rows else 0  # offsets from the kernel's start
    print(f"hottest {top_n} instructions (+-3 neighbours):")
    for i in order[:top_n]:
        if i in shown:
            continue
        for j in range(max(0, i - 3), min(len(rows), i + 4)):
            shown.add(j)
            r = rows[j]
            v = cell(r, ti)
            top = sorted(((cell(r, col[h]), h) for h in reasons), reverse=True)[:2]
            why = ", ".join(f"{h[6:]}={x:.0f}" for x, h in top if x)
            mark = ">>" if j == i else "  "
            a = hex(int(r[addr], 16) - base) if addr is not None else ""
            s = r[src].strip()[:70] if src is not None else ""
            print(f"{mark} {a:>8} {v:8.0f} {100 * v / max(total, 1):5.2f}%  {s:<70} {why}")
        print("   ...")


def main():
    path = sys.argv[1]
    top_n = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    for k, (name, header, body) in enumerate(blocks(rows)):
        print(f"================ kernel block {k}: {name[:120]}")
        summarise(header, body, top_n)


if __name__ == "__main__":
    main()
