"""The run's decisions about checkpoints, above the checkpoint package ``ckpt/`` (which owns the
files, one save and one load: :mod:`ckpt.io`): what a resume may change and which save dir may
be written (:mod:`recipes.checkpoint.policy`), and ``checkpoint.load=auto`` with the requeue
default (:mod:`recipes.checkpoint.auto`). Both read the run's config."""
