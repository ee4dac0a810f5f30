"""The layering rule: lower packages never import from higher ones."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlearn"
# Higher number = higher layer. Shared modules (config, errors, ...) are layer 0 and may be used by any.
LAYERS = {"wire": 1, "transport": 2, "algorithms": 3, "aggregation": 3, "config": 4, "node": 4, "sim": 5, "adapter": 5,
          "network": 5, "cli": 6}
SHARED = {"errors": 0, "settings": 0, "clock": 0, "lazy": 0, "flat": 0, "netem": 0, "metrics": 0, "runlog": 0, "topology": 0, "data": 0, "models": 0}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "meshlearn" or len(parts) < 2:
        return None
    return LAYERS.get(parts[1], SHARED.get(parts[1]))


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    own = ".".join(("meshlearn",) + path.relative_to(SRC).with_suffix("").parts)
    own_layer = _layer(own)
    if own_layer is None:
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            layer = _layer(name)
            if layer is not None and own_layer in SHARED.values() and own.split(".")[1] in SHARED:
                assert layer == 0, f"{own} (shared) imports {name} from a layer"
            elif layer is not None:
                assert layer <= own_layer, f"{own} (layer {own_layer}) imports {name} (layer {layer})"
