-- How many training runs without OOM match the calibration filters (see app_calibration_runs.sql).
SELECT count(*) AS n_runs
FROM runs
WHERE mode = 'train' AND NOT oom /*filters*/;
