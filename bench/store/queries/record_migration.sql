-- Mark one migration applied; runs inside the migration's own transaction.
INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?);
