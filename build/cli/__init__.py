"""The `python -m build` command line (README.md here maps the modules; main.py is the entry)."""
