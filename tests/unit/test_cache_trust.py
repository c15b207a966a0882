"""The cache folder is trusted only when it is this user's alone: every folder from the cache root down to a cached
file, and the file, owned by the process's user and writable by nobody else. Compiled kernels are named by what went
into them, so a change of source, flags or compiler never picks up an old build."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.cache_trust import UntrustedCache
from kvferry.common import model_files
from kvferry.common.errors import ConfigError
from kvferry.common.model.runner import enable_cpu_kernels
from kvferry.kernels.cpu import build

NOBODY = 65534  # the tests run as root, which may give a file to another user


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("KVFERRY_CACHE_DIR", str(root))
    return root


def converted(cache: Path) -> Path:
    """A converted default model in the cache, as an older kvferry left it (0755 folders, 0644 files): its
    config.json is all resolve_model reads before it returns the folder."""
    folder = model_files.converted_dir(model_files.default_gguf_path())
    assert folder.is_relative_to(cache)
    folder.mkdir(parents=True, mode=0o755)
    for path in (cache, cache / "models", folder):
        path.chmod(0o755)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "config.json").chmod(0o644)
    return folder


def test_a_converted_model_in_a_cache_of_this_users_alone_is_used_as_it_is(cache):
    folder = converted(cache)
    assert model_files.resolve_model(None) == folder


@pytest.mark.parametrize("which", ["root", "models", "model", "file"])
def test_a_converted_model_that_others_could_write_is_refused_naming_the_path(cache, which):
    folder = converted(cache)
    path = {"root": cache, "models": cache / "models", "model": folder, "file": folder / "config.json"}[which]
    path.chmod(0o666 if which == "file" else 0o777)
    with pytest.raises(ConfigError) as refused:
        model_files.resolve_model(None)
    message = str(refused.value)
    assert str(path) in message and "chmod" in message and "KVFERRY_CACHE_DIR" in message
    path.chmod(0o664 if which == "file" else 0o775)  # group-writable is refused too
    with pytest.raises(ConfigError, match=str(path)):
        model_files.resolve_model(None)


@pytest.mark.parametrize("which", ["root", "file"])
def test_a_converted_model_owned_by_another_user_is_refused(cache, which):
    folder = converted(cache)
    path = cache if which == "root" else folder / "config.json"
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(ConfigError) as refused:
        model_files.resolve_model(None)
    assert str(path) in str(refused.value) and "chown" in str(refused.value)


def test_a_file_planted_beside_the_model_is_refused_if_others_could_have_written_it(cache):
    folder = converted(cache)
    (folder / "tokenizer.json").write_text("{}")
    os.chown(folder / "tokenizer.json", NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=str(folder / "tokenizer.json")):
        model_files.resolve_model(None)


def test_a_cache_root_made_now_is_this_users_alone(cache):
    assert not cache.exists()
    kernels = model_files.cache_folder("kernels")
    assert kernels == cache / "kernels"
    for path in (cache, kernels):
        assert path.stat().st_mode & 0o777 == 0o700


def test_the_kernels_are_not_loaded_from_a_cache_others_could_write(cache):
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    with pytest.raises(ConfigError) as refused:
        enable_cpu_kernels()
    assert str(cache) in str(refused.value) and "chmod" in str(refused.value)
    assert not (cache / "kernels").exists()


SOURCE = "int kvferry_answer(void) { return 42; }\n"


def small_source(folder: Path, text: str = SOURCE) -> Path:
    folder.mkdir(exist_ok=True)
    source = folder / "answer.c"
    source.write_text(text)
    return source


def test_a_kernel_is_built_into_a_folder_of_this_users_alone_and_loads(tmp_path):
    source, build_dir = small_source(tmp_path / "src"), tmp_path / "kernels"
    lib, why = build.load(source, build_dir)
    assert why == "" and lib.kvferry_answer() == 42
    assert build_dir.stat().st_mode & 0o777 == 0o700
    [built] = build_dir.iterdir()  # nothing half-written left beside it
    assert built.suffix == ".so" and built.stat().st_mode & 0o022 == 0


def test_a_built_kernel_others_could_have_written_is_refused_not_loaded(tmp_path):
    source, build_dir = small_source(tmp_path / "src"), tmp_path / "kernels"
    built = build.build(source, build_dir)
    built.chmod(0o666)
    with pytest.raises(UntrustedCache, match=str(built)):
        build.load(source, build_dir)
    built.chmod(0o755)
    os.chown(built, NOBODY, NOBODY)
    with pytest.raises(UntrustedCache, match=str(built)):
        build.load(source, build_dir)


def test_a_kernel_build_folder_others_could_write_is_refused_before_compiling(tmp_path):
    source, build_dir = small_source(tmp_path / "src"), tmp_path / "kernels"
    build_dir.mkdir(mode=0o777)
    build_dir.chmod(0o777)
    with pytest.raises(UntrustedCache, match=str(build_dir)):
        build.load(source, build_dir)
    assert list(build_dir.iterdir()) == []


def test_a_kernels_name_changes_with_its_source_its_flags_and_its_compiler(tmp_path, monkeypatch):
    build_dir = tmp_path / "kernels"
    source = small_source(tmp_path / "src")
    first = build.build(source, build_dir)
    assert build.build(source, build_dir) == first  # found again, not rebuilt under another name
    with_flag = build.build(source, build_dir, ("-DKVFERRY_TEST_FLAG=1",))
    changed = build.build(small_source(tmp_path / "src", SOURCE.replace("42", "43")), build_dir)
    # The same compiler by another path: another compiler, as far as a name can tell.
    monkeypatch.setenv("CC", f"env {os.environ.get('CC') or 'cc'}")
    other_compiler = build.build(small_source(tmp_path / "src"), build_dir)
    names = {first.name, with_flag.name, changed.name, other_compiler.name}
    assert len(names) == 4 and all(name.startswith("answer-") for name in names)


def test_a_gateway_on_a_cache_others_could_write_stops_with_status_2_and_one_line(cache, tmp_path):
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    command = [sys.executable, "-m", "kvferry.services.commands", "gateway", "--port", "0"]
    command += ["--control", f"ipc://{tmp_path}/control"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("kvferry: error:")]
    assert str(cache) in line and f"chmod go-w {cache}" in line
