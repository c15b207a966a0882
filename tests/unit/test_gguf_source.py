"""A converted GGUF folder names the file it came from (model_files.record_gguf_source), for int4 to take its 4-bit
numbers as they are: only while that file is unchanged, and a folder that cannot be written goes without."""

import os

from kvferry.common import model_files


def test_the_source_is_named_while_it_is_the_same_file(tmp_path):
    gguf, folder = tmp_path / "model.gguf", tmp_path / "converted"
    gguf.write_bytes(b"GGUF" + bytes(60))
    folder.mkdir()
    assert model_files.gguf_source(folder) is None  # nothing recorded
    model_files.record_gguf_source(gguf, folder)
    assert model_files.gguf_source(folder) == gguf.resolve()
    other = tmp_path / "elsewhere.gguf"  # another clone's copy: the record stays while it is valid
    other.write_bytes(b"GGUF" + bytes(60))
    model_files.record_gguf_source(other, folder)
    assert model_files.gguf_source(folder) == gguf.resolve()
    gguf.write_bytes(b"GGUF" + bytes(61))  # another file under the same name: the record no longer holds
    assert model_files.gguf_source(folder) is None
    model_files.record_gguf_source(other, folder)  # and the next resolve names the copy it has
    assert model_files.gguf_source(folder) == other.resolve()
    (folder / model_files.GGUF_SOURCE).write_text("{not json")
    assert model_files.gguf_source(folder) is None


def test_a_folder_that_cannot_be_written_goes_without(tmp_path):
    gguf, not_a_folder = tmp_path / "model.gguf", tmp_path / "a-file"
    gguf.write_bytes(b"GGUF")
    not_a_folder.write_text("")  # writing under it fails for any user, root too
    model_files.record_gguf_source(gguf, not_a_folder)  # no error: int4 rounds the weights again instead
    assert model_files.gguf_source(not_a_folder) is None


def test_the_record_is_not_group_writable_whatever_the_umask(tmp_path):
    # cache_trust refuses a converted folder holding a file the group may write: every later start would fail
    gguf, folder = tmp_path / "model.gguf", tmp_path / "converted"
    gguf.write_bytes(b"GGUF")
    folder.mkdir()
    old = os.umask(0o002)
    try:
        model_files.record_gguf_source(gguf, folder)
    finally:
        os.umask(old)
    assert (folder / model_files.GGUF_SOURCE).stat().st_mode & 0o777 == 0o644
