"""A stand-in for your own trainer: it runs in the image's venv with the locked torch and
transformers. A real one that packs documents must pass the boundaries (cu_seqlens /
seq_idx, as contracts.collate.collate_packed builds them) through transformers' model."""
import os

import torch
import transformers

print(f"team_trainer.py: torch {torch.__version__}, transformers {transformers.__version__}, uid {os.getuid()}")
