"""TOML stage configs: the examples load, and every mistake is named by file, stage and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_loads(path: Path) -> None:
    config = load_config(path)
    assert config.stages and config.path == str(path)


def test_example_matches_stagespec() -> None:
    config = load_config(ROOT / "examples" / "two_stages.toml")
    talker, decoder = config.stages
    assert (talker.name, talker.ranks, talker.backend, talker.runner_args["weights_bytes"]) == (
        "talker",
        2,
        "portable",
        4 << 20,
    )
    assert decoder.admission.value == "wake" and config.server.default_stage == "talker"
    assert config.server.host == "127.0.0.1"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stages.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[[stages]]\nname = "a"\nranks = "2"\n', "stage 'a' (stages[0]): field 'ranks': expected an integer, got '2'"),
        (
            '[[stages]]\nname = "a"\nrnaks = 2\n',
            "stage 'a' (stages[0]): field 'rnaks': unknown field; known fields: ['admission', ",
        ),
        (
            '[[stages]]\nname = "a"\n[[stages]]\nname = "b"\nranks = 0\n',
            "stage 'b' (stages[1]): field 'ranks': expected an integer >= 1, got 0",
        ),
        (
            '[[stages]]\nname = "a"\nbackend = "magic"\n',
            "stage 'a' (stages[0]): field 'backend': backend 'magic' is not one of",
        ),
        (
            '[[stages]]\nname = "a b"\n',
            "stages[0]): field 'name': expected a string matching regex '^[A-Za-z0-9_.-]{1,64}$', got 'a b'",
        ),
        ("[[stages]]\nranks = 1\n", "stages[0]: field 'name': missing, and it has no default: give it"),
        (
            '[[stages]]\nname = "a"\n[[stages]]\nname = "a"\n',
            "stage 'a' (stages[1]): field 'name': duplicate stage name (also stages[0])",
        ),
        (
            '[server]\ndefault_stage = "zz"\n[[stages]]\nname = "a"\n',
            "field 'default_stage': [server] default_stage 'zz' is not a stage; stages are ['a']",
        ),
        (
            '[server]\nport = 70000\n[[stages]]\nname = "a"\n',
            "field 'port': [server] expected an integer <= 65535, got 70000",
        ),
        (
            '[server]\napi_key = "x"\n[[stages]]\nname = "a"\n',
            "field 'api_key': [server] unknown field; known fields: ['access_log', 'allowed_hosts', ",
        ),
        ('[engine]\ntransport = 3\n[[stages]]\nname = "a"\n', "field 'transport': [engine] expected a string, got 3"),
        ("[server]\n", "needs at least one [[stages]] table"),
        ('[[stages]\nname = "a"\n', "not valid TOML"),
        ("stage = 1\n", "unknown top-level key 'stage'"),
    ],
)
def test_errors_name_file_stage_and_field(tmp_path: Path, toml: str, expected: str) -> None:
    path = _write(tmp_path, toml)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(str(path) + ": "), message
    assert expected in message, message


def test_missing_file_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file; pass the path of a TOML stage configuration"):
        load_config(tmp_path / "absent.toml")


def test_a_huge_binary_or_directory_path_is_refused_before_parsing(tmp_path: Path) -> None:
    from omni_core.config import MAX_CONFIG_BYTES

    huge = tmp_path / "huge.toml"
    huge.write_text('[[stages]]\nname = "a"\n' + "# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    with pytest.raises(ConfigError, match=f"over {MAX_CONFIG_BYTES} bytes; a stage configuration is a few KiB"):
        load_config(huge)
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x80\xff\x00" * 10)
    with pytest.raises(ConfigError, match="not UTF-8 text, so not TOML"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a directory; pass the path of a TOML stage configuration file"):
        load_config(tmp_path)


def test_paths_are_relative_to_the_file(tmp_path: Path) -> None:
    path = _write(
        tmp_path, '[server]\napi_key_file = "secret/key"\nallowed_reload_sources = ["ckpt"]\n[[stages]]\nname = "a"\n'
    )
    server = load_config(path).server
    assert server.api_key_file == str(tmp_path / "secret" / "key")
    assert server.allowed_reload_sources == (str(tmp_path / "ckpt"),)


def test_a_simulated_device_table_becomes_the_stage_s_device(tmp_path: Path) -> None:
    from omni_core.workers.simulated_device import SimulatedDevice

    path = _write(
        tmp_path, '[[stages]]\nname = "dit"\n[stages.simulated_device]\ndirectory = "gpu0"\ncapacity_bytes = 1048576\n'
    )
    (stage,) = load_config(path).stages
    assert stage.simulated_device == SimulatedDevice(str(tmp_path / "gpu0"), 1 << 20)  # relative to the file


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('directory = "d"\n', "field 'simulated_device.capacity_bytes': missing, and it has no default"),
        ('directory = "d"\ncapacity_bytes = 0\n', "capacity_bytes must be an integer in 1..2**60, got 0"),
        (
            'directory = "d"\ncapacity_bytes = 1\nsize = 2\n',
            "field 'simulated_device.size': unknown field; known fields: ['capacity_bytes', 'directory']",
        ),
        (
            'directory = "d"\ncapacity_bytes = "1G"\n',
            "field 'simulated_device.capacity_bytes': expected an integer, got '1G'",
        ),
    ],
)
def test_simulated_device_mistakes_are_named(tmp_path: Path, table: str, expected: str) -> None:
    path = _write(tmp_path, f'[[stages]]\nname = "dit"\n[stages.simulated_device]\n{table}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert expected in str(info.value), str(info.value)


def test_a_simulated_device_is_for_cpu_stages(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[[stages]]\nname = "dit"\ndevice = "cuda"\n[stages.simulated_device]\ndirectory = "d"\ncapacity_bytes = 1\n',
    )
    with pytest.raises(ConfigError, match="on a GPU the real free memory is used: remove simulated_device"):
        load_config(path)
