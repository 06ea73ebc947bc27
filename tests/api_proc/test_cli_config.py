"""`pagoda serve --config FILE`: every flag from YAML, the command line winning (the real parser)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.api_proc.cli import build_parser
from pagoda.api_proc.cli_config import _subparser, parse_args_with_config

REPO = Path(__file__).resolve().parents[2]


def _parse(tmp_path: Path, yaml_text: str, *argv: str):
    config = tmp_path / "pagoda.yaml"
    config.write_text(yaml_text)
    return parse_args_with_config(build_parser(), ["serve", "--config", str(config), *argv])


def test_every_kind_of_flag_from_the_file(tmp_path):
    args = _parse(
        tmp_path,
        "port: 9001\nmax_num_seqs: 7\nserved-model-name: [a, b]\nno-prefix-caching: true\n"
        "enforce-eager: true\nshutdown-timeout: 5\ndtype: float32\nkv-cache-memory: 1GiB\n"
        "log-level: DEBUG\nmax-model-len: null\n",
    )
    assert (args.port, args.max_num_seqs, args.served_model_name) == (9001, 7, ["a", "b"])
    assert args.enable_prefix_caching is False and args.enforce_eager is True
    assert (args.shutdown_timeout, args.dtype, args.kv_cache_memory) == (5.0, "float32", "1GiB")
    assert args.log_level == "DEBUG" and args.max_model_len is None  # a top-level flag; null = the default
    assert args.max_num_batched_tokens == 2048  # not in the file: the flag's default


def test_command_line_wins_and_replaces_lists(tmp_path):
    text = "port: 9001\nserved-model-name: [a, b]\nmodel: /models/from-file\n"
    args = _parse(tmp_path, text, "--port", "9002", "--served-model-name", "z", "/models/from-cli")
    assert (args.port, args.served_model_name, args.model) == (9002, ["z"], "/models/from-cli")
    args = _parse(tmp_path, text)
    assert (args.port, args.served_model_name, args.model) == (9001, ["a", "b"], "/models/from-file")


def test_flags_added_by_other_modules_work_too(tmp_path):
    """Nothing is listed by hand: every long flag of `pagoda serve` is a key (e.g. the repeatable
    --api-key that api_proc/serve_settings.py adds)."""
    serve = _subparser(build_parser(), "serve")
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--")} - {"--help", "--config"}
    assert {"--max-num-seqs", "--served-model-name", "--no-prefix-caching", "--api-key"} <= flags
    for flag in sorted(flags):
        _parse(tmp_path, f"{flag[2:]}: null\n")  # accepted; null keeps the flag's default
    assert _parse(tmp_path, "api-key: [k1, k2]\n").api_key == ["k1", "k2"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("max-num-seq: 3\nfoo: 1\n", "unknown keys: max-num-seq (did you mean max-num-seqs?), foo"),
        ("dtype: float8\n", "dtype: invalid choice 'float8'"),
        ("port: eighty\n", "port: invalid value 'eighty'"),
        ("enforce-eager: 1\n", "enforce-eager: expected true or false"),
        ("port: [1, 2]\n", "port: expected a single value"),
        ("- port\n", "expected a mapping"),
        ("api-key: 0x5f3759df\n", "quote the value of --api-key"),
        ("admin-key: [012345670]\n", "quote the value of --admin-key"),
    ],
)
def test_bad_files_are_usage_errors_naming_the_key(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as exit_info:
        _parse(tmp_path, text)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_shipped_example_is_valid():
    args = parse_args_with_config(build_parser(), ["serve", "--config", str(REPO / "deploy" / "pagoda.yaml")])
    assert args.port == 8000 and args.host == "127.0.0.1"


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--max-connections", "-1"),
        ("--header-timeout", "nan"),
        ("--body-timeout", "inf"),
        ("--keepalive-timeout", "-5"),
    ],
)
def test_connection_limits_refuse_values_that_would_disable_or_break_them(flag, value, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])
    assert flag in capsys.readouterr().err
