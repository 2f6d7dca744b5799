"""How snack measures: provenance of result files, cold-L2 CUDA-event timing, CUDA-graph capture and
replay, the bandwidth ceiling, and CSV/Markdown result files. Used by bench/, the examples and the
tests; usable for measuring any layer the same way."""

from __future__ import annotations

import datetime
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

# The repository's result folder, for runs from a source checkout (bench/results/).
RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"


def _on_gpu(device) -> bool:
    """Whether results are measured on the GPU: the run's device when given, else whether one exists."""
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def _cuda_device(device):
    """The CUDA device a run uses: the given one, or the current one."""
    return torch.device(device) if device is not None and torch.device(device).index is not None else None


def gpu_slug(device=None) -> str:
    """The result files' suffix: a slug of the GPU's name, or "cpu" for a run on the CPU (``device``)."""
    name = torch.cuda.get_device_name(_cuda_device(device)) if _on_gpu(device) else "cpu"
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def cpu_name() -> str:
    """The CPU's model name (Linux), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def git_commit() -> str:
    env = os.environ.get("SNACK_COMMIT")
    if env:
        return env
    try:
        root = Path(__file__).resolve().parents[2]
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=root, text=True).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, text=True)
        return sha + ("+dirty" if dirty.strip() else "")
    except Exception:
        return "unknown"


def provenance(device=None) -> dict[str, str]:
    props = torch.cuda.get_device_properties(_cuda_device(device)) if _on_gpu(device) else None
    return {
        "gpu": props.name if props else "none",
        "sms": str(props.multi_processor_count) if props else "-",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(),
    }


def short_commit(info: dict[str, str], length: int = 10) -> str:
    """The commit a result file names, for a plot's title: its hash alone, without a note after it."""
    return info.get("commit", "unknown").split()[0][:length]


def command_line() -> str:
    """The command that is running, as a user would type it from the repository's root."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(Path(__file__).resolve().parents[2]))
        except ValueError:
            pass
        argv.insert(0, "python")
    elif argv and argv[0] == "-m":
        argv.insert(0, "python")
    return shlex.join(argv) if argv else "?"


class ColdTimer:
    """Times one GPU launch sequence with CUDA events after flushing L2 (writes 2x the L2 size).

    After the flush the GPU spins for SPIN_CYCLES clock cycles (``torch.cuda._sleep``; ~100 us at the
    H200's ~2 GHz) before the start event, so the host has queued the timed sequence by the time it
    starts: the time is the GPU's, not the host's launch overhead (which, for a 5 us kernel, can
    otherwise exceed the kernel itself). A sequence whose host side takes longer than the flush and
    the spin together is still partly host-timed."""

    SPIN_CYCLES = 200_000
    #: How the times were taken, for the `method` line of result files.
    METHOD = (f"CUDA events, L2 flushed before each call and the GPU held {SPIN_CYCLES} clock cycles "
              "(~100 us at 2 GHz) after the flush so that host launch time is not counted")

    def __init__(self) -> None:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.flush_buf = torch.empty(max(2 * l2, 64 << 20) // 4, dtype=torch.float32, device="cuda")
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def median_us(self, fn: Callable[[], object], reps: int = 30, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.flush_buf.fill_(1.0)
            torch.cuda._sleep(self.SPIN_CYCLES)
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(self.start.elapsed_time(self.end) * 1e3)
        return statistics.median(times)


def capture_graph(fn: Callable[[], object], warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """Runs `fn` `warmup` times on a side stream (as CUDA-graph capture requires), then captures it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_times_ms(graph: "torch.cuda.CUDAGraph", reps: int, before_each: Callable[[int], object] | None = None) -> list:
    """GPU time (ms, CUDA events) of each of `reps` replays of `graph`; `before_each(i)` runs before
    replay i, outside the timed region (to load a new input, say)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        if before_each is not None:
            before_each(i)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written) in GB/s: the ceiling for memory-bound ops."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times) / 1e9


# The benchmarks' precisions by name, and the relative error allowed against float64 before a result
# is timed (the 16-bit types round each output once: unit roundoff 2^-8 for bf16, 2^-11 for fp16).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}


def useful_tflops(nnz: int, n: int, us: float) -> float:
    """TFLOP/s of a sparse product's useful work (2 x nnz x N flops) done in `us` microseconds,
    whatever kernel or baseline ran it."""
    return 2.0 * nnz * n / (us * 1e6)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.shape != ref.shape:
        return math.inf
    out64 = out.double()
    if not torch.isfinite(out64).all():
        return math.inf
    denom = ref.norm().item()
    return (out64 - ref).norm().item() / (denom if denom > 0 else 1.0)


def shape_list(text: str | None, default=()) -> list[tuple[int, ...]]:
    """Shapes from a command line ("16384x4096,768x3072"), or `default` where it names none."""
    return [tuple(int(v) for v in shape.split("x")) for shape in text.split(",")] if text else list(default)


def number_list(text: str | None, default=(), kind=int) -> list:
    """Numbers of type `kind` from a command line ("1,16,128"), or `default` where it names none."""
    return [kind(v) for v in text.split(",")] if text else list(default)


def geomean(values: Iterable[float]) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def header_text(header: dict[str, str]) -> str:
    """The provenance block of a CSV or text result file: one `# key: value` line each."""
    return "".join(f"# {key}: {value}\n" for key, value in header.items())


def markdown_head(title: str, header: dict[str, str]) -> list[str]:
    """The first lines of a Markdown report: its title and the provenance as a list."""
    return [f"# {title}", ""] + [f"- {key}: {value}" for key, value in header.items()] + [""]


def write_text(path: Path, header: dict[str, str], text: str) -> None:
    """A text result file (a profile table, say) under its provenance block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header_text(header) + text + "\n")


def write_csv(path: Path, header: dict[str, str], columns: list[str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write(header_text(header))
        f.write(",".join(columns) + "\n")
        for row in rows:
            f.write(",".join(_fmt(row.get(c, "")) for c in columns) + "\n")


def read_csv(path: Path, int_columns=("M", "K", "N")) -> tuple[dict[str, str], list[dict]]:
    """A result CSV written by write_csv: its provenance block and its rows (the int_columns as int,
    the other numbers as float, the rest as text)."""
    info, rows, header = {}, [], None
    for line in Path(path).read_text().splitlines():
        if line.startswith("# "):
            key, _, value = line[2:].partition(": ")
            info[key] = value
        elif header is None:
            header = line.split(",")
        else:
            row = dict(zip(header, line.split(",")))
            for key, value in row.items():
                try:
                    row[key] = int(value) if key in int_columns else float(value)
                except ValueError:
                    pass
            rows.append(row)
    return info, rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.1f}"
    return str(v)


def pyplot():
    """matplotlib.pyplot on the Agg backend (plots go to files), or None where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def results_folder(out, device):
    """Where an example writes its result files: ``out`` when given, else bench/results for a run on
    a GPU, else nowhere (None)."""
    return out if out is not None else (RESULTS_DIR if torch.device(device).type == "cuda" else None)


def progress(iterable, total: int, desc: str):
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc, mininterval=2.0)
    except ImportError:  # pragma: no cover
        return iterable
