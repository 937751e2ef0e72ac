-- Delete the stored traced rows that the registered Arrow table `incoming_runs` replaces (same run_id): a
-- re-trace after the tracer changed (`python -m bench ingest --replace`, `build-db --retrace`). Runs in the
-- same transaction as insert_runs, so the database holds either the old rows or the new ones. Measured and
-- published rows are never replaced: they are facts, not derived. Returns the number of rows deleted.
DELETE FROM runs AS r
WHERE r.source = 'traced'
  AND r.run_id IN (SELECT i.run_id FROM incoming_runs AS i WHERE i.source = 'traced');
