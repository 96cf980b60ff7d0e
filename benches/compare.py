#!/usr/bin/env python3
"""Side-by-side all-reduce comparison of braid against Open MPI.

Usage: compare.py BRAID_JSON MPI_JSON
       compare.py --latency DIR


Both files hold one sweep in the same schema (written by `braid perf --json`
and by benches/mpi/allreduce_mpi -j):

    {"tool": "...", "ranks": N, "dtype": "float", "op": "sum",
     "results": [{"size": BYTES, "count": ELEMS,
                  "oop": {"time_us": .., "algbw": .., "busbw": .., "wrong": ..},
                  "ip":  {...}}],
     "membw": [{"size": BYTES, "time_us": .., "busbw": ..}]}   # optional

Rows are matched by size; the out-of-place figures are compared. The exit
status is 1 if either file reports a wrong element, 2 on unreadable input.

With --latency, DIR holds rounds of one small size run alternately by both
tools (braid-R.json and mpi-R.json for R = 1, 2, ...); for each tool and
variant (out-of-place, in-place) it prints the minimum and the median time
over the rounds, and the ratios of braid's to MPI's.
"""

import json
import math
import sys

MIB = 1 << 20


def die(msg):
    print(f"compare: {msg}", file=sys.stderr)
    sys.exit(2)


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        die(f"cannot read {path}: {e}")
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        die(f"{path}: no 'results' list")
    return data


def by_size(entries, path, what):
    out = {}
    for e in entries:
        try:
            out[int(e["size"])] = e
        except (KeyError, TypeError, ValueError):
            die(f"{path}: {what} entry without a size: {e!r}")
    return out


def num(d, key):
    """A finite float from d[key], or None."""
    if not isinstance(d, dict):
        return None
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def wrong_of(row):
    """Wrong elements of a result row (oop + ip); None when not checked."""
    total = None
    for variant in ("oop", "ip"):
        w = num(row.get(variant), "wrong")
        if w is not None:
            total = (total or 0) + int(w)
    return total


def human(size):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def ratio(a, b):
    if a is None or b is None or b <= 0:
        return None
    return a / b


