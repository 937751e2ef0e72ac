-- The shared dataset (bench/share/): which remote contribution files `python -m bench pull` brought in, and which
-- runs each file carried, so every pulled row says where it came from. A file is recorded in the same transaction
-- as its rows: recorded means pulled whole.
CREATE TABLE pulls (
    dataset   VARCHAR   NOT NULL,  -- the dataset URL pulled from (WILLITFIT_DATASET or --dataset)
    file      VARCHAR   NOT NULL,  -- contributions/<utc-timestamp>-<sha256 prefix>.parquet
    sha256    VARCHAR   NOT NULL,  -- of the file's bytes, checked against its manifest
    pulled_at TIMESTAMP NOT NULL,  -- UTC
    rows      BIGINT    NOT NULL CHECK (rows >= 0),      -- rows in the file
    inserted  BIGINT    NOT NULL CHECK (inserted >= 0),  -- of those, new to this database
    PRIMARY KEY (dataset, file)
);
CREATE TABLE pulled_runs (
    dataset VARCHAR NOT NULL,
    file    VARCHAR NOT NULL,
    run_id  VARCHAR NOT NULL,      -- runs.run_id (stored once, whichever file brought it first)
    PRIMARY KEY (dataset, file, run_id)
);
