"""Tessera node plugin: kubelet device plugin, GPU discovery and health, per-container config.

Run it with ``python -m nodeplugin``; every setting comes from the environment
(see ``docs/nodeplugin.md`` and :mod:`nodeplugin.config`).
"""

__version__ = "0.1.0"
