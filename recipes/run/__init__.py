"""The run's processes and signals: from a composed config to running workers (``launch.py``,
the launchers' environment ``rank_env.py``), one worker (``worker.py``), the train loop
(``loop.py``) and its optimizer (``optim.py``), pretrained weights at start (``pretrained.py``) and
an exit with a save (``preemption.py``)."""
