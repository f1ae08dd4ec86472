"""Pipeline parallelism in global view (GPipe, circular, 1F1B, interleaved 1F1B): schedules as tables
(schedules.py), the forward loop (forward.py), the loops that own their backward (one_f_one_b.py), the
residuals they keep (residuals.py), and what they share (common.py)."""
from .forward import pipeline
from .grad import pipeline_value_and_grad

__all__ = ["pipeline", "pipeline_value_and_grad"]
