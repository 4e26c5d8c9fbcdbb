"""A job's inputs, tried as an attacker would: remote code, escaping output.dir, data paths that
never end. Each case is refused with exit 2, the field and the fix, before anything runs."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from contracts.folder_guard import UnsafeFolder
from entrypoint.launcher.output_dir import ephemeral_warning, resolve_output_dir
from tests.fixtures.chat import run_entrypoint

pytestmark = pytest.mark.unit

EVIL_MODULE = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\nfrom transformers import {base} as {name}\n"


def _with_auto_map(fixture_dir, tmp_path: Path, file: str, marker: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(fixture_dir.model_dir, model)
    cls = "AutoTokenizer" if file == "tokenizer_config.json" else "AutoConfig"
    base, name = ("PreTrainedTokenizerFast", "EvilTokenizer") if cls == "AutoTokenizer" else \
        ("Qwen3_5TextConfig", "EvilConfig")
    (model / "evil.py").write_text(EVIL_MODULE.format(marker=str(marker), base=base, name=name))
    data = json.loads((model / file).read_text())
    data["auto_map"] = {cls: ["evil." + name, None] if cls == "AutoTokenizer" else "evil." + name}
    (model / file).write_text(json.dumps(data))
    return model


@pytest.mark.parametrize("file", ["tokenizer_config.json", "config.json"])
@pytest.mark.parametrize("command", ["inspect-data", "finetune"])
def test_auto_map_code_never_runs_without_the_opt_in(fixture_dir, tmp_path, file, command):
    marker = tmp_path / "ran"
    model = _with_auto_map(fixture_dir, tmp_path, file, marker)
    r = run_entrypoint([command, "--config", str(fixture_dir.config), f"model.path={model}",
                        f"output.dir={tmp_path / 'out'}"], input="y\ny\ny\n", timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"{model / file} sets `auto_map`" in r.stderr and "model.trust_remote_code=true" in r.stderr
    assert not marker.exists() and "Traceback" not in r.stderr


def test_the_tokenizer_gets_trust_remote_code_explicitly(monkeypatch, fixture_dir):
    """Left unset, transformers asks on stdin; the loader always says yes or no itself."""
    import transformers

    from entrypoint.model import load_tokenizer

    seen = {}
    real = transformers.AutoTokenizer.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return real(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    load_tokenizer(str(fixture_dir.model_dir))
    assert seen["trust_remote_code"] is False


@pytest.mark.parametrize("path, why", [
    ("/fx/../tmp/escape", "contains '..'"),
    ("/etc", "system path"),
    ("/etc/ftimage/runs", "system path"),
    ("/usr/local/out", "system path"),
    ("/", "system path"),
    ("/opt/ftimage/app", "system path"),
    ("/var/lib/docker/x", "system path"),
    ("/lib64/x", "system path"),
])
def test_output_dir_outside_a_job_folder_is_refused(path, why):
    with pytest.raises(UnsafeFolder, match=why.replace("'", ".")):
        resolve_output_dir(path)


def test_output_dir_is_resolved_once_through_symlinks_the_user_chose(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert resolve_output_dir(str(tmp_path / "link" / "run1")) == tmp_path / "real" / "run1"
    os.symlink("/etc", tmp_path / "sneaky")
    with pytest.raises(UnsafeFolder, match="system path"):
        resolve_output_dir(str(tmp_path / "sneaky"))


def test_finetune_refuses_etc_even_as_root_and_writes_nothing_there(fixture_dir):
    before = set(os.listdir("/etc"))
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "output.dir=/etc"], timeout=120)
    assert r.returncode == 2 and "is a system path" in r.stderr and "fix:" in r.stderr
    assert set(os.listdir("/etc")) == before
    r = run_entrypoint(["finetune", "--config", str(fixture_dir.config), "output.dir=/tmp/../tmp/escape-x"],
                       timeout=120)
    assert r.returncode == 2 and "contains '..'" in r.stderr and not Path("/tmp/escape-x").exists()


def test_an_output_dir_on_the_container_root_warns_that_it_is_lost():
    mountinfo = ("100 90 0:50 / / rw,relatime - overlay overlay rw\n"
                 "101 100 8:1 /srv/out /out rw,relatime - ext4 /dev/sda1 rw\n")
    assert ephemeral_warning(Path("/out/run1"), mountinfo, container=True) is None
    warning = ephemeral_warning(Path("/workspace/run1"), mountinfo, container=True)
    assert "not on a mounted volume" in warning and "-v" in warning
    assert ephemeral_warning(Path("/workspace/run1"), mountinfo, container=False) is None


@pytest.mark.parametrize("command", ["inspect-data", "finetune"])
def test_a_fifo_or_a_device_as_data_is_refused_before_anything_is_read(fixture_dir, tmp_path, command):
    fifo = tmp_path / "data.fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "is a FIFO"), ("/dev/zero", "is a character device")):
        # a reader that opened either would never return: the subprocess timeout would fire
        r = run_entrypoint([command, "--config", str(fixture_dir.config), f"data.path={path}",
                            f"output.dir={tmp_path / 'out'}"], timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert kind in r.stderr and "data.path" in r.stderr and "Traceback" not in r.stderr
