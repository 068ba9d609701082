"""Step and run reports: ``report.json``, ``report.md`` (:mod:`.write`) and PNG plots (:mod:`.plots`)."""
