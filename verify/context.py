"""What every check gets: the lock (or why it is missing), the device, the model family."""
from __future__ import annotations

from dataclasses import dataclass

from verify.families import Family
from verify.lock import BuildLock, LockedKernel


@dataclass(frozen=True)
class Context:
    lock: BuildLock | None
    device: str                    # "cuda" or "cpu", already resolved from --device
    family: Family | None
    deep: bool = False             # hash every installed file, even huge ones

    def lock_kernel_for(self, replaces: str) -> LockedKernel | None:
        if self.lock is None:
            return None
        for kernel in self.lock.kernels:
            if replaces in kernel.replaces:
                return kernel
        return None

    @property
    def attn_implementation(self) -> str:
        """What the image promises (lock), else what the family needs."""
        if self.lock is not None and self.lock.attn_implementation:
            return self.lock.attn_implementation
        return self.family.attention.implementation if self.family else "sdpa"
