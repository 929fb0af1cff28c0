"""Reusable parts of the trainer (`tfdp.train`): evaluation, reporting, resume."""
