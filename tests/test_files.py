"""files.py: atomic writes leave the permissions a plain open() would, and no temp behind."""

import os
import stat

from slipstream.files import atomic_write_text, write_json


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_new_file_gets_0666_less_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        write_json(tmp_path / "b.json", {"a": 1})
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.txt") == 0o640
    assert _mode(tmp_path / "b.json") == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json"]


def test_a_replaced_file_keeps_its_own_mode(tmp_path):
    target = tmp_path / "recipe.toml"
    target.write_text("old")
    os.chmod(target, 0o604)
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert _mode(target) == 0o604
