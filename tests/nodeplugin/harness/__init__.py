"""A stand-in kubelet, GPU driver and control plane for the node plugin's tests.

- :mod:`.gpu`: builds the fake ``libnvidia-ml.so.1`` (``fake_nvml.c``) with gcc and drives it
  (cards, lost cards, injected XIDs).
- :mod:`.kubelet`: the kubelet's side over real unix sockets: Registration and PodResources
  servers, and a device manager that calls the plugin in the kubelet's order.
- :mod:`.controlplane`: the two REST endpoints of docs/allocation.md, the inventory endpoint of
  DESIGN §7 and a pod GET of the API server, on loopback.
- :mod:`.dra`: the kubelet's DRA side (plugin watcher on the registry directory, the
  ``DRAPlugin`` client) and the API server's ResourceClaims and ResourceSlices, for DRA mode.
- :mod:`.jsonhttp`: the JSON-over-HTTP base of the fake servers.
- :mod:`.plugin`: runs ``python -m nodeplugin`` as a subprocess against all of the above.
"""
