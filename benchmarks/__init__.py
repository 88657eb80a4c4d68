"""Benchmarks: ``python -m benchmarks`` (``make bench``) runs every entry of
:data:`benchmarks.__main__.BENCHMARKS`; each is also runnable alone, e.g.
``python -m benchmarks.train_speed --help``. They print figures and write JSON; they assert no
thresholds and are not part of pytest.
"""
