-- The published tier is rebuilt whole from data/published/points.csv (bench/published/importer.py import_published): its
-- old rows go in the same transaction as the new ones arrive.
DELETE FROM runs WHERE source = 'published';
