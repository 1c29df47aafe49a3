"""Saving and restoring a pytree with Orbax, as the interop tests do it."""
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


def save(path: Path, tree: Any) -> None:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()


def restore(path: Path, target: Any) -> Any:
    """``target`` gives the structure, shapes and dtypes (typed PRNG keys included)."""
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(path, target)
