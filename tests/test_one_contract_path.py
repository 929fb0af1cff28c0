"""Inside tfdp, every route makes its `DPSGD` one way, from a `DPSGDConfig`.

Reads tfdp's sources with `ast` (nothing is imported, so this runs in well
under a second):
- `DPSGD(...)` is called nowhere but in `tfdp/mechanism.py`: the routes call
  `DPSGD.from_config(config, ...)`, so C, σ and δ are validated and read in
  the request alone;
- `DPSGD.from_config(...)` is called only by the engine
  (`tfdp.engine.make_engine`, which every route makes its contract with) and
  `tfdp/mechanism.py` (and `PrivateTrainStep`'s keyword conveniences in
  `tfdp.dp`, below the engine: no route's);
- C and σ are validated by `tfdp.validation`'s rules, called only where a
  request or a record is read, and no module keeps an inline copy of them.
"""

import ast
import pathlib
import unittest

_ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfdp"

# Where C is checked by its rule: the request, every clipping method's
# `ClipRule`, a ledger read back from a record, and the trainer's gin values
# before TensorFlow's import.
_CLIP_RULE_CALLERS = {
    "tfdp/dpsgd_config.py",
    "tfdp/dp/clip_rule.py",  # `ClipRule`: C of every clipping method.
    "tfdp/privacy/ledger.py",
    "tfdp/train.py",
}


# Where `DPSGD.from_config` is called: the engine, the mechanism itself, and
# `tfdp.dp.PrivateTrainStep(l2_norm_clip=, noise_multiplier=,
# expected_batch_size=)`, a convenience of tfdp.dp (below the engine, so it
# cannot ask it) that no route takes: the trainer passes its engine.
_FROM_CONFIG_CALLERS = {
    "tfdp/engine.py",
    "tfdp/mechanism.py",
    "tfdp/dp/private_step.py",
}


def _sources():
    for path in sorted(_ROOT.rglob("*.py")):
        yield str(path.relative_to(_ROOT.parent)), path.read_text()


def _called_name(call):
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _calls(source, name):
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and _called_name(node) == name]


def _references(source, name):
    """Lines naming `name` (a call, or the function passed on), defining it aside."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.Name) and node.id == name)
            or (isinstance(node, ast.Attribute) and node.attr == name)]


def _from_config_calls(source):
    """Lines calling `DPSGD.from_config` (`DPSGD`, `x.DPSGD`, `cls` in mechanism.py)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "from_config"):
            continue
        owner = node.func.value
        name = (owner.id if isinstance(owner, ast.Name) else
                owner.attr if isinstance(owner, ast.Attribute) else None)
        if name == "DPSGD":
            found.append(node.lineno)
    return found


class OneContractPathTest(unittest.TestCase):
    def test_dpsgd_is_made_from_a_config(self):
        found = [f"{path}:{line}" for path, source in _sources()
                 if path != "tfdp/mechanism.py" for line in _calls(source, "DPSGD")]
        self.assertEqual(found, [], "make the DPSGD with DPSGD.from_config(DPSGDConfig(...))")

    def test_contract_is_bound_by_the_engine(self):
        found = [f"{path}:{line}" for path, source in _sources()
                 if path not in _FROM_CONFIG_CALLERS for line in _from_config_calls(source)]
        self.assertEqual(found, [], "bind a DPSGDConfig with tfdp.engine.make_engine")
        self.assertTrue(_from_config_calls((_ROOT / "engine.py").read_text()))

    def test_clip_rule_callers(self):
        found = {path for path, source in _sources()
                 if _references(source, "validate_l2_norm_clip")}
        self.assertEqual(found - _CLIP_RULE_CALLERS, set(),
                         "C is validated in the DPSGDConfig; pass one instead")
        # The list names no module that no longer checks C.
        self.assertEqual(_CLIP_RULE_CALLERS - found, set())

    def test_no_inline_copy_of_the_rules(self):
        found = [path for path, source in _sources() if path != "tfdp/validation.py"
                 for text in ("l2_norm_clip` must be", "l2_norm_clip must be",
                              "noise_multiplier` must be", "noise_multiplier must be")
                 if text in source]
        self.assertEqual(found, [], "use tfdp.validation's rule (through DPSGDConfig)")

    def test_the_checks_see_a_call(self):
        self.assertEqual(_calls("x = tfdp.DPSGD(1.0, 1.0)\ny = DPSGD(2.0)", "DPSGD"), [1, 2])
        self.assertEqual(_calls("m = DPSGD.from_config(c)", "DPSGD"), [])
        self.assertEqual(_from_config_calls(
            "a = DPSGD.from_config(c)\nb = m.DPSGD.from_config(c)\nc = Dense.from_config(d)"),
            [1, 2])


if __name__ == "__main__":
    unittest.main()
