"""Which GPU kernels ran, split into forward and backward, and what that means.

The profile is taken in two windows (forward, then backward) so a kernel is attributed to the
pass that launched it without relying on autograd-thread correlation.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from verify.calltrace import watch_calls
from verify.report import CheckResult, Status


@dataclass(frozen=True)
class PhaseKernels:
    forward: tuple[str, ...]
    backward: tuple[str, ...]


@dataclass
class StepProfile:
    kernels: PhaseKernels
    torch_reference_calls: dict[str, int] = field(default_factory=dict)   # label -> calls (must be 0)
    fused_calls: dict[str, int] = field(default_factory=dict)

    @property
    def launches(self) -> int:
        return len(self.kernels.forward) + len(self.kernels.backward)


def matching(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """Kernel names containing any pattern (demangled C++ names carry namespaces and templates)."""
    regex = re.compile("|".join(re.escape(p) for p in patterns)) if patterns else None
    return [n for n in names if regex is not None and regex.search(n)]


def kernel_verdict(op: str, kernels: PhaseKernels, forward_patterns: Sequence[str],
                   backward_patterns: Sequence[str], torch_reference_calls: int) -> CheckResult:
    """Pure: did the fused kernels run in forward AND backward, and the torch reference never?"""
    row = f"fused_ops.profile.{op}"
    fwd = matching(kernels.forward, forward_patterns)
    bwd = matching(kernels.backward, backward_patterns)
    data = {"forward_matches": len(fwd), "backward_matches": len(bwd), "torch_reference_calls": torch_reference_calls,
            "forward_kernels": len(kernels.forward), "backward_kernels": len(kernels.backward)}
    problems = []
    if torch_reference_calls:
        problems.append(f"the torch reference ran {torch_reference_calls}x")
    if not fwd:
        problems.append(f"no forward kernel matching {list(forward_patterns)}")
    if not bwd:
        problems.append(f"no backward kernel matching {list(backward_patterns)}")
    if problems:
        seen = sorted({_short(n) for n in kernels.forward + kernels.backward})[:8]
        return CheckResult(row, Status.FAIL, "; ".join(problems) + f" (kernels seen: {', '.join(seen) or 'none'})",
                           "the fused path did not run end to end; see dispatch rows and rebuild the image", data)
    return CheckResult(row, Status.PASS, f"forward: {len(fwd)} launch(es) e.g. {_short(fwd[0])}; backward: "
                       f"{len(bwd)} e.g. {_short(bwd[0])}; torch reference 0 calls", data=data)


def _short(name: str, limit: int = 60) -> str:
    name = re.sub(r"<.*>", "<...>", name)
    return name if len(name) <= limit else name[: limit - 3] + "..."


def cuda_kernel_names(prof) -> tuple[str, ...]:
    """Names of device kernels in a torch.profiler.profile result."""
    return tuple(e.name for e in prof.events() if e.device_type == DeviceType.CUDA)


def profile_phases(forward: Callable[[], object], backward: Callable[[object], None],
                   watched: dict | None = None, device: str = "cuda") -> StepProfile:
    """Run forward() then backward(result) under the profiler and the Python call watcher.

    On CPU (tests, dry runs) there are no device kernels, so both kernel lists come back empty
    and any verdict built on them FAILs; the call watcher still works.
    """
    on_cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    with watch_calls(watched or {}) as counts:
        with profile(activities=activities) as fwd_prof:
            out = forward()
            sync()
        with profile(activities=activities) as bwd_prof:
            backward(out)
            sync()
    kernels = PhaseKernels(cuda_kernel_names(fwd_prof), cuda_kernel_names(bwd_prof))
    torch_calls = {k: v for k, v in counts.items() if k.endswith(":torch")}
    fused_calls = {k: v for k, v in counts.items() if k.endswith(":fused")}
    return StepProfile(kernels, torch_calls, fused_calls)
