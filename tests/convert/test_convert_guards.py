"""`convert_checkpoint`'s guards: an already-quantized SRC converts only to its own layout; options a
request would ignore are errors; `overwrite` replaces only a conversion or an empty directory, never
SRC; an interrupted or killed conversion leaves no temporary behind (at the latest after the next
conversion of the same OUT); OUT gets the process umask's mode."""
import json
import logging
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from convert import convert_checkpoint, staging
from lmjax.loader.model_loader import load_model
from lmjax.models.forward import prompt_logits
from test_convert import PROMPTS, tiny  # noqa: F401 (tiny: test_convert's fixture, shared)


@pytest.fixture(scope="module")
def tiny_w8(tiny, tmp_path_factory) -> str:
    return convert_checkpoint(tiny, tmp_path_factory.mktemp("w8") / "w8", dtype="float32", quant="w8")


def _logits(path: str):
    return prompt_logits(load_model(path, "float32").model, PROMPTS)


# ---------------------------------------------------------------- an already-quantized SRC
@pytest.mark.parametrize("request_", [{}, {"quant": "w4", "group_size": 32, "w4_method": "rtn"},
                                      {"quant": "w8", "quant_lm_head": "w8"}])
def test_quantized_source_to_another_layout_is_refused_up_front(tiny_w8, tmp_path, request_):
    """Was: exit 0 and a directory whose config.json names a layout its checkpoint does not hold."""
    with pytest.raises(ValueError, match=r"is already quantized \(w8\); convert from the float checkpoint"):
        convert_checkpoint(tiny_w8, tmp_path / "out", dtype="float32", **request_)
    assert os.listdir(tmp_path) == []


def test_quantized_source_in_its_own_layout_is_re_saved_as_it_is(tiny, tiny_w8, tmp_path):
    out = convert_checkpoint(tiny_w8, tmp_path / "again", dtype="float32", quant="w8")
    assert json.load(open(os.path.join(out, "config.json")))["lmjax"]["quant"] == {
        "method": "w8", "group_size": 128, "algorithm": "rtn"}  # the source's record, kept
    for got, want in zip(_logits(out), _logits(tiny_w8)):
        np.testing.assert_array_equal(got, want)
    w4 = convert_checkpoint(tiny, tmp_path / "w4", dtype="float32", quant="w4", group_size=32, w4_method="rtn")
    with pytest.raises(ValueError, match=r"already quantized \(w4, group_size 32\).*--quant w4 --group-size 32"):
        convert_checkpoint(w4, tmp_path / "g16", dtype="float32", quant="w4", group_size=16, w4_method="rtn")
    with pytest.raises(ValueError, match=r"w4_method='gptq' cannot apply"):  # nothing is calibrated again
        convert_checkpoint(w4, tmp_path / "gptq", dtype="float32", quant="w4", group_size=32, w4_method="gptq")


