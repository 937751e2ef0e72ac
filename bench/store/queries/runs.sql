-- Runs for the app's tables and for export, newest first.
-- bench/store/db.py:fetch_runs replaces the /*filters*/ marker with `AND <column> = ?` / `AND <column> IN (?, ...)`
-- terms for whitelisted column names only (db.FILTER_COLUMNS); every value is a bound parameter.
-- The last parameter is the row limit (NULL = all rows).
SELECT *
FROM v_runs
WHERE TRUE /*filters*/
ORDER BY created_at DESC, run_id
LIMIT ?;
