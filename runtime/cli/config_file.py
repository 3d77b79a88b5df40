"""`shardmesh node --config FILE` (and `serve`'s): a node's flags in a TOML file.

Every key is a flag without its leading dashes, spelled as on the command
line (`data-listen`); each value goes through its flag's own converter and
choices, so a file and a command line follow one set of rules. The file's
values become the parser's defaults, so a flag given on the command line
wins. Every mistake is a `ConfigError` of one line naming the file and the
key. The rules in full (types, relative paths, hidden flags):
docs/design/cli.md, "Config files".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tomllib
import typing
from collections.abc import Callable, Sequence
from pathlib import Path

CONFIG_DEST = "config"
"""The dest of the `--config FILE` flag itself (not a key of the file)."""


class ConfigError(ValueError):
    """A config file that cannot be used; its text is one line."""


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The subparser of `parser` for the command `name`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def settable_actions(command: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Key -> action for every flag a config file may set: the long option
    without its dashes; not --help, not --config, not a hidden flag."""
    keys: dict[str, argparse.Action] = {}
    for action in command._actions:
        long = [flag for flag in action.option_strings if flag.startswith("--")]
        hidden = action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction)
        if long and not hidden and action.dest != CONFIG_DEST:
            keys[long[0][2:]] = action
    return keys


def given_on_command_line(
    fresh: argparse.ArgumentParser, command: str, argv: Sequence[str]
) -> argparse.Namespace | None:
    """The options `argv` itself sets for `command` (no defaults), parsed by
    `fresh`, a throwaway parser this changes; None when argv runs another
    command, asks for help, or has a usage error (the real parse, after,
    then prints it as usual)."""
    for action in subcommand(fresh, command)._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            given = fresh.parse_args(argv)
    except SystemExit:
        return None
    return given if getattr(given, "command", None) == command else None


def apply_config(
    parser: argparse.ArgumentParser,
    make_parser: Callable[[], argparse.ArgumentParser],
    argv: Sequence[str],
    command: str = "node",
) -> None:
    """When `argv` runs `command` with --config FILE, make the file's values
    the defaults of `parser`'s `command` for every flag argv does not give
    (and no longer required). Raises ConfigError."""
    given = given_on_command_line(make_parser(), command, argv)
    path = getattr(given, CONFIG_DEST, None)
    if given is None or path is None:
        return
    sub = subcommand(parser, command)
    for dest, value in read_config(path, sub).items():
        if not hasattr(given, dest):
            for action in sub._actions:
                if action.dest == dest:
                    action.default = value
                    action.required = False


def read_config(path: Path, command: argparse.ArgumentParser) -> dict[str, object]:
    """dest -> value (converted as its flag's would be) for each key of
    the TOML file at `path`."""
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    keys = settable_actions(command)
    base = path.absolute().parent
    values: dict[str, object] = {}
    for key, value in document.items():
        action = keys.get(key)
        if action is None:
            raise ConfigError(f"{path}: {_unknown(key, keys, command.prog)}")
        try:
            values[action.dest] = _convert(action, value, base)
        except ValueError as exc:
            raise ConfigError(f"{path}: {key}: {exc}") from None
    return values


def _unknown(key: str, keys: dict[str, argparse.Action], prog: str) -> str:
    dashed = key.replace("_", "-")
    if dashed != key and dashed in keys:
        return f"unknown key {key!r}: spell it {dashed!r}, as the flag --{dashed}"
    return f"unknown key {key!r} (keys are the flags of `{prog} --help` without --)"


def _convert(action: argparse.Action, value: object, base: Path) -> object:
    if action.nargs == 0:  # store_true and the like
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, not {_toml_type(value)}")
        return action.const if value else action.default
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ValueError(f"expected an array of strings, not {_toml_type(value)}")
        return [_scalar(action, item, base) for item in value]
    return _scalar(action, value, base)


def _scalar(action: argparse.Action, value: object, base: Path) -> object:
    numeric = _takes_number(action)
    wanted = (int, float) if numeric else str
    if isinstance(value, bool) or not isinstance(value, wanted):
        raise ValueError(
            f"expected {'a number' if numeric else 'a string'}, not {_toml_type(value)}"
        )
    text = str(value)
    convert = action.type
    try:
        converted = convert(text) if callable(convert) else text
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    except (TypeError, ValueError):  # argparse's own words for a plain int/float
        name = getattr(convert, "__name__", repr(convert))
        raise ValueError(f"invalid {name} value: {text!r}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(repr(choice) for choice in action.choices)
        raise ValueError(f"invalid choice: {text!r} (choose from {choices})")
    if isinstance(converted, Path):
        converted = base / converted.expanduser()  # an absolute path stays as it is
    return converted


def _takes_number(action: argparse.Action) -> bool:
    """Whether the flag's converter makes a number (`int`, `float`, or a
    function annotated to return one): its key then takes a TOML number."""
    convert = action.type
    if isinstance(convert, type):
        return issubclass(convert, int | float)
    try:
        returns = typing.get_type_hints(convert).get("return")
    except (NameError, TypeError, AttributeError):
        return False
    return returns in (int, float)


def _toml_type(value: object) -> str:
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a float"),
        (str, "a string"),
        (list, "an array"),
        (dict, "a table"),
    ):
        if isinstance(value, kind):
            return name
    return "a date or time"
