BEGIN;
SELECT plan(3);
SELECT has_schema('queen');
SELECT has_table('queen', 'timers', 'timers table exists');
SELECT results_eq('SELECT version FROM queen.schema_migrations WHERE version IN (1, 4) ORDER BY 1', ARRAY[1, 4], 'migrations 1 and 4 (cancel_fast) are recorded');
SELECT * FROM finish();
ROLLBACK;
