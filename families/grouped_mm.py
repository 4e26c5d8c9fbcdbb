"""Why transformers' MoE experts leave their grouped GEMM path: `_can_use_grouped_mm`
(transformers 5.18 integrations/moe.py) answers only yes or no, and on "no" `_grouped_mm` runs the
per-expert fallback op, one small matmul per expert, without a word. This module gives the reason
and the fix by testing the same conditions, in the same order, through the same version and
compile predicates (read from that module at call time, so both agree). A compatibility fact of
the pinned transformers, shared by verify (experts_path) and the runtime guard (experts_watch).

torch is imported here: build/ never imports this module.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TENSOR_NAMES = ("input", "weight")       # _can_use_grouped_mm(input, weight, offs) checks these two
FALLBACK = "grouped_mm_fallback"         # the kind: grouped_mm configured, the per-expert op ran
PER_EXPERT = ("eager", FALLBACK)         # one small matmul per expert: what training must not run
LOAD_FIX = ('load the model with experts_implementation="grouped_mm" (`from_pretrained(..., '
            'experts_implementation="grouped_mm")` raises the real error instead of picking eager), or call '
            '`model.set_experts_implementation("grouped_mm")`')


def builtin_node_kind(node) -> str | None:
    """The experts implementation a backward node of torch's own ops belongs to (None: another op,
    or a kernel's autograd Function, which each caller names its own way)."""
    name = type(node).__name__
    if FALLBACK in name:
        return FALLBACK                         # GeneratedBackwardFor_transformers_grouped_mm_fallback_...
    if name.startswith("GroupedMm"):
        return "grouped_mm"
    if name.startswith("Bmm"):
        return "batched_mm"
    if name.startswith(("MmBackward", "AddmmBackward")):
        return "eager"                          # the loop's per-expert F.linear
    return None


def moe_module():
    from transformers.integrations import moe

    return moe


def device_type(device) -> str:
    """'cuda' for torch.device('cuda:0'), 'cuda:0' or anything with a .type; not parsed by torch,
    which knows "tpu" only once a TPU backend registered it."""
    return getattr(device, "type", None) or str(device).split(":")[0]


# -- why _can_use_grouped_mm says no ------------------------------------------------------------------------
def misaligned(tensors) -> list[str]:
    names = [*TENSOR_NAMES, *(f"tensor {i}" for i in range(len(TENSOR_NAMES), len(tensors)))]
    return [f"{name} (data_ptr % 16 = {t.data_ptr() % 16})" for name, t in zip(names, tensors) if t.data_ptr() % 16]


def why_not_grouped(device, dtype, *tensors, compiling: bool | None = None,
                    capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """(reason, fix), ('', '') when grouped_mm can run. Each branch mirrors one condition of
    transformers 5.18 integrations/moe.py `_can_use_grouped_mm`, in its order, through the same
    version and compile predicates (read from that module at call time, so both agree)."""
    moe = moe_module()
    kind, version = device_type(device), torch.__version__
    have = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")
    none = (f"torch {version} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm",
            "use torch >= 2.9 (the image's torch has both)")
    if kind == "tpu":
        return ("", "") if have else none
    compiling = moe.is_torchdynamo_compiling() if compiling is None else compiling
    if compiling and dtype != torch.bfloat16:
        return (f"under torch.compile grouped_mm takes only bfloat16 weights (inductor), and these are {dtype}",
                "train the experts in bfloat16 (FSDP2 param_dtype), or run them without torch.compile")
    if kind == "cpu" and moe.is_torch_less_or_equal("2.10.0", accept_dev=True) and (bad := misaligned(tensors)):
        return (f"on CPU, torch {version} (<= 2.10) runs grouped_mm only on 16-byte aligned tensors, and "
                f"{', '.join(bad)} is not (memory-mapped safetensors weights can be unaligned)",
                "use torch >= 2.11, or load the weights without memory-mapping them")
    if kind == "cpu" and moe.is_torch_less_or_equal("2.8.0", accept_dev=True):
        return f"torch {version} (<= 2.8) has no CPU kernel for grouped_mm", "use torch >= 2.9"
    if kind == "cuda":
        return why_not_on_cuda(device, capability, version, none)
    return ("", "") if have else none


def why_not_on_cuda(device, capability, version: str, none: tuple[str, str]) -> tuple[str, str]:
    moe = moe_module()
    cap = tuple(capability) if capability is not None else torch.cuda.get_device_capability(device)
    sm = f"sm_{cap[0]}{cap[1]}"
    ampere = (f"grouped_mm needs compute capability 8.0 or newer (Ampere, sm_80) with torch {version}, and this "
              f"GPU is {sm}", "run on an sm_80 or newer GPU (A100, H100, B200)")
    if hasattr(F, "grouped_mm") or (hasattr(torch, "_grouped_mm") and moe.is_torch_greater_or_equal("2.9",
                                                                                                   accept_dev=True)):
        return ("", "") if cap >= (8, 0) else ampere
    if hasattr(torch, "_grouped_mm"):
        return ("", "") if cap[0] == 9 else (
            f"torch {version} (< 2.9) has only torch._grouped_mm, which runs on Hopper (sm_90) alone, and this "
            f"GPU is {sm}", "use torch >= 2.9 (grouped_mm on sm_80 and newer), or a Hopper GPU")
    return none


def fallback_reason(device, dtype, *tensors, compiling: bool | None = None,
                    capability: tuple[int, int] | None = None) -> str:
    """Why `_can_use_grouped_mm` says no for these facts ('' when it says yes)."""
    return why_not_grouped(device, dtype, *tensors, compiling=compiling, capability=capability)[0]


