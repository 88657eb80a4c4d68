"""The run's config and its checks, before any process starts: the typed schemas (``schema.py``),
the process grid (``parallel_dims.py``), validation (``validate.py``, its ``ConfigError`` in
``errors.py``), the pre-launch checks (``prelaunch.py``) and refusals (``refusal.py``)."""
