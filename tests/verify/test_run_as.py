"""The user verify runs as: real root is a WARN naming the uid and the fix, uid 0 inside a rootless
user namespace is named as such (no warning), any other uid passes."""
from __future__ import annotations

import pytest

from verify.checks.run_as import decide_user, host_uid_of_root, user_row
from verify.report import Status

pytestmark = pytest.mark.unit

INITIAL_NAMESPACE = "         0          0 4294967295\n"
ROOTLESS = "         0       1000          1\n         1     100000      65536\n"


def test_a_non_root_uid_passes():
    row = decide_user(4242, 0, INITIAL_NAMESPACE)
    assert row.status is Status.PASS and "uid 4242" in row.detail


def test_real_root_is_a_warning_naming_the_uid_and_the_fix():
    row = decide_user(0, 0, INITIAL_NAMESPACE)
    assert row.status is Status.WARN and "real root: uid 0" in row.detail
    assert "--no-container-remap-root" in row.fix and "umoci unpack --rootless" in row.fix


def test_root_in_a_rootless_user_namespace_is_named_not_warned():
    row = decide_user(0, 0, ROOTLESS)
    assert row.status is Status.PASS and "rootless user namespace: host uid 1000" in row.detail
    assert host_uid_of_root(ROOTLESS) == 1000 and host_uid_of_root("") is None


def test_an_unreadable_map_for_root_is_a_warning():
    assert decide_user(0, 0, None).status is Status.WARN


def test_this_process_gets_a_row():
    assert user_row().check == "environment.user"
