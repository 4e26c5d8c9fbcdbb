"""Test double for flash-linear-attention (the `fla` package): see fla.ops.gated_delta_rule and
fla.ops.kda. Like fla, the root exports neither function; transformers imports the submodule."""
