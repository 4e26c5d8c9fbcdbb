"""verify on an image for every family (a lock listing them all), on CPU with no kernel package
installed: each family's dispatch rows name the torch fallback with the real import error, and its
isolation rows measure each layer kind's leak, the negative control showing the probe can see it.
With the CPU test doubles of the kernels (they honour seq_idx / cu_seqlens), the same rows pass."""
from __future__ import annotations

import dataclasses
import json

import pytest

from families import known_families, load_family

pytestmark = pytest.mark.slow

FAMILIES = known_families()


@pytest.fixture(scope="module")
def all_families_lock(tmp_path_factory, env_lock):
    path = tmp_path_factory.mktemp("families-lock") / "build.lock.json"
    lock = dataclasses.replace(env_lock, model_family=FAMILIES[0], model_families=FAMILIES)
    path.write_text(lock.to_json())
    return path


@pytest.fixture(scope="module")
def rows(all_families_lock, run_verify):
    code, out, err = run_verify("--device", "cpu", "--checks", "dispatch,isolation", "--json", "--lock",
                                str(all_families_lock), timeout=900)
    assert code != 0, "no kernel is installed here: verify must fail closed"
    return {r["check"]: r for r in json.loads(out)["results"]}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_fused_function_of_each_family_names_the_torch_fallback_and_why(rows, family):
    fam = load_family(family)
    for fused in fam.fused_functions:
        row = rows[f"dispatch.{family}.{fused.function}"]
        assert row["status"] == "FAIL", row
        assert "torch reference path" in row["detail"] and "is not installed" in row["detail"], row["detail"]
        assert fused.boundary_kwarg in row["detail"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_kind_of_each_family_is_measured_and_the_torch_path_leaks(rows, family):
    fam = load_family(family)
    measures = {m for kind in fam.layer_kinds.values() for m in kind.measure}
    assert measures, family
    for what in measures:
        row = rows[f"isolation.{family}.{what}"]
        assert row["data"]["withheld_rel"] > row["data"]["blind_threshold"], row   # the control sees a leak
        if what == "attention":
            continue   # sdpa with packed position_ids gets transformers' per-document mask on CPU
        assert row["status"] == "FAIL" and "leak:" in row["detail"], row


@pytest.mark.parametrize("family", [f for f in FAMILIES if load_family(f).experts is not None])
def test_each_moe_family_names_the_experts_path_it_ran_forward_and_backward(rows, family):
    row = rows[f"dispatch.{family}.experts"]
    # torch on CPU has grouped_mm: the probe's packed step runs it both ways
    assert row["status"] == "PASS", row
    assert "grouped_mm ran (forward: grouped_mm" in row["detail"] and "backward: grouped_mm" in row["detail"]
