"""The embedded demo (DESIGN §7): simulated GPU nodes and a living workload that goes through
the real extender endpoints, against the embedded Kubernetes stand-in. It drives every other
part of the control plane, so it sits above them all."""
