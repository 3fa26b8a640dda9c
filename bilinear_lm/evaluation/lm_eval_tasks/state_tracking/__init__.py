"""The state-tracking probes as zero-shot lm-eval tasks (``--tasks state_tracking_probes``)."""
