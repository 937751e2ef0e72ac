-- One run by its id (the primary key), with the GiB and family columns of v_runs.
SELECT * FROM v_runs WHERE run_id = ?;
