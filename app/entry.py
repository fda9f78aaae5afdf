"""The ``semantic`` command's entry point (``python -m app`` too).

``semantic serve`` starts itself again with huge pages for its large buffers where the
machine gives them on request (``app.huge_pages``). Tunables are read when a process starts,
so it does so first, before the command line's modules are imported (pydantic and the
settings, which the new process would import again).
"""

from __future__ import annotations

import sys


def main() -> int:
    if sys.argv[1:2] == ["serve"]:  # the command has no options before it (`semantic -h`, `-V`)
        from app.huge_pages import start_with_huge_pages

        start_with_huge_pages()  # returns where it does not start the process again
    from app.cli import main as cli_main

    return cli_main()
