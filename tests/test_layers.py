"""The layers contract covers the whole control plane: no module escapes it by being unlisted."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_control_plane_module_is_in_the_layers_contract() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")
    listed = {m.strip() for layer in layers["layers"] for m in re.split(r"[|:]", layer)}
    package = ROOT / "controlplane"
    present = {
        f"controlplane.{p.stem}"
        for p in package.iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    assert present == listed, (
        f"not in the layers contract: {sorted(present - listed)}; "
        f"listed but absent: {sorted(listed - present)}"
    )
