"""The runtime guard: inside the trainer's own process, prove during the first training steps that
the fused kernels are what transformers bound (forward and backward) and that packed batches carry
their document boundaries to every layer kind; refuse with one error (exit 3) when they do not.

This package file imports nothing: every Python process of the image runs `import guard.boot`
from a .pth line, and that must stay cheap. The build writes `install_files()` into the venv's
site-packages. The modules: README.md beside this file.
"""

APP_PTH = "ftimage-app.pth"          # the build's .pth that puts the app dir (guard/ among it) on sys.path
PTH_NAME = "ftimage-guard.pth"       # ours; site processes .pth files in sorted order, so it runs after APP_PTH
# A .pth line starting with `import` is executed at interpreter start. Importing guard.boot alone
# installs nothing (a test run that imports it must stay unguarded); the .pth line installs it.
PTH_LINE = b"import guard.boot; guard.boot.install()\n"


def install_files() -> dict[str, bytes]:
    """What the build writes into the venv's site-packages (name -> bytes), beside APP_PTH."""
    return {PTH_NAME: PTH_LINE}
