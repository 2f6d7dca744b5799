"""The bad-input matrix and the fuzzers, counted: how many cases and examples ran on each device and
how each ended (accepted, or which documented error). Writes bench/results/robustness_<gpu>.{csv,md}.

    python bench/robustness.py [--examples 500] [--devices cpu,cuda]

Each device's matrix (tests/python/test_bad_inputs.py) and fuzzers (tests/python/fuzz_cases.py) run
in child processes, as in the test suite; a crash there is reported as a failed run. The fuzzers are
derandomized: the same command draws the same examples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import torch

from snack import benchmark

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "python"


def pytest(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W",
                           "ignore::DeprecationWarning", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def run_matrix(devices: list[str], env: dict) -> tuple[list[dict], int]:
    """The whole matrix once (its tests cover every device torch sees); the rows of `devices`."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "matrix.xml"
        child = pytest([str(TESTS / "test_bad_inputs.py"), f"--junitxml={xml}"], env)
        rows = []
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                device, _, target = case.get("name", "").partition("[")[2].rstrip("]").partition("-")
                if device not in devices:
                    continue
                outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None else
                           "skipped" if case.find("skipped") is not None else "passed")
                rows.append({"kind": "matrix", "device": device, "target": target, "outcome": outcome, "count": 1})
        if child.returncode != 0:
            print(child.stdout[-4000:], child.stderr[-2000:], file=sys.stderr)
    return rows, child.returncode


def run_fuzzers(device: str, examples: int, env: dict) -> tuple[list[dict], int]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "fuzz.json"
        child = pytest([str(TESTS / "fuzz_cases.py")], dict(env, SNACK_FUZZ_DEVICE=device,
                                                               SNACK_FUZZ_EXAMPLES=str(examples),
                                                               SNACK_FUZZ_REPORT=str(report)))
        rows = []
        if report.exists():
            for r in json.loads(report.read_text())["outcomes"]:
                rows.append({"kind": "fuzz", "device": device, "target": r["target"], "outcome": r["outcome"],
                             "count": r["examples"]})
        if child.returncode != 0:
            print(child.stdout[-4000:], child.stderr[-2000:], file=sys.stderr)
    return rows, child.returncode


def markdown(rows: list[dict], runs: list[dict], info: dict, examples: int) -> str:
    lines = benchmark.markdown_head("Bad inputs and fuzzing: what each case and example ended in", info)
    lines += [f"Matrix: `tests/python/bad_inputs.py` (each case asserts the documented error and an unchanged state, "
              f"or the right result; the cases that hand memory to a kernel run in a child process). Fuzzers: "
              f"`tests/python/fuzz_cases.py`, hypothesis, derandomized, {examples} examples per target per device; "
              "every example ends accepted (and then checked: valid pattern, results against float64, state "
              "consistent) or in a documented error (and then checked: nothing changed). Any other ending fails its "
              "run.", "", "| device | run | exit code | seconds |", "|---|---|---|---|"]
    lines += [f"| {r['device']} | {r['run']} | {r['returncode']} | {r['seconds']:.0f} |" for r in runs]
    for device in sorted({r["device"] for r in rows}):
        matrix = Counter(r["outcome"] for r in rows if r["device"] == device and r["kind"] == "matrix")
        lines += ["", f"## {device}", "", "Matrix cases: " + ", ".join(f"{n} {o}" for o, n in sorted(matrix.items())),
                  "", "| fuzz target | examples | outcomes |", "|---|---|---|"]
        targets = sorted({r["target"] for r in rows if r["device"] == device and r["kind"] == "fuzz"})
        for t in targets:
            mine = [r for r in rows if r["device"] == device and r["kind"] == "fuzz" and r["target"] == t]
            total = sum(r["count"] for r in mine)
            lines.append(f"| {t} | {total} | " + ", ".join(f"{r['outcome']} {r['count']}" for r in mine) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=500, help="fuzz examples per target and device")
    parser.add_argument("--devices", default=None, help="cpu,cuda (default: cpu, and cuda when there is a GPU)")
    parser.add_argument("--out", type=Path, default=benchmark.RESULTS_DIR)
    args = parser.parse_args(argv)
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    env = dict(os.environ)
    rows, runs = [], []
    jobs = [(",".join(devices), "matrix", lambda: run_matrix(devices, env))]
    jobs += [(d, "fuzzers", lambda d=d: run_fuzzers(d, args.examples, env)) for d in devices]
    for device, name, run in jobs:
        t0 = time.time()
        print(f"{device}: {name} ...", flush=True)
        found, code = run()
        rows += found
        runs.append({"device": device, "run": name, "returncode": code, "seconds": time.time() - t0})
        print(f"{device}: {name}: exit {code}, {sum(r['count'] for r in found)} cases/examples, "
              f"{time.time() - t0:.0f} s", flush=True)
    info = benchmark.provenance()
    stem = args.out / f"robustness_{benchmark.gpu_slug()}"
    benchmark.write_csv(stem.with_suffix(".csv"), info, ["kind", "device", "target", "outcome", "count"], rows)
    stem.with_suffix(".md").write_text(markdown(rows, runs, info, args.examples))
    print(f"wrote {stem}.{{csv,md}}")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
