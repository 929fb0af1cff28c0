"""Gin: registering Keras 3 objects, locating and parsing config files.

`gin.tf` imports modules removed from TF, so Keras objects are registered here
with `gin.external_configurable`.

Where files are found (docs/DATA.md, "Gin files"):
- a file named on the command line (`--gin_file`) as given, else in tfdp's
  gin directory;
- an `include` inside a gin file in tfdp's gin directory first, then beside
  the file that includes it. The working directory is never searched, so a
  run behaves the same from any directory.

tfdp's gin directory is `gin/` of the checkout that holds the `tfdp`
package (an editable install, `pip install -e .`, keeps it there).
"""

import difflib
import inspect
import numbers
import os
import pathlib
import re
import tokenize

import gin

GIN_DIR = pathlib.Path(__file__).resolve().parent.parent / "gin"
# An include is a line of its own: `include 'path/to/file.gin'`.
_INCLUDE = re.compile(r"""^[ \t]*include[ \t]+(['"])(?P<path>[^'"]+)\1[ \t]*(#.*)?$""")
_registered = False
# Old binding -> its new place, e.g. "train.epochs" -> "OptimizationConfig.epochs".
_moved_bindings = {}
# What gin raises for a bad file or binding (an unclosed bracket is a TokenError).
_GIN_ERRORS = (ValueError, KeyError, SyntaxError, IOError, tokenize.TokenError)


def register_configurables():
    """Imports the tfdp modules whose functions are gin-configurable."""
    global _registered
    if _registered:
        return
    # Imported here, not at the top: the gin files are parsed and checked
    # before TensorFlow's import (`precheck`), and these modules import it.
    import keras

    import tfdp.data  # noqa: F401
    import tfdp.models  # noqa: F401
    import tfdp.optim  # noqa: F401

    for name in ("SGD", "Adam", "AdamW"):
        gin.external_configurable(getattr(keras.optimizers, name), module="keras.optimizers")
    _registered = True


def register_moved_bindings(moved):
    """Reports a binding of a parameter that moved with its new place, not as unknown.

    Gin reports such a binding as a parameter the configurable does not
    have; `parse` and `precheck` name instead every moved binding of the
    same file (or of the `--gin_param` bindings) with its new place, in one
    line.

    Args:
        moved: dict. Old binding -> new binding, e.g.
            `{"train.epochs": "OptimizationConfig.epochs"}`.
    """
    _moved_bindings.update(moved)


def resolve_gin_file(path):
    """Finds a gin file named on the command line: as given, else in tfdp's gin dir.

    Args:
        path: str. A path, absolute or relative to the working directory, or
            relative to tfdp's gin directory (`"mnist_default.gin"`) or to
            the checkout (`"gin/mnist_default.gin"`).

    Returns:
        The path of the file, as a str.

    Raises:
        ValueError: when no such file exists.
    """
    candidates = [pathlib.Path(path), GIN_DIR / path, GIN_DIR.parent / path]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise ValueError(
        f"Gin file not found (looked as given and in {GIN_DIR}). Received: gin_file={path!r}"
    )


def resolve_include(path, including_file):
    """Finds the file of an `include` statement: tfdp's gin dir, then beside the includer.

    Args:
        path: str. The path written in the `include` statement.
        including_file: str. The gin file that holds the statement.

    Returns:
        The path of the included file, as a str.

    Raises:
        ValueError: naming the statement and where it was looked for.
    """
    if os.path.isabs(path):
        candidates = [pathlib.Path(path)]
    else:
        candidates = [GIN_DIR / path, pathlib.Path(including_file).resolve().parent / path]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise ValueError(
        f"Gin include not found in {including_file}: looked in "
        f"{', '.join(str(c) for c in candidates)}. Received: include {path!r}"
    )


_UNKNOWN_PARAMETER = re.compile(
    r"Configurable '(?P<configurable>[^']+)' doesn't have a parameter named '(?P<name>[^']+)'")
_UNKNOWN_CONFIGURABLE = re.compile(r"No configurable matching '(?P<name>[^']+)'")
_BOUND_NAME = re.compile(r"^\s*(?P<configurable>[A-Za-z_][\w.]*)\.(?P<parameter>\w+)\s*=",
                         re.M)
_GIN_NAME = re.compile(r"^\s*(?P<configurable>[A-Za-z_][\w.]*)\.\w+\s*=|@(?P<reference>[\w.]+)",
                       re.M)


def known_configurable_names():
    """The configurables that tfdp's gin files bind or reference, e.g. `PrivacyConfig`."""
    names = set()
    for path in GIN_DIR.rglob("*.gin"):
        for match in _GIN_NAME.finditer(path.read_text()):
            names.add(match["configurable"] or match["reference"])
    return sorted(names)


def _short_name(configurable, parameter):
    """`"tfdp.train", "epochs"` -> `"train.epochs"`: the form `register_moved_bindings` keys."""
    return f"{configurable.rsplit('.', 1)[-1]}.{parameter}"


def closest_name_hint(message):
    """"Did you mean 'OptimizationConfig.epochs'?" for gin's unknown-name errors; else ""."""
    match = _UNKNOWN_PARAMETER.search(message)
    if match:
        try:
            configurable = gin.config.get_configurable(match["configurable"])
            parameters = inspect.signature(inspect.unwrap(configurable)).parameters
        except (KeyError, ValueError, TypeError):
            return ""
        candidates = {f"{match['configurable']}.{name}": name for name in parameters}
        prefix = _short_name(match["configurable"], "")
        candidates.update({new: old[len(prefix):] for old, new in _moved_bindings.items()
                           if old.startswith(prefix)})
        close = difflib.get_close_matches(match["name"], list(candidates.values()), n=1)
        binding = next((b for b, name in candidates.items() if close and name == close[0]), None)
        return f"Did you mean '{binding}'?" if binding else ""
    match = _UNKNOWN_CONFIGURABLE.search(message)
    if match:
        close = difflib.get_close_matches(match["name"], known_configurable_names(), n=1)
        return f"Did you mean '{close[0]}'?" if close else ""
    return ""


