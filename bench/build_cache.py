"""Cold vs warm build of an image, and multi-stage vs single-stage runtime size, in one run.

    python bench/build_cache.py [images/smoke] [--keep-base]

cold:  a fresh, empty cache, the image and its bootstrapped bases removed from the engine
       (so debootstrap, the pip resolution and the docker build all run);
warm:  the same command again with nothing changed.
Then the runtime image's size against a single-stage image with the same contents
(wheelhouse copied into and installed in the final stage, as a naive Dockerfile does).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from build.bootstrap import base_tag  # noqa: E402
from build.cache import CacheLayout  # noqa: E402
from build.engine import Engine  # noqa: E402
from build.log import EventLog  # noqa: E402
from build.pipeline import build_image  # noqa: E402
from build.resolve import load_plan  # noqa: E402

SINGLE_STAGE = """\
FROM {runtime}
COPY wheelhouse/ /tmp/wheelhouse/
RUN python3 -m venv /opt/ftimage/venv \\
 && /opt/ftimage/venv/bin/python -m pip install --no-index --no-cache-dir --require-hashes --no-deps \\
      --find-links /tmp/wheelhouse -r /tmp/wheelhouse/requirements.lock.txt
COPY app/ /opt/ftimage/app/
COPY build.lock.json sbom.cdx.json /etc/ftimage/
USER 10001:10001
ENTRYPOINT ["/opt/ftimage/venv/bin/python", "-m", "entrypoint"]
"""


def timed_build(plan, cache, out, engine):
    start = time.monotonic()
    report = build_image(plan, cache=cache, out_dir=out, log=EventLog(quiet=True), engine=engine)
    return time.monotonic() - start, report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image_dir", nargs="?", default=str(REPO_ROOT / "images" / "smoke"))
    parser.add_argument("--keep-base", action="store_true", help="do not remove bootstrapped bases for the cold run")
    args = parser.parse_args()
    plan = load_plan(Path(args.image_dir))
    engine = Engine.connect()
    with tempfile.TemporaryDirectory(prefix="ftimage-bench-") as tmp:
        cache, out = CacheLayout(Path(tmp) / "cache"), Path(tmp) / "out"
        engine.remove(plan.tag)
        if not args.keep_base:
            for ref in {plan.spec.builder_base, plan.spec.runtime_base}:
                if ref.bootstrap:
                    engine.remove(base_tag(ref.bootstrap))
        print(f"cold build of {plan.spec.name} (empty cache, no image, no bootstrapped base)...", flush=True)
        cold, cold_report = timed_build(plan, cache, out, engine)
        print("warm build (nothing changed)...", flush=True)
        warm, warm_report = timed_build(plan, cache, out, engine)

        single_ctx = Path(tmp) / "single"
        shutil.copytree(out / "context", single_ctx)
        runtime_ref = engine.image(plan.tag)["Config"]["Labels"]["org.opencontainers.image.base.name"]
        (single_ctx / "Dockerfile").write_text(SINGLE_STAGE.format(runtime=runtime_ref))
        print("single-stage image with the same contents...", flush=True)
        single = engine.build(single_ctx, f"{plan.spec.name}-single-stage:bench", labels={}, log=EventLog(quiet=True))
        engine.remove(f"{plan.spec.name}-single-stage:bench")

    gib = 2 ** 30
    print()
    print(f"{'measure':<38} {'value':>12}")
    print(f"{'cold build (s)':<38} {cold:>12.1f}")
    print(f"{'warm build (s)':<38} {warm:>12.1f}")
    print(f"{'warm / cold':<38} {warm / cold:>12.3f}")
    print(f"{'cold phases (s)':<38} {str(cold_report.phase_seconds)}")
    print(f"{'warm phases (s)':<38} {str(warm_report.phase_seconds)}")
    print(f"{'warm cache states':<38} {str(warm_report.cache)}")
    print(f"{'runtime image, multi-stage (GiB)':<38} {warm_report.size_bytes / gib:>12.2f}")
    print(f"{'same contents, single-stage (GiB)':<38} {single.size_bytes / gib:>12.2f}")
    print(f"{'multi-stage / single-stage':<38} {warm_report.size_bytes / single.size_bytes:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
