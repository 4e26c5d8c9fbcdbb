"""Test double for mamba-ssm's SSD (Mamba2) kernels, at the path transformers 5.18 imports them:
`mamba_ssm.ops.triton.ssd_combined` (hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS).

  * `mamba_chunk_scan_combined`: transformers' own torch chunk scan
    (modeling_granitemoehybrid.mamba2_chunk_scan, unwrapped) run one document at a time, a document
    being a run of one `seq_idx` value in a row: where the real kernel's state passing resets.
  * `mamba_split_conv1d_scan_combined`: the Mamba2 mixer in one call, built from the pieces the
    mixer's torch path uses: split zxbcdt, the causal conv with seq_idx (the causal_conv1d
    double's reference), the chunk scan per document, the gated RMSNorm (per group of channels, as
    mamba-ssm's), the out projection.

Each runs behind its own autograd.Function whose backward recomputes the forward, so the guard
sees a kernel's backward. Signatures are mamba-ssm 2.3.1's (the kernels manifest's pin; 2.3.2 adds
`state_dtype`, which transformers never passes); transformers keeps only the kwargs they name
(applicable_params), so `seq_idx` arrives and `cu_seq_lens_q` does not. Final states are computed
without gradient (what a cache keeps), as the fla doubles do.
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:    # as mamba-ssm does: the module imports without causal-conv1d, the split kernel fails when called
    from causal_conv1d import _reference as _conv_reference
    _CONV_ERROR: ImportError | None = None
except ImportError as exc:
    _conv_reference, _CONV_ERROR = None, exc


@dataclass(frozen=True)
class _ScanOptions:
    chunk_size: int
    dt_softplus: bool
    dt_limit: tuple[float, float]


@dataclass(frozen=True)
class _SplitOptions:
    chunk_size: int
    dt_limit: tuple[float, float]
    activation: str | None
    rmsnorm_eps: float
    headdim: int | None
    ngroups: int
    norm_before_gate: bool


def _no_function() -> bool:
    return os.environ.get("FTIMAGE_TEST_KERNEL_NO_FUNCTION") == "1"


def _scan_reference():
    # imported at call time: transformers imports this module while it executes the modeling module
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid

    return inspect.unwrap(modeling_granitemoehybrid.mamba2_chunk_scan)


def _documents(seq_idx, row: int, steps: int) -> list[tuple[int, int]]:
    """The runs of one seq_idx value in a row."""
    if seq_idx is None:
        return [(0, steps)]
    ids = seq_idx[row]
    starts = ((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist()
    cuts = [0, *starts, steps]
    return list(zip(cuts[:-1], cuts[1:]))


def _scan(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, opts: _ScanOptions):
    """(out in x's dtype, final states (b, h, p, n)). A row's first document starts from its
    initial state, every later one from zero."""
    reference = _scan_reference()
    d_heads = D if D is not None and D.dim() == 1 else None    # the reference broadcasts only D of shape (h,)
    rows, finals = [], []
    for r in range(x.shape[0]):
        parts = []
        for i, (a, b) in enumerate(_documents(seq_idx, r, x.shape[1])):
            start = initial_states[r:r + 1] if initial_states is not None and i == 0 else None
            out, final = reference(x[r:r + 1, a:b], dt[r:r + 1, a:b], A, B[r:r + 1, a:b], C[r:r + 1, a:b],
                                   chunk_size=opts.chunk_size, D=d_heads, dt_bias=dt_bias, initial_states=start,
                                   dt_softplus=opts.dt_softplus, dt_limit=opts.dt_limit, return_final_states=True)
            parts.append(out)
        rows.append(torch.cat(parts, dim=1))
        finals.append(final)
    out = torch.cat(rows, dim=0)
    if D is not None and D.dim() == 2:       # D (h, p): the skip connection per channel
        out = out + x.float() * D.float()
    if z is not None:                        # the kernel's gate; the reference has none
        out = out * F.silu(z.float())
    return out.to(x.dtype), torch.cat(finals, dim=0)


def _gated_rmsnorm(x, z, weight, eps: float, group_size: int, norm_before_gate: bool):
    """mamba-ssm's RMSNorm with a SiLU gate (layernorm_gated.rms_norm_ref), per group of channels."""
    dtype = x.dtype
    x, z = x.float(), z.float()
    if not norm_before_gate:
        x = x * F.silu(z)
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    out = (groups * torch.rsqrt(groups.square().mean(-1, keepdim=True) + eps)).reshape(x.shape) * weight.float()
    if norm_before_gate:
        out = out * F.silu(z)
    return out.to(dtype)


def _split(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx, rmsnorm_weight,
           outproj_weight, outproj_bias, o: _SplitOptions):
    """(out, final states): zxbcdt is (b, l, 2 * d_nonssm + dim + conv channels + nheads)."""
    nheads, headdim = (D.shape[0], o.headdim) if D.dim() == 1 else tuple(D.shape)
    if headdim is None:
        raise ValueError("headdim must be given when D is 1-D (mamba-ssm asserts the same)")
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // o.ngroups // 2
    d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * o.ngroups * dstate - nheads) // 2
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * o.ngroups * dstate, nheads], dim=-1)
    xBC = _conv_reference(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, o.activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, o.ngroups * dstate, o.ngroups * dstate], dim=-1)
    batch, steps = zxbcdt.shape[:2]
    heads = (batch, steps, nheads, headdim)
    gate = z.reshape(heads) if rmsnorm_weight is None else None     # without the norm, the scan gates
    y, final = _scan(x.reshape(heads), dt, A, B.reshape(batch, steps, o.ngroups, dstate),
                     C.reshape(batch, steps, o.ngroups, dstate), D, gate, dt_bias, initial_states, seq_idx,
                     _ScanOptions(o.chunk_size, True, o.dt_limit))
    y = y.reshape(batch, steps, dim)
    if rmsnorm_weight is not None:
        y = _gated_rmsnorm(y, z, rmsnorm_weight, o.rmsnorm_eps, dim // o.ngroups, o.norm_before_gate)
    if d_nonssm:                             # the channels outside the SSM go through a SwiGLU
        x0, y0 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(x0) * y0, y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return y, final


def _recomputed_grads(run, saved, grad) -> list:
    """The gradient of run(*saved) for each floating-point tensor in `saved`, None elsewhere: a
    backward that recomputes its forward, as mamba-ssm's kernels do."""
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() if t is not None and t.is_floating_point() else t for t in saved]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad(run(*inputs), wanted, grad, allow_unused=True))
    return [next(found) if t is not None and t.requires_grad else None for t in inputs]


class MambaChunkScanCombinedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, opts, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
        ctx.opts = opts
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
        return _scan(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, opts)[0]

    @staticmethod
    def backward(ctx, grad):
        return None, *_recomputed_grads(lambda *t: _scan(*t, ctx.opts)[0], ctx.saved_tensors, grad)


class MambaSplitConv1dScanCombinedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, opts, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx,
                rmsnorm_weight, outproj_weight, outproj_bias):
        ctx.opts = opts
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx,
                              rmsnorm_weight, outproj_weight, outproj_bias)
        return _split(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx, rmsnorm_weight,
                      outproj_weight, outproj_bias, opts)[0]

    @staticmethod
    def backward(ctx, grad):
        return None, *_recomputed_grads(lambda *t: _split(*t, ctx.opts)[0], ctx.saved_tensors, grad)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False):
    # cu_seqlens: mamba-ssm reads it only for return_varlen_states
    if return_varlen_states:
        raise NotImplementedError("the mamba_chunk_scan_combined test double does not return varlen states")
    opts = _ScanOptions(chunk_size, dt_softplus, tuple(dt_limit))
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    out = _scan(*tensors, opts)[0] if _no_function() else MambaChunkScanCombinedFn.apply(opts, *tensors)
    if not return_final_states:
        return out
    with torch.no_grad():
        return out, _scan(*tensors, opts)[1]


def mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     initial_states=None, seq_idx=None, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, activation="silu", rmsnorm_weight=None,
                                     rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None,
                                     ngroups=1, norm_before_gate=True):
    if _conv_reference is None:
        raise RuntimeError(f"mamba_split_conv1d_scan_combined needs causal-conv1d, which did not import: "
                           f"{_CONV_ERROR}") from _CONV_ERROR
    opts = _SplitOptions(chunk_size, tuple(dt_limit), activation, rmsnorm_eps, headdim, ngroups, norm_before_gate)
    tensors = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, initial_states, seq_idx, rmsnorm_weight,
               outproj_weight, outproj_bias)
    out = _split(*tensors, opts)[0] if _no_function() else MambaSplitConv1dScanCombinedFn.apply(opts, *tensors)
    if not return_final_states:
        return out
    with torch.no_grad():
        return out, _split(*tensors, opts)[1]
