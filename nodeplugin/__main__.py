"""``python -m nodeplugin``: run the Tessera node plugin (settings: docs/nodeplugin.md)."""

from __future__ import annotations

import asyncio
import logging
import sys

from nodeplugin import config
from nodeplugin.app import Plugin, configure_logging
from nodeplugin.nvml import NvmlError


async def _main(settings: config.Settings) -> None:
    plugin = Plugin(settings)
    await plugin.run()


def main() -> int:
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
