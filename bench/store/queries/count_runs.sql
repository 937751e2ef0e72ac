-- Number of stored runs.
SELECT count(*) AS n_runs FROM runs;
