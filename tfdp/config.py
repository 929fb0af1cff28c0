"""Gin: registering Keras 3 objects, locating and parsing config files.

`gin.tf` imports modules removed from TF, so Keras objects are registered here
with `gin.external_configurable`.
"""

import os
import pathlib

import gin
import keras

REPO_GIN_DIR = pathlib.Path(__file__).resolve().parent.parent / "gin"
_registered = False


def register_configurables():
    """Imports the tfdp modules whose functions are gin-configurable."""
    global _registered
    if _registered:
        return
    import tfdp.data  # noqa: F401
    import tfdp.models  # noqa: F401
    import tfdp.optim  # noqa: F401

    for name in ("SGD", "Adam", "AdamW"):
        gin.external_configurable(getattr(keras.optimizers, name), module="keras.optimizers")
    _registered = True


def resolve_gin_file(path):
    """Finds a gin file as given, or relative to the repository's gin/ dir."""
    candidates = [pathlib.Path(path), REPO_GIN_DIR / path, REPO_GIN_DIR.parent / path]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise ValueError(f"Gin file not found. Received: gin_file={path!r}")


def parse(gin_files, gin_params):
    """Parses files in order (later override earlier), then bindings.

    Raises:
        ValueError: with a one-line message naming the bad file or binding.
    """
    register_configurables()
    gin.clear_config()
    gin.add_config_file_search_path(str(REPO_GIN_DIR))
    gin.add_config_file_search_path(str(REPO_GIN_DIR.parent))
    gin.add_config_file_search_path(os.getcwd())
    files = [resolve_gin_file(f) for f in gin_files]
    try:
        gin.parse_config_files_and_bindings(files, gin_params, finalize_config=False)
    except (ValueError, KeyError, SyntaxError, IOError) as e:
        message = " ".join(str(e).split())
        raise ValueError(f"Bad gin configuration: {message}") from None
