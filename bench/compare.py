"""A/B of two builds from their benchmark result files: per-row time ratios and their geometric means.

Each side is one or more CSVs written by bench/spmm.py or bench/layer.py (forward and backward
kernels: `median_us`; one training step: `graph_us`, CUDA-graph replay, and `peak_mib`). Rows are
matched on every column that is not a measurement; a row measured in several rounds (several files
of one kind on one side) counts with its fastest round, so that one slow round of a noisy row does
not read as a change. Baselines measured in the same runs (dense, cuSPARSE, ...) are compared too:
their ratios show the run-to-run noise the snack rows should be read against.

    python bench/compare.py --before old/spmm_r1.csv old/spmm_r2.csv old/layer.csv \
        --after new/spmm_r1.csv new/spmm_r2.csv new/layer.csv --name refactor

writes bench/results/compare_<name>_<gpu>.{csv,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from collections import defaultdict
from pathlib import Path

from snack.benchmark import RESULTS_DIR, geomean, git_commit, markdown_head, pyplot, read_csv, write_csv

# The measured columns of each result kind; the other columns name the row.
MEASURES = {"kernel": ("median_us",), "step": ("graph_us", "peak_mib")}
# Columns that are neither a row's name nor compared (derived, or too noisy to compare).
IGNORED = {"floor_us", "gpu_us", "wall_us", "tflops"}


def kind_of(columns) -> str:
    if "graph_us" in columns:
        return "step"
    if "median_us" in columns:
        return "kernel"
    raise ValueError(f"not a kernel or layer result file (columns {sorted(columns)})")


def load(paths: list[Path]) -> tuple[dict, dict]:
    """Every row of the files, best round per row: {(kind, measure, key): value}, and the first
    file's provenance per kind."""
    best, info = {}, {}
    for path in paths:
        header, rows = read_csv(path)
        if not rows:
            raise ValueError(f"{path}: no rows")
        kind = kind_of(rows[0].keys())
        info.setdefault(kind, header)
        for row in rows:
            key = tuple((c, row[c]) for c in row if c not in MEASURES[kind] and c not in IGNORED)
            for measure in MEASURES[kind]:
                value = row.get(measure)
                if isinstance(value, float):
                    slot = (kind, measure, key)
                    best[slot] = min(value, best.get(slot, value))
    return best, info


def is_snack(key) -> bool:
    return str(dict(key).get("impl", "")).startswith("snack")


def label(key) -> str:
    d = dict(key)
    shape = f"{d.pop('M', '?')}x{d.pop('K', '?')}"
    parts = [str(d.pop("op", "step")), shape, f"N={d.pop('N', '?')}"]
    return " ".join(parts + [f"{v}" for v in d.values()])


def compare(before: dict, after: dict) -> list[dict]:
    rows = []
    for slot in sorted(set(before) & set(after), key=str):
        kind, measure, key = slot
        b, a = before[slot], after[slot]
        rows.append({"kind": kind, "measure": measure, "row": label(key), "snack": is_snack(key),
                     "before": b, "after": a, "ratio": a / b if b > 0 else float("nan")})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["kind"], r["measure"], "snack" if r["snack"] else "baselines")].append(r["ratio"])
    out = []
    for (kind, measure, who), ratios in sorted(groups.items()):
        out.append({"kind": kind, "measure": measure, "rows": who, "count": len(ratios),
                    "geomean": geomean(ratios), "min": min(ratios), "max": max(ratios)})
    return out


def markdown(rows, table, info_before, info_after, header, note) -> str:
    lines = markdown_head("A/B of two builds: after / before, per row (below 1: the after build is faster)", header)
    if note:
        lines += [note, ""]
    for side, info in (("before", info_before), ("after", info_after)):
        for kind, h in info.items():
            lines.append(f"- {side} ({kind} files): commit {h.get('commit', '?')}, {h.get('gpu', '?')}, "
                         f"torch {h.get('torch', '?')}, {h.get('date', '?')}")
    lines += ["", "Kernel rows compare `median_us` (cold L2, CUDA events); step rows compare `graph_us` "
              "(CUDA-graph replay of one training step) and `peak_mib`. A row measured in several rounds "
              "counts with its fastest round.", "",
              "| kind | measure | rows | count | geomean after/before | min | max |", "|---|---|---|---|---|---|---|"]
    for s in table:
        lines.append(f"| {s['kind']} | {s['measure']} | {s['rows']} | {s['count']} | {s['geomean']:.3f} | "
                     f"{s['min']:.3f} | {s['max']:.3f} |")
    lines += ["", "## snack's rows", "", "| kind | measure | row | before | after | after/before |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["snack"]:
            lines.append(f"| {r['kind']} | {r['measure']} | {r['row']} | {r['before']:.4g} | {r['after']:.4g} | "
                         f"{r['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for snack, colour, name in ((False, "tab:gray", "baselines (same runs)"), (True, "tab:blue", "snack")):
        ratios = [r["ratio"] for r in rows if r["snack"] == snack and r["measure"] != "peak_mib"]
        if ratios:
            ax.hist(ratios, bins=30, alpha=0.6, color=colour, label=f"{name}: {len(ratios)} rows")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xlabel("time after / before (below 1: faster)")
    ax.set_ylabel("rows")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_args(argv: list[str]) -> list[str]:
    """The arguments as given, the note (printed below the header anyway) elided."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a == "--note":
            out[i + 1] = "(the text below)"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", type=Path, required=True, help="result CSVs of the old build")
    parser.add_argument("--after", nargs="+", type=Path, required=True, help="result CSVs of the new build")
    parser.add_argument("--name", required=True, help="what is compared, in the file name (e.g. a change's name)")
    parser.add_argument("--note", default="", help="how the inputs were measured, for the report")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    before, info_before = load(args.before)
    after, info_after = load(args.after)
    rows = compare(before, after)
    if not rows:
        print("no row is in both sides", file=sys.stderr)
        return 1
    table = summary(rows)
    first = next(iter(info_after.values()))
    slug = "".join(c if c.isalnum() else "_" for c in first.get("gpu", "gpu").lower()).strip("_")
    header = {"gpu": first.get("gpu", "?"), "commit": git_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": "python bench/compare.py " + " ".join(shlex.quote(a) for a in command_args(argv or sys.argv[1:]))}
    stem = args.out / f"compare_{args.name}_{slug}"
    write_csv(stem.with_suffix(".csv"), header, ["kind", "measure", "row", "snack", "before", "after", "ratio"], rows)
    stem.with_suffix(".md").write_text(markdown(rows, table, info_before, info_after, header, args.note))
    plot(rows, stem.with_suffix(".png"), f"{args.name}: {first.get('gpu', '')}")
    print(f"{'kind':7} {'measure':10} {'rows':10} {'count':>5} {'geomean':>8} {'min':>6} {'max':>6}")
    for s in table:
        print(f"{s['kind']:7} {s['measure']:10} {s['rows']:10} {s['count']:5d} {s['geomean']:8.3f} "
              f"{s['min']:6.3f} {s['max']:6.3f}")
    print(f"wrote {stem}.{{csv,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
