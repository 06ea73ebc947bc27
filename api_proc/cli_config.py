"""`pagoda serve --config pagoda.yaml`: command-line flags from a YAML file.

The file is a flat mapping whose keys are the flags without their dashes, `max-num-seqs` or
`max_num_seqs`; values are what the flag takes (a list for a repeatable flag such as
`served-model-name` or `api-key`, true/false for a switch such as `enforce-eager` or
`no-prefix-caching`, null for the flag's own default). Everything is derived from the argparse
parsers, so a flag added to `pagoda serve` is valid in the file with no change here:

1. parse the command line once, to find `--config` and the subcommand's parser;
2. check every key against that parser's flags (and the top-level ones, e.g. `log-level`) and convert
   each value with the flag's own type and choices; unknown keys or bad values are a usage error
   naming them (exit status 2);
3. make the values the parsers' defaults (`set_defaults`) and parse the command line again, so flags
   given on the command line win. A repeatable flag given on the command line replaces the file's
   list instead of appending to it, and a MODEL argument replaces the file's `model`.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

_SWITCH_ACTIONS = (argparse._StoreConstAction, argparse.BooleanOptionalAction)  # take no value
_NOT_CONFIGURABLE = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, with defaults taken from the YAML file of `--config` if given."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if not path:
        return args
    command = _subparser(parser, getattr(args, "command", None))
    options = {**_options(parser), **_options(command)}  # the subcommand's flags win a name clash
    values = _load(command, path)
    unknown = [key for key in values if _key(key) not in options]
    if unknown:
        hints = [
            f"{key} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(_key(key), options, 1)) else key
            for key in unknown
        ]
        _error(command, f"{path}: unknown key{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}")
    lists: dict[str, tuple[argparse.Action, list]] = {}  # repeatable flags: applied after parsing
    file_model = None
    for key, value in values.items():
        owner, action = options[_key(key)]
        if value is None:
            continue
        converted = _convert(command, path, key, action, value)
        if action.dest == "model":
            file_model = converted
        if isinstance(action, argparse._AppendAction):
            lists[action.dest] = (action, converted)
        else:
            owner.set_defaults(**{action.dest: converted})
    args = parser.parse_args(argv)
    for dest, (action, items) in lists.items():
        if getattr(args, dest) == action.default:  # not given on the command line
            setattr(args, dest, items)
    if getattr(args, "model_arg", None) is not None and file_model is not None and args.model == file_model:
        args.model = args.model_arg  # the MODEL argument overrides the file's model
    return args


def _error(parser: argparse.ArgumentParser, message: str) -> None:
    """Exit 2 like argparse's usage errors, without the usage text (the file is at fault, not the flags)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def _key(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, argparse.Action]]:
    """Every long flag of `parser` (without dashes) -> (parser, action); `--config` itself excluded."""
    return {
        _key(option): (parser, action)
        for action in parser._actions
        if not isinstance(action, _NOT_CONFIGURABLE) and action.dest != "config"
        for option in action.option_strings
        if option.startswith("--")
    }


def _load(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        _error(parser, f"cannot read the config file {path}: {exc.strerror}")
    except yaml.YAMLError as exc:
        _error(parser, f"{path} is not valid YAML: {exc}")
    if values is None:
        return {}
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        _error(parser, f"{path}: expected a mapping of flag names to values, like `max-num-seqs: 64`")
    return values


def _convert(parser: argparse.ArgumentParser, path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """The value argparse would have stored for this flag, from a YAML value."""

    def fail(why: str):
        _error(parser, f"{path}: {key}: {why}")

    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            fail(f"expected true or false, got {value!r}")
        return value != _key(key).startswith("no-")  # `no-foo: true` means foo = False
    if isinstance(action, argparse._CountAction):  # -v -v: `verbose: 2`
        if isinstance(value, bool) or not isinstance(value, int):
            fail(f"expected a count, got {value!r}")
        return value
    if isinstance(action, _SWITCH_ACTIONS):
        if not isinstance(value, bool):
            fail(f"expected true or false, got {value!r}")
        return action.const if value else action.default
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, item, fail) for item in items]
    if isinstance(value, (list, dict)):
        fail(f"expected a single value, got {value!r}")
    return _scalar(action, value, fail)


def _scalar(action: argparse.Action, value: Any, fail) -> Any:
    if isinstance(value, (bool, list, dict)) or value is None:
        fail(f"expected a value for --{_key(action.option_strings[-1])}, got {value!r}")
    if "key" in action.dest and not isinstance(value, str):
        # YAML has already turned 0x5f3759df or 012345670 into a number: str() would give another key.
        fail(f"quote the value of --{_key(action.option_strings[-1])}: YAML read it as the number {value!r}")
    text = str(value)  # YAML's 8 or 0.9 becomes what the command line would have given
    try:
        converted = action.type(text) if callable(action.type) else text
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        fail(f"invalid value {value!r} ({exc})")
    if action.choices is not None and converted not in action.choices:
        fail(f"invalid choice {value!r} (choose from {', '.join(map(str, action.choices))})")
    return converted
