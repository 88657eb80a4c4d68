"""``python -m gtp``: see :mod:`gtp.cli`."""

from gtp.cli import main

# Guarded: megatron's checkpoint writer starts a multiprocessing manager with the "spawn"
# method, whose child re-imports this module as __mp_main__.
if __name__ == "__main__":
    raise SystemExit(main())
