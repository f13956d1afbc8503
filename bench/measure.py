"""What the bench/ scripts share: the machine they ran on, the median and spread of repeated
timings, Markdown tables, and the results folder (runs/bench/). Each script that imports it puts
bench/ and the repository root on sys.path first."""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------
def cpu_model() -> str:
    """lscpu's "Model name", else /proc/cpuinfo's "model name", else platform's guess."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        match = re.search(r"^Model name:\s*(.+)$", text, re.M)
        if match:
            return match.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags: precision.cpu_flags, the ones its bf16 probe reads."""
    from srt.precision import cpu_flags

    return cpu_flags()


def machine() -> dict:
    """Everything a reader needs to judge whether a table applies to their machine. bf16 units:
    AMX (amx_bf16) or AVX512-BF16 (avx512_bf16), either of which makes bf16 autocast faster than fp32
    (precision.cpu_has_fast_bf16, bench/precision.py), so both are recorded. "AMD EPYC" names
    more than one machine kind: the vector ISA that ATen's kernels run (AVX2 or AVX512) told a
    2-core EPYC with AVX-512 apart from one without, which took about twice as long a step."""
    import torch

    from srt.precision import cpu_has_fast_bf16

    flags = cpu_flags()
    info = {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "vector_isa": torch.backends.cpu.get_cpu_capability(),
        "avx512f": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx_bf16": "amx_bf16" in flags,
        "fast_bf16": cpu_has_fast_bf16(),  # the CPU's: --dtype auto autocasts to bf16 on it
        "gpu": None,
        "gpu_bf16": None,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_bf16"] = torch.cuda.is_bf16_supported()
    return info


def machine_line(info: dict) -> str:
    """The machine in one line: the GPU where there is one, then the CPU, which runs the Python of
    every step and, without a GPU, the model."""
    units = [name for name in ("amx_bf16", "avx512_bf16") if info.get(name)]
    bf16 = f"bf16 units ({', '.join(units)})" if info["fast_bf16"] else "no bf16 units (auto: fp32)"
    cpu = f"{info['cpu']} ({info['vector_isa']}), {info['logical_cpus']} logical CPUs, {bf16}"
    gpu = f"{info['gpu']} ({'bf16' if info.get('gpu_bf16') else 'no bf16'}); " if info.get("gpu") else ""
    return (
        f"{gpu}{cpu}; torch {info['torch']}, {info['torch_threads']} threads, "
        f"transformers {info['transformers']}"
    )


def _version(name: str):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def bf16_available() -> bool:
    """Where bf16 autocast pays: a GPU, or a CPU with AMX or AVX512-BF16 (precision.resolve_dtype's
    rule)."""
    import torch

    from srt.precision import cpu_has_fast_bf16

    return torch.cuda.is_available() or cpu_has_fast_bf16()


def resolve_precisions(spec: str) -> list[str]:
    """--precisions auto|fp32|bf16|fp32,bf16 -> the list to measure. auto: fp32 always, bf16 only
    where the hardware has it (emulated bf16 is slower than fp32 and says nothing about either
    implementation). Asking for bf16 on hardware without it stops with one line."""
    if spec == "auto":
        return ["fp32", "bf16"] if bf16_available() else ["fp32"]
    wanted = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in ("fp32", "bf16")]
    if unknown or not wanted:
        sys.exit(f"error: --precisions {spec!r}: use auto, fp32, bf16 or fp32,bf16")
    if "bf16" in wanted and not bf16_available():
        sys.exit(
            "error: --precisions bf16 needs a GPU or a CPU with bf16 units (AMX or AVX512-BF16); "
            "this machine has neither (use --precisions fp32)"
        )
    return list(dict.fromkeys(wanted))


def peak_rss_gib() -> float:
    """Peak resident set size of this process so far. On Linux, VmHWM of /proc/self/status: the
    high-water mark of this process's own memory. Not ru_maxrss: Linux carries it across fork and
    exec, so a worker started by a parent holding a model would report the parent's peak as its own
    (macOS has no /proc; its ru_maxrss is in bytes)."""
    try:
        match = re.search(r"^VmHWM:\s+(\d+)\s+kB", Path("/proc/self/status").read_text(), re.M)
        if match:
            return int(match.group(1)) / 2**20
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


