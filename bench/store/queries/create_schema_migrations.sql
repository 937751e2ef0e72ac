-- The migrations ledger: one row per applied bench/store/migrations/NNN_name.sql (see bench/store/db.py:migrate).
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    INTEGER   PRIMARY KEY,  -- NNN of the migration file
    name       VARCHAR   NOT NULL,     -- the rest of its file name, e.g. 'init'
    applied_at TIMESTAMP NOT NULL      -- UTC
);
