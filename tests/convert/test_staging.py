"""How a finished conversion takes OUT's place (convert/staging.py): replacing an older conversion never
leaves a moment without OUT where the kernel can exchange two directories, and where it cannot, a run
killed between its two renames leaves the old conversion aside, which the next run puts back (it was
orphaned: OUT missing, the previous conversion in a `.OUT.old-*` nothing swept)."""
import os
import subprocess
import sys

import pytest

from convert import staging


def _conversion(path, text):
    path.mkdir()
    (path / "config.json").write_text(text)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_commit_replaces_an_older_conversion_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "out"
    _conversion(out, "old")
    new = staging.make_tmp(str(out))
    (tmp_path / new / "config.json").write_text("new")
    staging.commit(new, str(out))
    assert (out / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["out"]


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _conversion(a, "A")
    _conversion(b, "B")
    if not staging.exchange(str(a), str(b)):
        pytest.skip("this kernel / filesystem has no renameat2 RENAME_EXCHANGE: commit moves OUT aside instead")
    assert (a / "config.json").read_text() == "B" and (b / "config.json").read_text() == "A"


def test_commit_without_exchange_also_replaces(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "exchange", lambda a, b: False)
    test_commit_replaces_an_older_conversion_and_leaves_nothing_beside_it(tmp_path)


def test_a_run_killed_between_its_renames_gets_the_old_conversion_back(tmp_path):
    """What a kill between `rename(OUT, aside)` and `rename(tmp, OUT)` leaves: the next run's sweep puts the old
    conversion back at OUT and removes the dead run's unfinished temporary."""
    out, host, pid = tmp_path / "out", staging._host(), _dead_pid()
    aside = tmp_path / f".out.old-{host}-{pid}-0123abcd"
    aside.mkdir()
    _conversion(aside / "x", "old")
    _conversion(tmp_path / f".out.tmp-{host}-{pid}-0123abcd", "new, maybe not finished")
    staging.sweep_stale(str(out))
    assert (out / "config.json").read_text() == "old" and os.listdir(tmp_path) == ["out"]


def test_an_aside_is_removed_when_out_is_in_place(tmp_path):
    out, host, pid = tmp_path / "out", staging._host(), _dead_pid()
    _conversion(out, "new")
    aside = tmp_path / f".out.old-{host}-{pid}-0123abcd"
    aside.mkdir()
    _conversion(aside / "x", "old")
    live = tmp_path / f".out.old-{host}-{os.getpid()}-0123abcd"  # a live process's: in use
    live.mkdir()
    staging.sweep_stale(str(out))
    assert (out / "config.json").read_text() == "new" and sorted(os.listdir(tmp_path)) == sorted(["out", live.name])
