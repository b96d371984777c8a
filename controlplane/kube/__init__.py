"""Kubernetes, in one app: the adapter (`adapter.get_kube`), a real API server (`real`), the
embedded stand-in with its models (`embedded`, `models`) and the reconciler's cluster sources
(`sources`). Nothing else in the control plane talks to an API server."""
