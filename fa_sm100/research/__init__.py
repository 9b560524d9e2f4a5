"""Research tools over the protocol model's timing mode: role timelines and the switch ablation.

Everything here is MODEL OUTPUT unless it says it measured: no SM100 GPU ran any of it.

- ``timeline``       the ``Timeline`` data (per-role busy/wait intervals) and its text rendering;
- ``model_backend``  the adapter from ``pipelines.timing`` (the timing mode) and
                     ``pipelines.timing_bwd`` (the backward's) to timelines, and to tile
                     times for the ablation;
- ``plotting``       matplotlib (Agg) figures: per-role Gantt charts side by side;
- ``ablation``       the matrix of switches, whole-problem time from tile times, the
                     calibration against the published FA4 B200 figure, sweeps, and the
                     measuring path for SM100 hardware;
- ``timeline_cli``, ``ablation_cli``  the command lines behind scripts/timeline.py and
                     scripts/ablation.py;
- ``figures``        the figures of docs/ (``python -m fa_sm100.research.figures``).
"""
