"""Where a command's CPU goes, by kind of process: the test suite's time, taken apart.

    python bench/cpu_by_process.py [--every 2] [--json OUT] -- ./dev test --durations=40

On a 2-core CI machine the suite is CPU-bound, so its wall time is its total CPU over two,
and only less work shortens it. This samples every process on the machine (containers'
included: the engine runs them on this kernel) every --every seconds while the command runs,
charges each one's new CPU time to a kind read from its command line (training ranks, the
verify gate, the launcher, nvcc and the host compiler, pip, the image assembler, the engine,
pytest itself, ...), and prints CPU seconds and shares by kind, beside the machine's busy
time from /proc/stat, which also counts what the samples miss (processes shorter than one
interval, the kernel's own threads).

CPU a process used before the command started is not charged.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# First match wins: (kind, substrings of the command line, or of the process name when the
# command line is empty, as for kernel threads).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kernel compile (nvcc, cicc, ptxas, cc1plus, ld)",
     ("nvcc", "cicc", "ptxas", "cc1plus", "cudafe++", "fatbinary", "nvlink", "ninja", "collect2", "/ld ")),
    ("training rank", ("entrypoint.train",)),
    ("torchrun agent", ("entrypoint.launcher.agent",)),
    ("verify (gate, CLI, in containers)", ("-m verify", "verify/__main__", " verify ")),
    ("launcher (finetune, preflight, tokenising)", ("-m entrypoint",)),
    ("pip", ("-m pip", "/pip ", "bin/pip")),
    ("image build CLI (resolve, assemble, gzip, push)", ("-m build",)),
    ("pytest workers (in-process tests)", ("pytest", "execnet", "exec(eval(sys.stdin")),
    ("engine (dockerd, containerd, layer untar)", ("dockerd", "containerd", "runc", "/proc/self/exe")),
    ("base bootstrap (debootstrap, dpkg, apt)", ("debootstrap", "dpkg", "apt-get", "chroot")),
)
OTHER_PYTHON = "other Python"
OTHER = "other"


def kind_of(cmdline: str, name: str) -> str:
    text = cmdline or name
    for kind, needles in KINDS:
        if any(needle in text for needle in needles):
            return kind
    return OTHER_PYTHON if "python" in (cmdline.split(" ", 1)[0] or name) else OTHER


@dataclass
class Sample:
    """One process's kind and CPU ticks so far."""
    kind: str
    ticks: int


@dataclass
class Ledger:
    """CPU ticks charged by kind. The first sight of a process charges nothing: what it used
    before the ledger began is not the command's."""
    hz: int = field(default_factory=lambda: os.sysconf("SC_CLK_TCK"))
    seen: dict[tuple[int, str], Sample] = field(default_factory=dict)   # by (PID, start time): a reused PID is new
    ticks: Counter = field(default_factory=Counter)
    started: bool = False

    def observe(self, processes: list[tuple[int, str, str, str, int]]) -> None:
        """processes: (pid, start time, name, command line, utime + stime ticks)."""
        for pid, start, name, cmdline, ticks in processes:
            key = (pid, start)
            sample = self.seen.get(key)
            if sample is None:
                sample = self.seen[key] = Sample(kind_of(cmdline, name), ticks)
                if self.started:
                    self.ticks[sample.kind] += ticks   # born since the last look: all of it is the command's
                continue
            if ticks > sample.ticks:
                self.ticks[sample.kind] += ticks - sample.ticks
                sample.ticks = ticks
        self.started = True

    def seconds(self) -> dict[str, float]:
        return {kind: ticks / self.hz for kind, ticks in self.ticks.most_common()}


def read_processes(proc: Path = Path("/proc")) -> list[tuple[int, str, str, str, int]]:
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue        # it exited while we looked
        close = stat.rindex(")")
        name, fields = stat[stat.index("(") + 1:close], stat[close + 2:].split()
        # fields[11], [12]: utime, stime; [19]: start time (man 5 proc, counted from the state field)
        found.append((int(entry.name), fields[19], name, cmdline, int(fields[11]) + int(fields[12])))
    return found


def busy_ticks(stat: Path = Path("/proc/stat")) -> int:
    """The machine's busy ticks since boot: all but idle and iowait."""
    values = [int(v) for v in stat.read_text().splitlines()[0].split()[1:9]]
    return sum(values) - values[3] - values[4]


def table(ledger: Ledger, busy_seconds: float, wall: float) -> str:
    charged = ledger.seconds()
    total = sum(charged.values())
    lines = [f"{'kind':<52} {'CPU s':>9} {'share':>7}"]
    for kind, seconds in charged.items():
        lines.append(f"{kind:<52} {seconds:>9.1f} {seconds / total if total else 0:>7.1%}")
    lines.append(f"{'sampled, all kinds':<52} {total:>9.1f}")
    lines.append(f"{'machine busy (/proc/stat)':<52} {busy_seconds:>9.1f}   "
                 f"({busy_seconds / wall if wall else 0:.2f} cores over {wall:.0f} s wall)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples (default 2)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.every <= 0:
        parser.error("give a positive --every and a command after --")

    ledger, done = Ledger(), threading.Event()
    ledger.observe(read_processes())
    busy_before = busy_ticks()
    started = time.monotonic()

    def sample() -> None:
        while not done.wait(args.every):
            ledger.observe(read_processes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = subprocess.call(command)
    except OSError as exc:
        print(f"cpu_by_process: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return 2
    finally:
        done.set()
        sampler.join()
    ledger.observe(read_processes())
    wall = time.monotonic() - started
    busy = (busy_ticks() - busy_before) / ledger.hz
    print(table(ledger, busy, wall))
    if args.json:
        args.json.write_text(json.dumps({"command": command, "exit": code, "wall_s": round(wall, 1),
                                         "busy_cpu_s": round(busy, 1), "by_kind_cpu_s": ledger.seconds()},
                                        indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
