"""Publishing a built image: push, sign and attest, the one registry client, deploy examples (README.md here)."""
