"""`kubectl tessera`: the control plane's REST API from a shell (docs/kubectl-plugin.md).

Runs on a laptop with only the package's dependencies: it imports neither Django nor any other
part of the control plane (an import-linter contract in pyproject.toml holds it to that), and
speaks to the control plane over HTTP like any other client of the API.
"""
