BEGIN;
SELECT plan(3);
SELECT has_schema('queen');
SELECT has_table('queen', 'timers', 'timers table exists');
SELECT results_eq('SELECT version FROM queen.schema_migrations ORDER BY 1', ARRAY[1, 3], 'at migrations 1 and 3 (input_limits)');
SELECT * FROM finish();
ROLLBACK;
