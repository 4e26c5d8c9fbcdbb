"""`python -m build`: a thin CLI over the build library. This module reads the command word and
maps failures to exit codes; each command lives in its own module (the list: EPILOG, common.py):

    IMAGE_DIR ...              build_command.py plan, render, build, push, sign, deploy examples
                               (its modes: plan_command.py, render_command.py, kernels_only_command.py)
    kernels ...                kernels.py   the kernel cache, export/import, fetch, check, build-here
    bases ... | bootstrap-base bases.py     deb locks and bootstrapped bases
    verify-image REF           verify_image_command.py  a pushed image's signature and attestation
    verify-reproducible DIR    verify_reproducible_command.py  two builds from fresh clones, compared
    audit IMAGE                audit_command.py  verify in an image this project did not build (build/audit)

Exit codes: 0 ok; 2 invalid spec, incompatible pins or bad arguments; 1 a failed build
(engine, download, compile, checks, registry); 3 refused (kernels import, verify-image).
"""
from __future__ import annotations

import os
import sys

from build.cli import bases, build_command, kernels
from build.cli.common import EXIT_BAD_SPEC
from build.source_date import parse_epoch
from contracts.errors import FixableError
from contracts.schema import InvalidInput


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "SOURCE_DATE_EPOCH" in os.environ:   # refused before any work, not when the labels are rendered
            parse_epoch(os.environ["SOURCE_DATE_EPOCH"])
        if argv and argv[0] == "bootstrap-base":
            return bases.bootstrap_base(argv[1:])
        if argv and argv[0] == "kernels":
            return kernels.main(argv[1:])
        if argv and argv[0] == "bases":
            return bases.main(argv[1:])
        # these three load only when named: they need `cryptography` (signatures), which a bare GPU
        # host running `kernels build-here` may lack
        if argv and argv[0] == "verify-image":
            from build.cli import verify_image_command

            return verify_image_command.main(argv[1:])
        if argv and argv[0] == "audit":
            from build.cli import audit_command

            return audit_command.main(argv[1:])
        if argv and argv[0] == "verify-reproducible":
            from build.cli import verify_reproducible_command

            return verify_reproducible_command.main(argv[1:])
        return build_command.main(argv)
    except InvalidInput as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BAD_SPEC
    except FixableError as exc:   # a failed build 1, a refusal 3, a bad key or folder 2: each class says
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted: nothing half-written was kept (cache entries publish atomically)", file=sys.stderr)
        return 130

