"""``train.dry_run=true``: check a whole config for its world size and say what each rank holds.

Nothing heavy is built and no process starts: the config is validated (``recipes.config.prelaunch``),
megatron's ``TransformerConfig`` is constructed (its own checks run), and the sizes come from
``recipes.model.shapes``. What a rank holds is counted in :mod:`recipes.dry_run.sizes`, what a save and a load write,
read and hold in host memory in :mod:`recipes.dry_run.host`; the printed
report, and what would make a config fit, is :mod:`recipes.dry_run.text`. Only
``recipes.run.launch`` (for ``train.dry_run=true``) imports this package: the run itself does not.
"""

from recipes.dry_run.host import HostSizes, host_sizes
from recipes.dry_run.text import assumed_line, fit_line, report
from recipes.dry_run.sizes import (RankSizes, activation_bytes, attention_scores_stored,
                                   rank_sizes, target_attention)

__all__ = ["HostSizes", "RankSizes", "activation_bytes", "assumed_line", "attention_scores_stored",
           "fit_line", "host_sizes", "rank_sizes", "report", "target_attention"]
