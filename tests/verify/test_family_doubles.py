"""The isolation probe can pass for every family: with the CPU test doubles of the kernels
(tests/guard/kernels/fused: they honour seq_idx and cu_seqlens as the real kernels do) bound at
the modeling modules' import, each layer kind of each family measures isolated, the negative
control still sees the leak, and logits and gradients match the documents run one at a time."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from families import known_families

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])      # the doubles first: transformers binds kernels at the modeling import
from families import known_families, load_family
from families.runtime import build_model, hooks, modeling_module
from verify.checks import isolation
from verify.packing_probe import measure
import flash_attn
flash_attn.register()
out = {}
for name in known_families():
    family = load_family(name)
    module = modeling_module(family)
    model = build_model(family, "probe", attn_implementation="sdpa")
    # the flash-attn double (varlen, cu_seq_lens_q/k): transformers refuses flash_attention_2 without
    # CUDA at init, so it is set after, as tests/guard/scenarios.py does
    model.config._attn_implementation = "flash_attention_2"
    hooks(family).prepare_probe_model(model)
    m = measure(model, module, family, device="cpu")
    kinds = tuple(k for k in ("attention", "gdn", "kda", "conv", "ssd")
                  if any(k in kind.measure for kind in family.layer_kinds.values()))
    out[name] = [[r.check, r.status.name, r.detail] for r in isolation.judge(m, isolation.TOLERANCES["float32"],
                                                                               kinds=kinds)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def rows(repo):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(repo / "tests" / "guard" / "kernels" / "fused")],
                          cwd=repo, capture_output=True, text=True, timeout=900,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), "TRANSFORMERS_VERBOSITY": "error",
                               "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("family", known_families())
def test_every_isolation_row_passes_with_boundary_honouring_kernels(rows, family):
    got = {check: (status, detail) for check, status, detail in rows[family]}
    assert {"isolation.logits", "isolation.grads"} <= set(got)
    failing = {check: detail for check, (status, detail) in got.items() if status != "PASS"}
    assert not failing, failing