# --------------------------------------------------------------------------------------------
# Repeated measurements: median and spread
# --------------------------------------------------------------------------------------------
def describe(values) -> dict | None:
    """{median, min, max, q1, q3, n} of the finite values, None when there are none. The median
    rather than the mean: on a shared 2-core machine one step slowed by another process would
    move a mean; min-max shows how noisy the run was, q1-q3 what a typical step did."""
    values = sorted(float(v) for v in values if v is not None and v == v)
    if not values:
        return None
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "median": statistics.median(values),
        "min": values[0],
        "max": values[-1],
        "q1": q1,
        "q3": q3,
        "n": len(values),
    }


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"


def fmt_stat(stat: dict | None, digits: int = 3) -> str:
    """'12.3 (11.9-13.0)': median (min-max); just the value when every sample agrees."""
    if stat is None:
        return "n/a"
    if stat["min"] == stat["max"]:
        return fmt(stat["median"], digits)
    return f"{fmt(stat['median'], digits)} ({fmt(stat['min'], digits)}-{fmt(stat['max'], digits)})"


def markdown_table(header: list[str], rows: list[list], align: str | None = None) -> str:
    """header ['metric', 'ours', ...]; rows of cells (strings or numbers); align: one letter per
    column, l or r (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)

    def cell(v):
        return v if isinstance(v, str) else fmt(v)

    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# The mark of a benchmark's folder, made when a benchmark first claims it: what is in it is the
# benchmarks' own to replace. A folder of other files without it is the user's.
BENCH_MARK = ".bench-out"


def check_out(out) -> Path:
    """A benchmark's --out, checked before it runs (its results are written at the end, minutes
    later): a folder, or a path where one can be made, holding nothing but what benchmarks wrote;
    else one line naming what is wrong. The folder is made and marked as a benchmark's (BENCH_MARK)."""
    out = Path(out)
    try:
        if out.is_symlink() and not out.exists():
            sys.exit(f"error: --out {out} is a link to {os.readlink(out)}, which does not exist")
        if out.exists() and not out.is_dir():
            sys.exit(f"error: --out {out} is a file, not a folder")
        there = out
        while not there.exists():  # the nearest folder that exists: write_results makes the rest
            there = there.parent
        if not there.is_dir():
            sys.exit(f"error: --out {out}: {there} is a file, not a folder")
        if not os.access(there, os.W_OK):
            sys.exit(f"error: --out {out} is not a folder this benchmark can write ({there} is read-only)")
        check_no_foreign_files(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / BENCH_MARK).touch()
    except OSError as e:  # a name too long, a full disk, a folder of another user
        sys.exit(f"error: --out {out}: cannot write there ({e.strerror})")
    return out


def check_no_foreign_files(out: Path) -> None:
    """A folder holding files but no BENCH_MARK is someone else's (a run, the user's data): a
    benchmark's results would replace those named like them."""
    if not out.is_dir() or (out / BENCH_MARK).exists():
        return
    foreign = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        sys.exit(f"error: --out {out} holds files no benchmark wrote ({shown}); give a new or empty folder")


def write_results(out: Path, name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    """<out>/<name>.json and <out>/<name>.md, written together (atomic_write_texts). Where they
    cannot be written (a full disk), the table is printed, so that the measurement is not lost
    with them, and the benchmark ends in one line naming the file; an earlier result there stays."""
    from srt.data_io import atomic_write_texts

    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    try:
        atomic_write_texts(
            {
                json_path: json.dumps(payload, indent=2, default=str) + "\n",
                md_path: markdown if markdown.endswith("\n") else markdown + "\n",
            }
        )
    except OSError as e:
        print(markdown, flush=True)
        sys.exit(
            f"error: {e.filename or out}: {e.strerror}; the results are printed above, not saved "
            f"(what {out} held before is as it was)"
        )
    return json_path, md_path


def bench_records(data: str, synthetic: int = 0, split: str = "train") -> list[dict]:
    """The records a benchmark runs on: --data, or with --synthetic N a fresh stage-0 corpus of N
    dialogues in a temporary folder (its `split` file, else its train file). Exits with one line
    when the file is missing or malformed."""
    import tempfile

    from srt.data_io import DataError, read_jsonl

    try:
        if synthetic:
            import stage0_build

            tmp = Path(tempfile.mkdtemp())
            stage0_build.main(["--num-dialogues", str(synthetic), "--out", str(tmp), "--quiet"])
            return read_jsonl(tmp / f"{split}.jsonl") or read_jsonl(tmp / "train.jsonl")
        return read_jsonl(data)
    except (DataError, OSError) as e:
        sys.exit(f"error: {e}")
