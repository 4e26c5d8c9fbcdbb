"""On PYTHONPATH for the proof kit's fallback run only: every Python process of the run (the
launcher, verify, the torchrun workers) finds fla and causal_conv1d installed but unimportable,
as in a broken image, before anything imports transformers."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.fallback import hide_fused_packages  # noqa: E402

hide_fused_packages()
