"""Engine tier: `python -m build audit IMAGE` on images this project did not build (the unit
tests of the same command: tests/build/test_audit_foreign_image.py).

(a) a plain image: the bootstrapped Debian base, a venv, pip install of torch (CPU) +
    transformers from the wheels the smoke build cached (a read-only mount, no network), committed
    from the container: no fla, no causal-conv1d, no flash-attn, so the fallback rows FAIL with the
    reason and the CPU isolation probe shows the leak;
(b) our smoke image: the same verdicts as its own `verify`, row by row, except the rows the
    audit adds and those it SKIPs because it reads no lock (it never reads one, even an ftimage
    image's: `docker run IMAGE verify` is the check against the lock);
(c) an image without Python (the base with python3 removed) and one without torch (the base
    itself): a clear refusal, exit 2, no traceback.
Every image and container made here is removed.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from contracts.events import EventLog
from tests.conftest import run_build_cli

pytestmark = pytest.mark.engine
TEST_LABEL = {"io.ftimage.test": "audit-foreign-image"}

# Installed by the base's own Python and pip, offline, from a flat view of the wheel cache.
INSTALL = r"""
set -e
mkdir /tmp/links
for w in /cache/*/*/*.whl; do ln -s "$w" /tmp/links/; done
python3 -m venv /opt/venv
/opt/venv/bin/pip install -q --no-index --no-cache-dir --no-compile --find-links /tmp/links "$@"
rm -rf /tmp/links
"""


def cache_root() -> Path:
    """The cache the smoke build filled (its subprocess saw this test run's environment)."""
    if os.environ.get("FTIMAGE_CACHE"):
        return Path(os.environ["FTIMAGE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ftimage"


@pytest.fixture(scope="session")
def base_ref(engine, smoke_image) -> str:
    return engine.image(smoke_image)["Config"]["Labels"]["org.opencontainers.image.base.name"]


def build(engine, context: Path, dockerfile: str, tag: str) -> str:
    (context / "Dockerfile").write_text(dockerfile)
    engine.build(context, tag, labels=TEST_LABEL, log=EventLog(quiet=True))
    return tag


@pytest.fixture(scope="session")
def plain_image(engine, base_ref):
    """torch (CPU) + transformers in a venv, installed by pip in a container of the base and
    committed as it is: the way a hand-made image is often made. The wheels come from a read-only
    mount of the wheels the smoke build cached (no network), so no layer holds them."""
    wheels = cache_root() / "wheels"
    torch = sorted(wheels.glob("*/*/torch-*+cpu-cp311-*.whl"))
    assert torch, f"no CPU torch wheel in {wheels}: the smoke build fills it"
    pins = [f"torch=={torch[-1].name.split('-')[1]}", "transformers"]
    tag = f"ftimage-audit-test/plain:{uuid.uuid4().hex[:10]}"
    container = engine.client.containers.run(
        base_ref, ["sh", "-c", INSTALL, "install", *pins], detach=True, network_mode="none", labels=TEST_LABEL,
        volumes={str(wheels): {"bind": "/cache", "mode": "ro"}})
    try:
        status = container.wait(timeout=900)
        assert status["StatusCode"] == 0, container.logs()[-3000:].decode(errors="replace")
        container.commit(*tag.split(":"), changes=[
            "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            'CMD ["python3"]'])
        container.remove()
        yield tag
    finally:
        engine.remove(tag)
        engine.remove_containers("io.ftimage.test=audit-foreign-image")


@pytest.fixture(scope="session")
def no_python_image(engine, base_ref, tmp_path_factory):
    tag = f"ftimage-audit-test/no-python:{uuid.uuid4().hex[:10]}"
    try:
        yield build(engine, tmp_path_factory.mktemp("no-python"), f"FROM {base_ref}\n"
                    "RUN rm -rf /usr/bin/python3* /usr/bin/pydoc3* /usr/bin/pygettext3* /usr/bin/py3* "
                    "/usr/lib/python3*\n", tag)
    finally:
        engine.remove(tag)


def audit(*args: str):
    proc = run_build_cli("audit", *args, timeout=1800)
    return proc.returncode, proc.stdout, proc.stderr


def rows_of(stdout: str) -> dict[str, dict]:
    return {r["check"]: r for r in json.loads(stdout)["results"]}


def test_a_plain_image_gets_the_table_with_fallbacks_failing_and_the_leak_measured(engine, plain_image):
    code, out, err = audit(plain_image, "--json")
    assert code == 2, err[-3000:]
    assert "Traceback" not in out + err
    assert "not built by ftimage" in err
    assert "user: root: the image's config sets no User, so Docker runs it as root" in err
    assert "python: /opt/venv/bin/python3 3.11" in err and "carried" not in err   # its own yaml and packaging
    report = json.loads(out)
    assert report["exit_code"] == 2 and report["worst"] == "FAIL"
    rows = rows_of(out)
    assert rows["lock"]["status"] == "SKIP" and "--no-lock" in rows["lock"]["detail"]
    assert rows["model_fit"]["status"] == "SKIP"
    for fn, package in (("causal_conv1d_fn", "causal_conv1d"), ("chunk_gated_delta_rule", "fla")):
        row = rows[f"dispatch.{fn}"]
        assert row["status"] == "FAIL" and "torch reference path" in row["detail"]
        assert f"No module named '{package}'" in row["detail"] and row["fix"]
    assert rows["dispatch.attention"]["status"] == "FAIL" and "flash_attn" in rows["dispatch.attention"]["detail"]
    for package in ("causal_conv1d", "fla", "flash_attn"):
        assert rows[f"extensions.{package}"]["status"] == "SKIP"          # not installed: nothing to load
    assert rows["extensions.binding.causal_conv1d_fn"]["status"] == "SKIP"
    for kind in ("gdn", "conv"):
        data = rows[f"isolation.{kind}"]["data"]
        assert rows[f"isolation.{kind}"]["status"] == "FAIL" and data["packed_rel"] > data["tolerance"]
        assert data["withheld_rel"] > data["blind_threshold"]
    assert rows["isolation.attention"]["status"] == "PASS"                # sdpa with packed position_ids
    # nothing of the image was changed and no container is left
    assert engine.client.containers.list(all=True, filters={"label": "io.ftimage.audit=1"}) == []


def test_the_table_form_exits_the_same(plain_image):
    code, out, err = audit(plain_image)
    assert code == 2 and out.rstrip().endswith("RESULT: FAIL (exit 2)"), err[-2000:]
    assert out.splitlines()[0].split("|")[0].strip() == "CHECK"


# Rows the audit adds, and rows it SKIPs for the lock it does not read.
AUDIT_ONLY = ("extensions.", "environment.versions", "environment.kernels")


def test_the_smoke_image_gets_the_verdicts_of_its_own_verify(engine, smoke_image):
    own = engine.run(smoke_image, ["verify", "--json"], network="none", timeout=900)
    assert own.exit_code == 2, own.output[-3000:]
    own_rows = {r["check"]: r for r in json.loads(own.stdout)["results"]}
    code, out, err = audit(smoke_image, "--json")
    assert code == own.exit_code, err[-3000:]
    assert "built by ftimage (its lock /etc/ftimage/build.lock.json is not read" in err
    assert "user: 10001:10001 (the image's config User)" in err
    rows = rows_of(out)
    skipped_for_no_lock = {c for c, r in rows.items() if r["status"] == "SKIP" and "no lock" in r["detail"]}
    assert {"lock", "model_fit", "environment.versions", "environment.kernels"} <= skipped_for_no_lock
    compared = [c for c in own_rows if c in rows and c not in skipped_for_no_lock and not c.startswith(AUDIT_ONLY)]
    assert {"dispatch.causal_conv1d_fn", "dispatch.chunk_gated_delta_rule", "dispatch.attention",
            "isolation.gdn", "isolation.conv", "isolation.attention", "environment.cuda_device"} <= set(compared)
    differ = {c: (own_rows[c]["status"], rows[c]["status"]) for c in compared
              if own_rows[c]["status"] != rows[c]["status"]}
    assert differ == {}
    # what the own verify has and the audit does not: only comparisons with the lock
    only_own = set(own_rows) - set(rows)
    assert all(c.startswith("environment.") for c in only_own), only_own


def test_an_image_without_python_is_refused(no_python_image):
    code, out, err = audit(no_python_image)
    assert code == 2 and out == ""
    assert "error: the image has no Python: none of python3, python is on its PATH" in err
    assert "fix: audit needs an image with Python >= 3.10, torch and transformers" in err
    assert "Traceback" not in err


def test_an_image_without_torch_is_refused(base_ref):
    code, out, err = audit(base_ref)
    assert code == 2 and out == ""
    assert "/usr/bin/python3 (Python 3.11.2) has no torch and no transformers" in err
    assert "Traceback" not in err


def test_an_image_that_is_not_here_says_to_pull_it():
    code, _, err = audit("ftimage-audit-test/never-built:nope")
    assert code == 2 and "`docker pull ftimage-audit-test/never-built:nope`" in err
