"""Which backward a call recorded: the kernel's own autograd Function, or torch's aten ops.

A fused kernel (flash-attn, fla, causal-conv1d) is a torch.autograd.Function: the graph node it
leaves has `_forward_cls`, the Function class, defined in the kernel's package. The torch
reference leaves only aten nodes (ToCopyBackward0, MulBackward0...). We walk the part of the
graph this one call created (from its outputs back to its inputs' nodes, no further), so the
kernel node of an earlier layer is never mistaken for this call's. Python only, no host sync.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

TORCH_PACKAGES = ("torch", "transformers")   # Functions defined here are not a kernel's
MAX_NODES = 20_000                           # a torch reference call leaves hundreds; stop well after


@dataclass(frozen=True)
class Backward:
    root: object | None           # the output's grad_fn (None: the output needs no gradient)
    kernel: object | None         # the kernel Function's node in this call's graph, if any
    kernel_name: str = ""         # module.qualname of that Function
    torch_ops: int = 0            # aten nodes seen in this call's graph
    root_name: str = ""

    @property
    def describe(self) -> str:
        if self.kernel is not None:
            return self.kernel_name
        return f"torch autograd ops ({self.root_name}, {self.torch_ops} nodes)" if self.root is not None else "none"


def tensors(value):
    """Every tensor in a (nested) call argument or result."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif hasattr(value, "to_tuple"):          # transformers ModelOutput
        yield from tensors(value.to_tuple())


def function_class(node):
    """The autograd.Function class behind a node, or None for an aten node."""
    return getattr(node, "_forward_cls", None)


def is_kernel_function(cls) -> bool:
    root = (getattr(cls, "__module__", "") or "").split(".", 1)[0]
    return bool(root) and root not in TORCH_PACKAGES


def inspect_call(output, inputs) -> Backward:
    roots = [t.grad_fn for t in tensors(output) if t.grad_fn is not None]
    if not roots:
        return Backward(root=None, kernel=None)
    stop = {id(t.grad_fn) for t in tensors(inputs) if t.grad_fn is not None}
    queue, seen, ops = deque(roots), set(), 0
    while queue and len(seen) < MAX_NODES:
        node = queue.popleft()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        cls = function_class(node)
        if cls is not None and is_kernel_function(cls):
            return Backward(root=roots[0], kernel=node, kernel_name=f"{cls.__module__}.{cls.__qualname__}",
                            torch_ops=ops, root_name=type(roots[0]).__name__)
        ops += 1
        queue.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    return Backward(root=roots[0], kernel=None, torch_ops=ops, root_name=type(roots[0]).__name__)


def count_backward(node, counter: dict, key: str) -> None:
    """Count each time backward reaches `node` (a pre-hook: it sees the gradient arrive)."""
    def hook(grad_outputs):
        counter[key] = counter.get(key, 0) + 1
    node.register_prehook(hook)


def in_backward() -> bool:
    """True inside an autograd backward pass (activation-checkpoint recompute runs there)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1