def moved_bindings_message(text):
    """"train.a moved to A.a, train.b moved to B.b" for the moved bindings in `text`; else ""."""
    found = []
    for match in _BOUND_NAME.finditer(text):
        name = _short_name(match["configurable"], match["parameter"])
        if name in _moved_bindings and name not in found:
            found.append(name)
    return ", ".join(f"{name} moved to {_moved_bindings[name]}" for name in found)


def _bad_configuration(error, where, text=""):
    message = " ".join(str(error).split())
    match = _UNKNOWN_PARAMETER.search(message)
    if match and _short_name(match["configurable"], match["name"]) in _moved_bindings:
        moved = moved_bindings_message(text) or (
            f"{_short_name(match['configurable'], match['name'])} moved to "
            f"{_moved_bindings[_short_name(match['configurable'], match['name'])]}")
        return ValueError(
            f"Bad gin configuration in {where}: {moved} (python -m tfdp.train --help lists "
            f"the bindings by config). Received: {match['configurable']}.{match['name']}")
    hint = closest_name_hint(message)
    if hint:  # After gin's first sentence, before the line it quotes.
        first, dot, rest = message.partition(". ")
        message = f"{first}. {hint} {rest}" if dot else f"{message} {hint}"
    return ValueError(f"Bad gin configuration in {where}: {message}")


def _parse_file(path, stack=(), skip_unknown=False):
    """Parses one gin file, its includes resolved by `resolve_include`.

    gin's own include lookup starts in the working directory and treats the
    include's folder as a Python package, which fails when the working
    directory holds a folder of that name. So each include is resolved
    here and its file parsed in place; the text between includes goes to gin
    with its line numbers kept, so gin's messages point at the right lines.
    """
    path = str(pathlib.Path(path).resolve())
    if path in stack:
        raise ValueError(f"Gin files include each other in a cycle. Received: "
                         f"{' -> '.join(stack + (path,))}")
    with open(path) as f:
        lines = f.read().splitlines()
    start = 0

    def parse_lines(stop):
        text = "\n" * start + "\n".join(lines[start:stop])
        if text.strip():
            try:
                gin.parse_config(text, skip_unknown=skip_unknown)
            except _GIN_ERRORS as e:
                raise _bad_configuration(e, path, text) from None

    for number, line in enumerate(lines):
        match = _INCLUDE.match(line)
        if match is None:
            continue
        parse_lines(number)
        _parse_file(resolve_include(match["path"], path), stack + (path,), skip_unknown)
        start = number + 1
    parse_lines(len(lines))


def precheck(gin_files, gin_params, validators=None):
    """The configuration errors found without importing TensorFlow.

    Parses everything as `parse` does, but without importing the modules
    whose functions are configurable: bindings of configurables that are not
    imported yet are skipped, while files, includes, the syntax and every
    binding of an imported configurable (`train` and its configs such as
    `PrivacyConfig`, whose modules import no TensorFlow) are checked. So a
    misspelt `PrivacyConfig.*` binding or a missing file is reported in a
    fraction of a second instead of after TensorFlow's import; `parse` then
    checks everything else.

    Args:
        gin_files: list of str. As for `parse`.
        gin_params: list of str. As for `parse`.
        validators: dict or None. Binding (`"PrivacyConfig.l2_norm_clip"`) -> a
            function that raises `ValueError` for a bad value; applied to the
            bound numbers. Defaults to None.

    Raises:
        ValueError: one line naming the bad file, include or binding.
    """
    try:
        parse(gin_files, gin_params, skip_unknown=True)
        for name, validate in (validators or {}).items():
            try:
                value = gin.query_parameter(name)
            except ValueError:  # Not bound: the default, valid by construction.
                continue
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                validate(value)
    finally:
        gin.clear_config()


def parse(gin_files, gin_params, skip_unknown=False):
    """Parses files in order (later override earlier), then bindings.

    Args:
        gin_files: list of str. Files, found by `resolve_gin_file`; their
            includes by `resolve_include`.
        gin_params: list of str. Bindings, applied after the files, in
            order; an `include 'x.gin'` among them is found and read like
            a file of `gin_files`.
        skip_unknown: bool. Skip the bindings of configurables that are not
            registered (`precheck`). Defaults to False.

    Raises:
        ValueError: with a one-line message naming the bad file, include or
            binding.
    """
    if not skip_unknown:
        register_configurables()
    gin.clear_config()
    files = [resolve_gin_file(f) for f in gin_files]
    for path in files:
        _parse_file(path, skip_unknown=skip_unknown)
    bindings = []

    def parse_bindings():
        try:
            gin.parse_config(bindings, skip_unknown=skip_unknown)
        except _GIN_ERRORS as e:
            raise _bad_configuration(e, "--gin_param", "\n".join(bindings)) from None
        bindings.clear()

    for binding in gin_params:
        match = _INCLUDE.match(binding)
        if match is None:
            bindings.append(binding)
            continue
        parse_bindings()  # --gin_param="include 'x.gin'" is read as a --gin_file.
        _parse_file(resolve_gin_file(match["path"]), skip_unknown=skip_unknown)
    parse_bindings()