def test_cli_names_the_source_quantization_in_one_line(tiny_w8, tmp_path, capsys):
    from lmjax.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["convert", tiny_w8, str(tmp_path / "f")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "is already quantized (w8)" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- options the request would ignore
@pytest.mark.parametrize("kwargs, message", [
    (dict(quant="w8", group_size=64), r"group_size=64 \(--group-size\) applies to w4 only"),
    (dict(quant="w8", group_size=128), r"group_size=128 \(--group-size\) applies to w4 only"),  # given, not default
    (dict(group_size=64), r"group_size=64 \(--group-size\) applies to w4 only"),
    (dict(quant="w8", w4_method="gptq"), r"w4_method='gptq' \(--w4-method\) applies to quant='w4' only"),
    (dict(w4_method="rtn"), r"w4_method='rtn' \(--w4-method\) applies to quant='w4' only"),
    (dict(quant="w8", w4_method="rtn"), r"w4_method='rtn' \(--w4-method\) applies to quant='w4' only"),
    (dict(quant="w8", calib_text="c.txt"), r"calib_text='c.txt' \(--calib-text\) applies to quant='w4'"),
    (dict(quant="w4", w4_method="rtn", calib_text="c.txt"), r"calib_text='c.txt' .* w4_method='rtn'"),
])
def test_ignored_options_are_errors(tiny, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(tiny, tmp_path / "out", **kwargs)


def test_options_that_apply_are_accepted(tiny, tmp_path):
    """group_size sizes a w4 lm_head's groups under w8."""
    out = convert_checkpoint(tiny, tmp_path / "out", dtype="float32", quant="w8", group_size=32,
                             quant_lm_head="w4")
    assert json.load(open(os.path.join(out, "config.json")))["lmjax"]["quant"] == {
        "method": "w8", "group_size": 32, "lm_head": "w4", "algorithm": "rtn"}


# ---------------------------------------------------------------- overwrite
def test_overwrite_never_deletes_src_or_foreign_files(tiny, tmp_path):
    parent = tmp_path / "p"
    shutil.copytree(tiny, parent / "src")
    (parent / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is SRC .* or holds it"):
        convert_checkpoint(str(parent / "src"), parent, overwrite=True)
    with pytest.raises(ValueError, match="is SRC .* or holds it"):
        convert_checkpoint(str(parent / "src"), parent / "src", overwrite=True)
    with pytest.raises(ValueError, match="is SRC .* or holds it"):  # not "pass --overwrite", which is refused
        convert_checkpoint(str(parent / "src"), parent / "src")
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_text("x")
    with pytest.raises(ValueError, match="neither an lmjax conversion nor an empty directory"):
        convert_checkpoint(tiny, other, overwrite=True)
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="neither an lmjax conversion nor an empty directory"):
        convert_checkpoint(tiny, tmp_path / "a_file", overwrite=True)
    assert (parent / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(parent / "src")) == sorted(os.listdir(tiny))
    assert os.listdir(other) == ["data.bin"] and (tmp_path / "a_file").read_text() == "x"


def test_overwrite_replaces_a_conversion_or_an_empty_directory_with_a_notice(tiny_w8, tiny, tmp_path, caplog):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileExistsError):
        convert_checkpoint(tiny, empty)
    caplog.set_level(logging.WARNING, logger="convert")
    convert_checkpoint(tiny, empty, dtype="float32", overwrite=True)
    assert "replacing it" in caplog.text
    conversion = shutil.copytree(tiny_w8, tmp_path / "conv")
    convert_checkpoint(tiny, conversion, dtype="float32", overwrite=True)
    assert json.load(open(conversion / "config.json"))["lmjax"]["quant"] is None
    assert sorted(os.listdir(tmp_path)) == ["conv", "empty"]


# ---------------------------------------------------------------- interruption, stale temporaries, modes
def test_interrupted_save_waits_for_the_writer_threads_before_cleaning_up(tiny, tmp_path, monkeypatch):
    """Ctrl-C lands in the main thread while Orbax's background threads still write: the cleanup must not
    remove the temporary under them (they recreated it: a `.OUT.tmp-*` of the model's size stayed)."""
    import orbax.checkpoint as ocp

    real_save, writers = ocp.Checkpointer.save, []

    def interrupted_save(self, directory, *args, **kwargs):
        writer = threading.Thread(target=real_save, args=(self, directory, *args), kwargs=kwargs)
        writer.start()  # the real save, in the background, as Orbax's writer threads go on
        writers.append(writer)
        raise KeyboardInterrupt("simulated Ctrl-C")

    monkeypatch.setattr(ocp.Checkpointer, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tiny, tmp_path / "out", dtype="float32")
    writers[0].join(30)
    assert os.listdir(tmp_path) == []


def test_a_killed_conversion_leaves_a_temporary_the_next_one_removes(tiny, tmp_path):
    """SIGKILL runs no cleanup: the next conversion of the same OUT removes the dead run's temporary, but
    not a live process's, another host's, another OUT's, or one without an owner in its name."""
    out = tmp_path / "out"
    kill = ("import os, signal, sys; import convert.convert as c\n"
            "c._write_config = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # after the weights\n"
            "c.convert_checkpoint(sys.argv[1], sys.argv[2], dtype='float32')")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", kill, tiny, str(out)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    (dead,) = os.listdir(tmp_path)
    assert dead.startswith(".out.tmp-") and os.listdir(tmp_path / dead)  # the weights, written
    host, pid = staging._host(), dead.split("-")[-2]  # .out.tmp-HOST-PID-RANDOM
    kept = [f".out.tmp-{host}-{os.getpid()}-0123abcd", f".out.tmp-otherhost-{pid}-0123abcd",
            ".out.tmp-k1791nt1", f".out2.tmp-{host}-{pid}-0123abcd"]
    for name in kept:
        (tmp_path / name).mkdir()
    convert_checkpoint(tiny, out, dtype="float32")
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["out"])


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_out_has_the_mode_of_a_new_directory(tiny, tmp_path, umask):
    old = os.umask(umask)
    try:
        out = convert_checkpoint(tiny, tmp_path / "out", dtype="float32")
    finally:
        os.umask(old)
    assert os.stat(out).st_mode & 0o777 == 0o777 & ~umask
