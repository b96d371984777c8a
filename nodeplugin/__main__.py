"""``python -m nodeplugin``: run the Tessera node plugin (settings: docs/nodeplugin.md)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from nodeplugin import __version__, config
from nodeplugin.app import Plugin, configure_logging
from nodeplugin.nvml import NvmlError


async def _main(settings: config.Settings) -> None:
    plugin = Plugin(settings)
    await plugin.run()


def main() -> int:
    if sys.argv[1:] == ["--version"]:
        revision = os.environ.get("TESSERA_REVISION", "unknown")
        print(f"tessera-nodeplugin {__version__} (revision {revision})")
        return 0
    configure_logging()
    try:
        settings = config.load()
    except config.ConfigError as exc:
        print(f"tessera-nodeplugin: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_main(settings))
    except NvmlError as exc:
        logging.getLogger("nodeplugin").error("%s", exc)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
