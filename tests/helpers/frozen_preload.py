"""Imported last by the test forkserver (``multiproc.PRELOAD``): moves every object the preload
built out of reach of Python's cyclic garbage collector, as a training process does
(``recipes.run.worker.freeze_imported_objects``), so that each rank forked from the server starts
with them frozen: the full collections between layouts (``multiproc.reset_model_parallel``) and
megatron's own (``DistributedOptimizer.sharded_state_dict``) then walk only what the test built."""

from recipes.run.worker import freeze_imported_objects

freeze_imported_objects()
