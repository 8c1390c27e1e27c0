BEGIN;
SELECT plan(3);
SELECT has_schema('queen');
SELECT has_table('queen', 'timers', 'timers table exists');
SELECT results_eq('SELECT version FROM queen.schema_migrations WHERE version <= 2 ORDER BY 1', ARRAY[1, 2], 'migrations 1 and 2 are recorded');
SELECT * FROM finish();
ROLLBACK;
