"""The map of this folder is its README.md."""
