"""The package layering: imports between tfdp's packages go one way.

Reads every module's imports with `ast` (nothing is imported, so this runs
in well under a second):
- the graph of tfdp's packages (`tfdp.dp`, `tfdp.models`, the top-level
  modules such as `tfdp.mechanism`, ...) has no cycle, counting imports
  inside functions too;
- an import of a tfdp module inside a function says why it is there: a
  comment naming TensorFlow (the only reason for one is to keep TensorFlow
  out of a command that does not need it, e.g. `--help` or the privacy CLI)
  on its line or among the imports and comments just above it.

docs/ARCHITECTURE.md lists the packages from top to bottom.
"""

import ast
import functools
import pathlib
import unittest

_ROOT = pathlib.Path(__file__).resolve().parent.parent / "tfdp"

# Upward imports allowed by name: (importing module, imported module). None.
_ALLOWED_UPWARD = set()


def _module_name(path):
    parts = list(path.relative_to(_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_name(p): p for p in sorted(_ROOT.rglob("*.py"))}


def package_of(module):
    """`tfdp.dp.rules.conv` -> `tfdp.dp`; `tfdp.mechanism` -> `tfdp.mechanism`."""
    return ".".join(module.split(".")[:2])


def _imports(tree, module):
    """Yields (imported tfdp module, node, inside a function) for each tfdp import."""
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def in_function(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # Relative: resolved against this module's package.
                anchor = module.split(".")[: len(module.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == "tfdp" or name.startswith("tfdp."):
                yield name, node, in_function(node)


def _says_why(lines, node):
    """Whether a comment naming TensorFlow is on the import's line or just above it."""
    if "TensorFlow" in lines[node.lineno - 1]:
        return True
    for line in reversed(lines[: node.lineno - 1]):
        stripped = line.strip()
        if stripped.startswith("#"):
            if "TensorFlow" in stripped:
                return True
            continue
        if not stripped or stripped.startswith(("import ", "from ")):
            continue
        return False
    return False


@functools.lru_cache(maxsize=None)
def _scan():
    edges = {}  # (package, package) -> where
    unexplained = []
    for module, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for imported, node, in_function in _imports(ast.parse(source), module):
            where = f"{path.relative_to(_ROOT.parent)}:{node.lineno} imports {imported}"
            if in_function and not _says_why(lines, node):
                unexplained.append(where)
            if any(module == m and imported.startswith(i) for m, i in _ALLOWED_UPWARD):
                continue
            a, b = package_of(module), package_of(imported)
            if a != b and b != "tfdp":
                edges.setdefault((a, b), where)
    return edges, unexplained


def _find_cycle(edges):
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    state = {}  # node -> "open" | "done"
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


class LayeringTest(unittest.TestCase):
    def test_no_cycle_between_packages(self):
        edges, _ = _scan()
        cycle = _find_cycle(edges)
        if cycle:
            hops = [edges[(a, b)] for a, b in zip(cycle, cycle[1:])]
            self.fail("import cycle between packages: " + " -> ".join(cycle)
                      + "\n  " + "\n  ".join(hops))

    def test_function_level_imports_say_why(self):
        _, unexplained = _scan()
        self.assertEqual(
            unexplained, [],
            "an import of a tfdp module inside a function is only for keeping TensorFlow "
            "out of a command that does not need it; import at the top, or say so in a "
            "comment naming TensorFlow just above the import",
        )

    def test_the_checks_see_a_cycle(self):
        edges = {("tfdp.models", "tfdp.dp"): "", ("tfdp.dp", "tfdp.models"): ""}
        self.assertEqual(_find_cycle(edges), ["tfdp.dp", "tfdp.models", "tfdp.dp"])
        self.assertIsNone(_find_cycle({("tfdp.models", "tfdp.dp"): ""}))

    def test_the_documented_order(self):
        # docs/ARCHITECTURE.md lists every package, and each imports only
        # packages listed below it.
        doc = (_ROOT.parent / "docs" / "ARCHITECTURE.md").read_text()
        order = [line.split("`")[1] for line in doc.splitlines()
                 if line.startswith("- `tfdp.")]
        packages = {package_of(m) for m in _modules()} - {"tfdp"}
        self.assertEqual(sorted(order), sorted(packages))
        rank = {name: i for i, name in enumerate(order)}
        edges, _ = _scan()
        # `tfdp` itself (its lazy loader) sits above every package.
        upward = [where for (a, b), where in edges.items()
                  if a != "tfdp" and rank[a] >= rank[b]]
        self.assertEqual(upward, [], "a package imports one listed above it in ARCHITECTURE.md")


if __name__ == "__main__":
    unittest.main()
