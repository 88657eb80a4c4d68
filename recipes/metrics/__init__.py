"""What a run reports: per-iteration metrics (``logger.py``), the console (``console.py``), FLOPs
and memory (``throughput.py``) and MoE tokens per expert (``experts.py``)."""
