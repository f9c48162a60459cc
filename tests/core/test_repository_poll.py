"""Poll mode's bookkeeping (`core/repository_poll.py`): what a snapshot of the repository
asks to load and unload, once a change has held for a second look."""

from __future__ import annotations

from pathlib import Path

from lockgate.core.repository_poll import Fingerprint, RepositoryWatch, fingerprint, snapshot


def fp(*files: str) -> Fingerprint:
    return frozenset((name, 1, 1) for name in files)


def test_a_change_is_acted_on_once_it_held_for_a_second_look() -> None:
    watch = RepositoryWatch({"a": fp("config.yaml", "1/model.py")})
    copying = {"a": fp("config.yaml", "1/model.py"), "b": fp("config.yaml")}
    assert not watch.observe(copying)  # b is new: look again
    copied = {**copying, "b": fp("config.yaml", "1/model.onnx")}
    assert not watch.observe(copied)  # b changed since: still being written
    changes = watch.observe(copied)
    assert changes.load == ["b"] and changes.unload == []
    assert not watch.observe(copied)  # loaded as it is: nothing more to do


def test_a_model_changed_then_put_back_is_left_alone_and_a_removed_one_unloaded() -> None:
    loaded = {"a": fp("config.yaml"), "b": fp("config.yaml")}
    watch = RepositoryWatch(dict(loaded))
    assert not watch.observe({**loaded, "a": fp("config.yaml", "2/model.py")})
    assert not watch.observe(loaded)  # a is back as it was loaded
    assert not watch.observe(loaded)
    assert not watch.observe({"a": loaded["a"]})  # b is gone: look again
    changes = watch.observe({"a": loaded["a"]})
    assert changes.unload == ["b"] and changes.load == []
    assert not watch.observe({"a": loaded["a"]})


def test_fingerprints_see_files_added_and_rewritten_in_any_folder(tmp_path: Path) -> None:
    model = tmp_path / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text("backend: python\n")
    before = fingerprint(model)
    (model / "2").mkdir()
    (model / "2" / "model.py").write_text("x = 1\n")
    added = fingerprint(model)
    assert (
        added != before
        and ("2/model.py", 6, (model / "2" / "model.py").stat().st_mtime_ns) in added
    )
    (model / "config.yaml").write_text("backend: python\nmax_batch_size: 4\n")
    assert fingerprint(model) != added
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    assert set(snapshot(tmp_path)) == {"m"}
