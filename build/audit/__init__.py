"""Audits of what was built: a pushed image's signature and attestation, a build's reproducibility (README.md here)."""