def latency(directory):
    """The --latency report (see the module docs)."""
    import os
    import statistics

    rounds = {}
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        die(f"cannot read {directory}: {e}")
    for name in names:
        tool, _, rest = name.partition("-")
        if tool in ("braid", "mpi") and rest.endswith(".json") and rest[:-5].isdigit():
            rounds.setdefault(int(rest[:-5]), {})[tool] = os.path.join(directory, name)
    complete = [r for r in sorted(rounds) if len(rounds[r]) == 2]
    if not complete:
        die(f"{directory}: no round with both braid-R.json and mpi-R.json")
    times = {(tool, v): [] for tool in ("braid", "mpi") for v in ("oop", "ip")}
    size = None
    any_wrong = False
    for r in complete:
        for tool in ("braid", "mpi"):
            path = rounds[r][tool]
            rows = load(path)["results"]
            if len(rows) != 1:
                die(f"{path}: a latency round holds one size, not {len(rows)}")
            row = rows[0]
            if size is None:
                size = row.get("size")
            elif row.get("size") != size:
                die(f"{path}: size {row.get('size')!r}, other rounds {size!r}")
            any_wrong |= bool(wrong_of(row))
            for v in ("oop", "ip"):
                t = num(row.get(v), "time_us")
                if t is None:
                    die(f"{path}: no {v} time")
                times[(tool, v)].append(t)
    print(f"# all-reduce of {size} B: us per call over {len(complete)} alternated rounds")
    print("# braid/mpi > 1 means braid is slower")
    headers = [("variant", 12), ("braid min", 10), ("mpi min", 10), ("braid/mpi", 10),
               ("braid median", 12), ("mpi median", 10), ("braid/mpi", 10)]
    print("  ".join(f"{h:>{w}}" for h, w in headers))
    for v, label in (("oop", "out-of-place"), ("ip", "in-place")):
        b, m = times[("braid", v)], times[("mpi", v)]
        cells = [label, fmt(min(b), ".3f"), fmt(min(m), ".3f"), fmt(ratio(min(b), min(m)), ".2f"),
                 fmt(statistics.median(b), ".3f"), fmt(statistics.median(m), ".3f"),
                 fmt(ratio(statistics.median(b), statistics.median(m)), ".2f")]
        print("  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, headers)))
    if any_wrong:
        print("compare: FAILED: wrong results reported", file=sys.stderr)
        return 1
    return 0


def main(argv):
    if len(argv) == 2 and argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if len(argv) == 3 and argv[1] == "--latency":
        return latency(argv[2])
    if len(argv) != 3:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    braid_path, mpi_path = argv[1], argv[2]
    braid = load(braid_path)
    mpi = load(mpi_path)

    for key in ("ranks", "dtype", "op"):
        if braid.get(key) != mpi.get(key):
            print(
                f"compare: warning: {key} differs: braid {braid.get(key)!r}, "
                f"mpi {mpi.get(key)!r}",
                file=sys.stderr,
            )

    b_rows = by_size(braid["results"], braid_path, "results")
    m_rows = by_size(mpi["results"], mpi_path, "results")
    membw = braid.get("membw")
    bound = by_size(membw, braid_path, "membw") if isinstance(membw, list) else None

    print(
        f"# all-reduce {braid.get('dtype', '?')} {braid.get('op', '?')}, "
        f"ranks braid {braid.get('ranks', '?')} / {mpi.get('tool', 'mpi')} {mpi.get('ranks', '?')}; "
        "out-of-place; busbw in GB/s, time in us"
    )
    print("# braid/mpi bw > 1 and mpi/braid t > 1 both mean braid is faster; #wrong is oop + ip")
    headers = [
        ("size", 8),
        ("braid busbw", 11),
        ("mpi busbw", 10),
        ("braid/mpi bw", 12),
        ("braid us", 10),
        ("mpi us", 10),
        ("mpi/braid t", 11),
        ("braid #wrong", 12),
        ("mpi #wrong", 10),
    ]
    if bound is not None:
        headers += [("bound busbw", 11), ("braid/bound", 11)]
    print("  ".join(f"{h:>{w}}" for h, w in headers))

    bw_ratios = []
    time_ratio_8 = None
    any_wrong = False
    for size in sorted(set(b_rows) | set(m_rows)):
        b = b_rows.get(size)
        m = m_rows.get(size)
        b_oop = b.get("oop") if b else None
        m_oop = m.get("oop") if m else None
        b_bw, m_bw = num(b_oop, "busbw"), num(m_oop, "busbw")
        b_t, m_t = num(b_oop, "time_us"), num(m_oop, "time_us")
        b_wrong = wrong_of(b) if b else None
        m_wrong = wrong_of(m) if m else None
        any_wrong |= bool(b_wrong) or bool(m_wrong)
        bw_ratio = ratio(b_bw, m_bw)
        speedup = ratio(m_t, b_t)
        if bw_ratio is not None and bw_ratio > 0 and size >= MIB:
            bw_ratios.append(bw_ratio)
        if size == 8:
            time_ratio_8 = speedup
        cells = [
            human(size),
            fmt(b_bw, ".3f"),
            fmt(m_bw, ".3f"),
            fmt(bw_ratio, ".2f"),
            fmt(b_t, ".2f"),
            fmt(m_t, ".2f"),
            fmt(speedup, ".2f"),
            "-" if b is None else ("n/a" if b_wrong is None else str(b_wrong)),
            "-" if m is None else ("n/a" if m_wrong is None else str(m_wrong)),
        ]
        if bound is not None:
            bound_bw = num(bound.get(size), "busbw")
            cells += [fmt(bound_bw, ".3f"), fmt(ratio(b_bw, bound_bw), ".2f")]
        print("  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, headers)))

    summary = []
    if bw_ratios:
        gm = math.exp(sum(math.log(r) for r in bw_ratios) / len(bw_ratios))
        summary.append(f"geomean braid/mpi busbw, sizes >= 1M ({len(bw_ratios)}): {gm:.2f}")
    else:
        summary.append("geomean braid/mpi busbw, sizes >= 1M: -")
    if time_ratio_8 is not None:
        summary.append(f"8 B mpi/braid time: {time_ratio_8:.2f}")
    print("# " + "; ".join(summary))

    if any_wrong:
        print("compare: FAILED: wrong results reported (see #wrong)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
