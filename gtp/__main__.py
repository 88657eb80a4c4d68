"""``python -m gtp``: the checkpoint command line (:mod:`ckpt.cli`) with gtp-recipes' model
families (importing :mod:`recipes.families` gives them to ``ckpt/``).

An entry point that no module imports: the one module of ``gtp/`` allowed to import the packages
above it (``tests/test_import_graph.py`` names it), so that ``python -m gtp`` keeps its name.
"""

import recipes.families  # noqa: F401 - gives ckpt/ the model families the commands read
from ckpt.cli import main

# Guarded: megatron's checkpoint writer starts a multiprocessing manager with the "spawn"
# method, whose child re-imports this module as __mp_main__.
if __name__ == "__main__":
    raise SystemExit(main())
