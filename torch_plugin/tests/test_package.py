"""slotpool_torch where no GPU (and no torch) is needed: the package imports and its command
line parses without torch, a missing torch or CUDA toolkit is one clear message, and the loader
finds libslotpool by every name it is installed under."""

import os
import re
import subprocess
import sys

import pytest

from conftest import PLUGIN, REPO

import slotpool_torch
from slotpool_torch import _loader
from slotpool_torch.__main__ import parse_args


def _no_torch_dir(tmp_path):
    """A directory that, first on PYTHONPATH, makes `import torch` fail as it does where torch
    is not installed (also where it is)."""
    d = tmp_path / "no_torch" / "torch"
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    return str(d.parent)


def _python(tmp_path, *args, env=None):
    """Runs python with the checkout's package and without torch."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("SLOTPOOL_")}
    e["PYTHONPATH"] = os.pathsep.join([_no_torch_dir(tmp_path), PLUGIN])
    e.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e,
                          timeout=120, cwd=str(tmp_path))


def test_the_package_imports_without_torch(tmp_path):
    p = _python(tmp_path, "-c", "import sys, slotpool_torch; "
                "print(slotpool_torch.__name__, 'torch' in sys.modules)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "False", "importing slotpool_torch imported torch"


def test_help_without_torch(tmp_path):
    p = _python(tmp_path, "-m", "slotpool_torch", "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: python -m slotpool_torch"), p.stdout
    for option in ("--backend", "--conf", "--build", "-m MODULE", "SLOTPOOL_CONF"):
        assert option in p.stdout, option


def test_running_a_script_without_torch_is_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    p = _python(tmp_path, "-m", "slotpool_torch", str(script))
    assert p.returncode == 1
    assert "ran" not in p.stdout
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("slotpool_torch: error: slotpool_torch needs PyTorch"), lines[0]
    assert "pip install --no-build-isolation ./torch_plugin" in lines[0]


def test_install_without_torch_raises_a_clear_import_error(tmp_path):
    code = ("import slotpool_torch\n"
            "try:\n    slotpool_torch.install()\n"
            "except ImportError as e:\n    print(type(e).__name__, '|', e)\n")
    p = _python(tmp_path, "-c", code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("TorchMissing | slotpool_torch needs PyTorch"), p.stdout


def test_setup_without_torch_stops_with_a_message(tmp_path):
    p = _python(tmp_path, os.path.join(PLUGIN, "setup.py"), "build_ext")
    assert p.returncode == 1
    assert "Traceback" not in p.stderr, p.stderr
    assert "error: slotpool_torch needs PyTorch" in p.stderr, p.stderr


def test_a_missing_cuda_toolkit_is_named(tmp_path):
    assert "needs a CUDA toolkit and none was found" in _loader.toolkit_problem(None)
    empty = tmp_path / "cuda"
    empty.mkdir()
    assert "has no" in _loader.toolkit_problem(str(empty))
    (empty / "include").mkdir()
    (empty / "include" / "cuda_runtime_api.h").write_text("")
    assert _loader.toolkit_problem(str(empty)) is None


@pytest.mark.parametrize(
    "argv, want",
    [
        (["train.py", "--lr", "3", "-m", "x"],
         dict(backend="cuda", conf=None, module=None, target=["train.py", "--lr", "3", "-m", "x"])),
        (["--conf", "growth:classic", "-m", "pkg.mod", "--flag", "1"],
         dict(conf="growth:classic", module="pkg.mod", target=["--flag", "1"])),
        (["--backend=sim", "--conf=a:1,b:2", "-v", "--", "-script.py", "-v"],
         dict(backend="sim", conf="a:1,b:2", verbose=True, target=["-script.py", "-v"])),
        (["--conf", " ", "s.py"], dict(conf=None, target=["s.py"])),
        (["--build"], dict(build=True, target=[])),
    ],
)
def test_command_line(argv, want):
    args = vars(parse_args(argv))
    assert {k: args[k] for k in want} == want, args


@pytest.mark.parametrize("argv, message", [
    ([], "a script or -m MODULE is required"),
    (["--bogus", "s.py"], "unrecognized arguments: --bogus"),
    (["-m"], "argument -m: expected one argument"),
    (["--conf"], "argument --conf: expected one argument"),
])
def test_bad_command_lines_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return str(path)


def test_the_loader_finds_the_library_by_each_name(tmp_path, monkeypatch):
    both = tmp_path / "both"
    so0 = _touch(both / "libslotpool.so.0")
    _touch(both / "libslotpool.so")
    cargo = tmp_path / "cargo"
    so = _touch(cargo / "libslotpool.so")
    monkeypatch.setenv("SLOTPOOL_LIB", str(both))
    assert _loader.find_lib() == so0, "an installed prefix: the SONAME first"
    monkeypatch.setenv("SLOTPOOL_LIB", str(cargo))
    assert _loader.find_lib() == so, "cargo's target/release: libslotpool.so"
    monkeypatch.setenv("SLOTPOOL_LIB", so)
    assert _loader.find_lib() == so, "the file itself"
    for bad in (str(tmp_path / "nowhere"), str(tmp_path)):
        monkeypatch.setenv("SLOTPOOL_LIB", bad)
        with pytest.raises(FileNotFoundError, match="no libslotpool.so.0 or libslotpool.so there"):
            _loader.find_lib()


def test_the_loader_reports_where_it_looked(monkeypatch):
    monkeypatch.delenv("SLOTPOOL_LIB", raising=False)
    monkeypatch.setattr(_loader, "PKG_DIR", "/nonexistent/pkg")
    monkeypatch.setattr(_loader, "REPO_DIR", "/nonexistent/repo")
    with pytest.raises(FileNotFoundError) as e:
        _loader.find_lib()
    assert "/nonexistent/pkg" in str(e.value) and "set SLOTPOOL_LIB" in str(e.value)


def test_the_built_library_loads_with_ctypes_and_names_its_codes():
    # The library the package would load (the same file: one copy, one allocator, in a process
    # that goes on to install slotpool), loaded as the package loads it: ctypes, by path.
    import ctypes

    try:
        lib = _loader.find_lib()
    except FileNotFoundError:
        pytest.skip("libslotpool.so is not built (cargo build --release -p slotpool-capi)")
    so = ctypes.CDLL(lib)
    so.sp_status_name.restype = ctypes.c_char_p
    so.sp_status_name.argtypes = [ctypes.c_int]
    assert so.sp_status_name(0) == b"SP_OK"
    assert so.sp_status_name(2) == b"SP_ERR_OUT_OF_MEMORY"
    assert so.sp_status_name(99) == b"SP_ERR_UNRECOGNIZED"


def test_the_package_version_is_the_librarys():
    cargo = open(os.path.join(REPO, "Cargo.toml")).read()
    want = re.search(r'\[workspace\.package\][^\[]*?version\s*=\s*"([^"]+)"', cargo).group(1)
    pyproject = open(os.path.join(PLUGIN, "pyproject.toml")).read()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == want
    assert slotpool_torch.__name__ == "slotpool_torch"


def test_config_reads_the_library_s_defaults_without_torch(tmp_path):
    """The package restates no default: it reads them from libslotpool, over $SLOTPOOL_CONF,
    without initialising it (install() could still pass its own conf)."""
    code = (
        "import slotpool_torch as sp; "
        "print(sp.config()); print(sp.config('vmm_page_mb')); print(sp.config('max_split_size_mb')); "
        "print(sp.config('garbage_collection_threshold') == '')\n"
        "try:\n    sp.config('no_such_key')\nexcept ValueError as e:\n    print('refused', e)\n"
    )
    env = {"SLOTPOOL_CONF": "vmm_page_mb:8,max_split_size_mb:64"}
    if os.environ.get("SLOTPOOL_LIB"):
        env["SLOTPOOL_LIB"] = os.environ["SLOTPOOL_LIB"]
    p = _python(tmp_path, "-c", code, env=env)
    assert p.returncode == 0, p.stderr
    conf, page, split, gc_unset, refused = p.stdout.strip().splitlines()
    assert conf.startswith("growth:vmm,") and "vmm_page_mb:8" in conf, conf
    assert "max_split_size_mb:64" in conf, conf
    assert (page, split, gc_unset) == ("8", "64", "True")
    assert refused.startswith("refused") and "no_such_key" in refused, refused
