"""Runs tests/guard/scenarios.py specs, one forked child each, so the many short training runs
share one interpreter's imports of torch, transformers and TRL (about 13 s each on the CI's two
cores). The modeling module is NOT imported here: each child imports it, and that is when the
guard (installed by its .pth at this interpreter's start) activates, reading the child's env.

Protocol: one JSON spec per stdin line, {"spec": {...}, "workdir": DIR}; one JSON line back,
{"rc": EXIT_CODE}; the child's stdout and stderr go to DIR/stdout.txt and DIR/stderr.txt.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # under -I the script's folder is not on it


def preload() -> None:
    import datasets  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoTokenizer, DataCollatorWithFlattening  # noqa: F401
    from trl import SFTConfig, SFTTrainer  # noqa: F401

    import tests.guard.scenarios  # noqa: F401
    assert "transformers.models.qwen3_5.modeling_qwen3_5" not in sys.modules


def child(spec: dict, workdir: Path) -> None:
    from tests.guard import scenarios

    out = os.open(workdir / "stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(workdir / "stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 0
    try:
        scenarios.run(spec, workdir)
        # a process that ends runs its atexit handlers (the guard writes its report there when its
        # window never ended); os._exit below skips them, so run them here, as `python` would
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the test reads the traceback from stderr.txt
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        workdir = Path(request["workdir"])
        workdir.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(request["spec"], workdir)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
