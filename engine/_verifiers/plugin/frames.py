"""Where in its own code a plugin failed: the frames of a traceback that are in files of its environment directory.

Shared by the engine's process (thread and loop plugins) and a plugin's worker processes (which send the frames
with the failure), so a failure names the same file and line under every executor.
"""

from __future__ import annotations

import collections
import linecache
import os
import traceback

__all__ = ["MAX_FRAMES", "own_frames", "where"]

MAX_FRAMES = 5  # the innermost of a plugin's frames kept: a deep recursion's thousand would say no more


def own_frames(exc: BaseException, root: str) -> tuple[traceback.FrameSummary, ...]:
    """The frames of ``exc``'s traceback in files under ``root`` (the environment directory), innermost last.

    At most :data:`MAX_FRAMES` (the innermost), each file named by its absolute path and with its source
    line as the module was imported (the importer puts the vetted snapshot's lines in ``linecache``). The
    engine's frames and a library's (the plugin's call into ``json``, say) are left out: the innermost
    frame is the plugin's own line that raised, or called what raised.

    Args:
        exc: What the plugin raised, with its traceback.
        root: The environment directory.

    Returns:
        The frames, innermost last; none if no frame of the traceback is in the directory.
    """
    inside = os.path.join(os.path.abspath(root), "")
    kept: collections.deque[tuple[str, int, str]] = collections.deque(maxlen=MAX_FRAMES)
    for frame, line in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        # "<string>", "<frozen ...>": no file, though abspath would put one in the working directory
        if not filename.startswith("<") and os.path.abspath(filename).startswith(inside):
            kept.append((filename, line, frame.f_code.co_name))
    return tuple(
        traceback.FrameSummary(
            os.path.abspath(filename), line, name, lookup_line=False, line=linecache.getline(filename, line).strip()
        )
        for filename, line, name in kept
    )


def where(frame: traceback.FrameSummary, root: str) -> str:
    """``helper.py:12, in parse``: a frame's file (relative to the environment directory ``root``), line and
    function, as a failure's reason ends with it."""
    return f"{os.path.relpath(frame.filename, os.path.abspath(root))}:{frame.lineno}, in {frame.name}"
