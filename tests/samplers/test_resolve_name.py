"""`tfdp.samplers.resolve_name`: the one mapping from a requested sampler to the one that draws.

Every route (the trainer's `PrivacyConfig`, Keras `fit`, the privacy
calculator) asks it, so a new sampler declares its forms on its class and
adds no table elsewhere.
"""

import ast
import pathlib

import pytest

from tfdp import samplers


@pytest.mark.parametrize("requested, unit, bands, expected", [
    ("poisson", "example", 1, "poisson"),
    ("poisson", "example", 4, "banded_poisson"),
    ("poisson", "user", 1, "user_poisson"),
    ("poisson", "user", 3, "banded_user_poisson"),
    ("user_poisson", "user", 1, "user_poisson"),
    ("user_poisson", "user", 2, "banded_user_poisson"),
    ("banded_poisson", "example", 2, "banded_poisson"),
    ("shuffle", "example", 1, "shuffle"),
])
def test_forms(requested, unit, bands, expected):
    assert samplers.resolve_name(requested, privacy_unit=unit, bands=bands) == expected


@pytest.mark.parametrize("requested, unit, bands, message", [
    ("shuffle", "example", 2, "bands > 1 samples each privacy unit"),
    ("shuffle", "user", 1, "draws users by Poisson sampling"),
    ("nope", "example", 1, "Unknown sampler"),
    ("poisson", "household", 1, "privacy_unit must be"),
    ("poisson", "example", 0, "bands"),
])
def test_refusals_name_the_cause(requested, unit, bands, message):
    with pytest.raises(ValueError, match=message):
        samplers.resolve_name(requested, privacy_unit=unit, bands=bands)


def test_every_registered_form_is_registered_and_keeps_its_unit():
    for name in samplers.names():
        cls = samplers.sampler_class(name)
        for form in (cls.user_form, cls.banded_form):
            if form is not None:
                samplers.sampler_class(form)  # Raises for an unregistered name.
        if cls.banded_form is not None:
            assert samplers.sampler_class(cls.banded_form).privacy_unit == cls.privacy_unit
            assert samplers.sampler_class(cls.banded_form).takes_bands


def test_no_module_maps_banded_or_user_names_itself():
    """The banded and user-level names appear as string constants only in tfdp.samplers."""
    root = pathlib.Path(samplers.__file__).resolve().parent.parent
    found = []
    for path in root.rglob("*.py"):
        if "samplers" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and node.value in ("banded_poisson", "banded_user_poisson", "user_poisson")):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, found
