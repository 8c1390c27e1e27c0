BEGIN;
SELECT plan(3);
SELECT has_schema('queen');
SELECT has_table('queen', 'timers', 'timers table exists');
SELECT results_eq('SELECT version FROM queen.schema_migrations ORDER BY 1', ARRAY[1, 2, 3, 4, 5, 6, 7, 9], 'every migration is recorded');
SELECT * FROM finish();
ROLLBACK;
