-- Versions already applied to this database.
SELECT version FROM schema_migrations ORDER BY version;
