"""entrypoint: `docker run IMAGE finetune|verify|info|shell` (anything else is exec'd).

The map of this package is README.md in this folder."""
