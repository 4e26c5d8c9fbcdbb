"""What every check gets: the lock (or why it is missing), the device, the model family, the
model being trained (its config, if one is mounted), and what the family needs fused.

What backs a function comes from the lock (build/ recorded the manifest's `replaces:`), never
from a table here; the family only names the functions and how boundaries reach them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contracts.lock import BuildLock, LockedKernel
from families import Family, FusedFunction


@dataclass(frozen=True)
class FusedNeed:
    """One function the family needs fused, joined with the lock's kernel that backs it (if any)."""

    function: str                  # e.g. "chunk_gated_delta_rule" (the lock's `replaces` vocabulary)
    wrapper: str                   # the modeling module's wrapped attribute
    boundary_kwarg: str            # how document boundaries reach the kernel (seq_idx, cu_seqlens)
    kernel: LockedKernel | None    # None: the image has no kernel for it

    @property
    def symbol(self) -> str:
        return self.kernel.python_api.get(self.function, "") if self.kernel else ""

    @property
    def forward_kernels(self) -> tuple[str, ...]:
        return tuple(self.kernel.profile_kernels.get("forward", ())) if self.kernel else ()

    @property
    def backward_kernels(self) -> tuple[str, ...]:
        return tuple(self.kernel.profile_kernels.get("backward", ())) if self.kernel else ()


@dataclass(frozen=True)
class Context:
    lock: BuildLock | None
    device: str                    # "cuda" or "cpu", already resolved from --device
    family: Family | None
    deep: bool = False             # hash every installed file, even huge ones
    model_config: dict[str, Any] | None = None   # the config.json of the model to be trained, if given
    model_source: str = ""         # where model_config came from (a path), for messages
    param_dtype: str = "bfloat16"  # the dtype training runs the model in
    no_lock: bool = False          # audit of an image without an ftimage lock: rows "as locked" are SKIP
    extra: dict[str, Any] = field(default_factory=dict)

    def kernel_for(self, function: str) -> LockedKernel | None:
        """The lock's (first) kernel wheel that backs `function`, e.g. causal_conv1d_fn."""
        if self.lock is None:
            return None
        found = self.lock.kernels_replacing(function)
        return found[0] if found else None

    def need(self, fused: FusedFunction) -> FusedNeed:
        return FusedNeed(function=fused.function, wrapper=fused.wrapper, boundary_kwarg=fused.boundary_kwarg,
                         kernel=self.kernel_for(fused.function))

    def needs(self) -> tuple[FusedNeed, ...]:
        return tuple(self.need(f) for f in self.family.fused_functions) if self.family else ()

    @property
    def attention_kernel(self) -> LockedKernel | None:
        return self.kernel_for(self.family.attention.replaces) if self.family else None

    @property
    def attn_implementation(self) -> str:
        """What the image promises (lock), else what the family needs."""
        if self.lock is not None and self.lock.attn_implementation:
            return self.lock.attn_implementation
        return self.family.attention.implementation if self.family else "sdpa"

    @property
    def probe_head_dim(self) -> int | None:
        """verify's probes run attention at a head dim the image compiled (a specialised
        flash-attn rightly refuses any other); without a lock (--no-lock), at the head dim of the
        model to be trained when one is given; else at the family's own."""
        if self.no_lock and self.model_config and self.family:
            head_dim = self.model_config.get(self.family.attention.config_keys.get("head_dim", "head_dim"))
            if isinstance(head_dim, int) and not isinstance(head_dim, bool) and 8 <= head_dim <= 1024:
                return head_dim
        kernel = self.attention_kernel
        if kernel is not None and kernel.specialisation.head_dims:
            return kernel.specialisation.head_dims[0]
        return self.family.attention.head_dims[0] if self.family else None
