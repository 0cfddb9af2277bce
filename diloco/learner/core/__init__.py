"""The learner's pure core: schedules and the per-fragment sync bookkeeping."""
