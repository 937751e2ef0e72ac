-- Training runs without OOM that a calibration of one family may use, selected as
-- bench.accuracy.calibrate.collect_points selects them, but at most ? of them: the ones whose run_id hashes lowest,
-- a pseudo-random sample that is the same every time for the same rows (all of them when there are fewer).
-- Parameters: the filter values that bench/store/app_data.py puts in place of /*filters*/ (bench.store.db.filter_clause),
-- then the sample size. The sample is chosen on run_id alone, then joined back (cheap at millions of rows).
WITH chosen AS (
    SELECT run_id
    FROM runs
    WHERE mode = 'train' AND NOT oom /*filters*/
    ORDER BY hash(run_id), run_id
    LIMIT ?
)
SELECT r.*
FROM runs AS r
JOIN chosen USING (run_id)
ORDER BY hash(r.run_id), r.run_id;
