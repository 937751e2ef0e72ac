-- run_ids of stored rows from one source (`python -m bench trace` skips cases already traced).
SELECT run_id FROM runs WHERE source = ?;
