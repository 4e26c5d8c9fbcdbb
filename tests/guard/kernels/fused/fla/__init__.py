"""Test double for flash-linear-attention (the `fla` package): see fla.ops.gated_delta_rule."""
