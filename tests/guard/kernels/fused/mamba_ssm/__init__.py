"""Test double for mamba-ssm: see mamba_ssm.ops.triton.ssd_combined. Like mamba-ssm's root, this one
exports neither chunk-scan function; transformers imports the submodule
(hub_kernels._KERNELS_INTERNAL_PATH_MAPPINGS: "ops.triton.ssd_combined")."""
