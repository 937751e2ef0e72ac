-- Insert validated rows from the registered Arrow table `incoming_runs`, skipping any run_id already
-- stored (run_id is the dedupe key; duplicates inside one file are removed before this runs).
-- Returns the number of rows inserted.
INSERT INTO runs BY NAME
SELECT i.*
FROM incoming_runs AS i
WHERE NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.run_id = i.run_id);
