"""convert and loading fixes a read-only probe found (each test failed before): a directory that appears at OUT
while a conversion runs is not deleted (OUT is checked again before the commit); a damaged Orbax file is a
CheckpointError naming the checkpoint (Orbax raises a bare Exception), one line and exit code 2 from the CLI; a
calibration text that is not UTF-8 is named; a config.json without `architectures` loads by its model_type, as
transformers' AutoModelForCausalLM does; `--overwrite`'s help says what it replaces."""
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import convert.convert as convert_module
from conftest import write_tiny_llama
from convert import convert_checkpoint
from lmjax.cli import main
from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_out_created_during_the_conversion_is_not_deleted(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real_save = convert_module._save_params

    def save_while_someone_creates_out(directory, params):
        real_save(directory, params)
        out.mkdir()  # e.g. the user's own directory, or another run's, created while the conversion runs
        (out / "precious.txt").write_text("mine")

    monkeypatch.setattr(convert_module, "_save_params", save_while_someone_creates_out)
    with pytest.raises(FileExistsError, match="already exists"):
        convert_checkpoint(tiny, str(out), dtype="float32")
    assert (out / "precious.txt").read_text() == "mine"
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the finished conversion is cleaned up


@pytest.fixture(scope="module")
def damaged(tiny, tmp_path_factory):
    out = convert_checkpoint(tiny, str(tmp_path_factory.mktemp("c") / "out"), dtype="float32")
    files = glob.glob(os.path.join(out, "lmjax_orbax", "ocdbt.process_0", "d", "*"))
    with open(max(files, key=os.path.getsize), "r+b") as f:  # the biggest data file truncated, as a broken copy
        f.truncate(0)
    return out


def test_a_damaged_conversion_is_a_checkpoint_error(damaged):
    with pytest.raises(ValueError, match="cannot restore the converted checkpoint .*lmjax_orbax"):
        load_model(damaged, "float32")


def test_the_cli_reports_a_damaged_conversion_in_one_line(damaged):
    proc = subprocess.run([sys.executable, "-m", "lmjax.cli", "generate", "--model", damaged, "--max-new-tokens",
                           "2", "hi"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    # (Orbax's abandoned background reads may still print "Event loop is closed" tracebacks around it)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lmjax generate: error: ")]
    assert len(errors) == 1 and "cannot restore the converted checkpoint" in errors[0], proc.stderr[-2000:]
    assert "lmjax_orbax: Encountered error while reading" in errors[0] and "TensorStore" not in errors[0]


def test_a_calibration_text_that_is_not_utf8_is_named(tiny, tmp_path, capsys):
    bad = tmp_path / "calib.bin"
    bad.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(SystemExit) as e:
        main(["convert", tiny, str(tmp_path / "out"), "--quant", "w4", "--calib-text", str(bad)])
    assert e.value.code == 2 and "calib.bin" in capsys.readouterr().err


def test_a_config_without_architectures_loads_by_model_type(tiny, tmp_path):
    src = tmp_path / "noarch"
    shutil.copytree(tiny, src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["architectures"]
    (src / "config.json").write_text(json.dumps(cfg))
    ids = [[5, 9, 12, 40]]
    np.testing.assert_array_equal(prompt_logits(load_model(str(src), "float32").model, ids)[0],
                                  prompt_logits(load_model(tiny, "float32").model, ids)[0])
    cfg["model_type"] = "gemma"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no architectures and model_type 'gemma'"):
        load_model(str(src), "float32")


def test_convert_help_says_what_overwrite_replaces(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "replace OUT if it is an earlier conversion or an empty directory" in text
