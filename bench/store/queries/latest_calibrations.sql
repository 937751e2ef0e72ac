-- The newest calibration per (architecture, attention, checkpointing); $architecture NULL = all.
SELECT *
FROM v_latest_calibration
WHERE CAST($architecture AS VARCHAR) IS NULL OR architecture = $architecture
ORDER BY architecture, attention NULLS FIRST, checkpointing NULLS FIRST;
