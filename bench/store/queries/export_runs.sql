-- Every column of `runs` (nothing derived, so the output can be ingested again), in a stable order.
-- bench/store/ingest.py:export replaces /*filters*/ with whitelisted `AND <column> = ?` terms; values are bound.
SELECT *
FROM runs
WHERE TRUE /*filters*/
ORDER BY run_id;
