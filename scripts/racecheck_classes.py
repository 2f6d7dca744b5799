"""compute-sanitizer's racecheck over a command, its hazard reports counted by class.

A racecheck run of the kernel tests can print tens of thousands of reports; what matters is which
pairs of accesses they are. This runs the command under ``compute-sanitizer --tool racecheck
--racecheck-report all --print-limit 0`` and groups every report by (severity, hazard, first
access's site, second access's site), a site being the function and ``file:line`` the tool names
(build with line information for the lines); a report of another form is counted by its first line.
Prints the classes, most frequent first, and the tool's summary; exits with the tool's status.

    python scripts/racecheck_classes.py -- python -m pytest -q tests/python/test_kernels_cuda.py -k sddmm_tile_view
    python scripts/racecheck_classes.py --kernel regex:tile_view --log /tmp/rc.txt -- python my_script.py
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

HEADER = re.compile(r"=+ (Error|Warning|Info): (?:\([^)]*\) )?(?:Potential )?(\w+) hazard detected at (__\w+__)")
# Any report's first line, so that a form HEADER does not know is still counted and shown.
REPORT = re.compile(r"=+ (Error|Warning|Info): (.*)")
ACCESS = re.compile(r"=+\s+(Read|Write)(?: Thread| access)?.*? at (.+?)(?:\+0x[0-9a-f]+)?(?: in (\S+))?\s*$")
SUMMARY = re.compile(r"RACECHECK SUMMARY|ERROR SUMMARY")


def site(function: str, where: str | None) -> str:
    """A report's access site: the function's name without its parameter list, and its file:line."""
    name = function.strip()
    if name.endswith(")"):  # drop the last balanced (...) group: the parameters
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = re.sub(r"^(void|auto)\s+", "", name.strip())
    return f"{name} ({where})" if where else name


def unknown_form(text: str) -> str:
    """A report line HEADER does not parse, its addresses and numbers dropped, so that one form is one class."""
    return re.sub(r"0x[0-9a-f]+|\(\d+,\d+,\d+\)|\d+", "#", text.strip())


def classify(lines) -> tuple[collections.Counter, list[str]]:
    """The classes of the hazard reports in racecheck's output lines, and its summary lines. A report
    whose first line is not of the hazard form known here is its own class, named by that line."""
    classes: collections.Counter = collections.Counter()
    summary, current = [], None
    for line in lines:
        header = HEADER.search(line) or REPORT.search(line)
        if header:
            if current:
                classes[tuple(current)] += 1
            if header.re is HEADER:
                current = [header.group(1), header.group(2), header.group(3)]
            else:
                current = [header.group(1), "unparsed", unknown_form(header.group(2))]
            continue
        access = ACCESS.search(line)
        if current is not None and access and len(current) < 5:
            current.append(f"{access.group(1)} at {site(access.group(2), access.group(3))}")
            continue
        if SUMMARY.search(line):
            summary.append(line.strip("= \n"))
    if current:
        classes[tuple(current)] += 1
    return classes, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", default=None, help="compute-sanitizer's --kernel-name filter, e.g. regex:tile_view")
    parser.add_argument("--log", type=Path, default=None, help="also keep the tool's whole output here")
    parser.add_argument("--sanitizer", default="compute-sanitizer")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to check, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to check after --")
    tool = [args.sanitizer, "--tool", "racecheck", "--racecheck-report", "all", "--print-limit", "0",
            "--show-backtrace", "no", "--error-exitcode", "9"]
    if args.kernel:
        tool += ["--kernel-name", args.kernel]
    run = subprocess.run(tool + command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if args.log:
        args.log.write_text(run.stdout)
    classes, summary = classify(run.stdout.splitlines())
    for line in run.stdout.splitlines():
        if re.search(r"\d+ (passed|failed)", line):
            print(line)
    print(f"{sum(classes.values())} hazard reports in {len(classes)} classes")
    for key, count in classes.most_common():
        severity, kind, space, *accesses = key
        print(f"{count:8d}  {severity} {kind} on {space}: " + " / ".join(accesses))
    for line in summary:
        print(line)
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
