BEGIN;
SELECT plan(3);
SELECT has_schema('queen');
SELECT has_table('queen', 'timers', 'timers table exists');
SELECT results_eq('SELECT version FROM queen.schema_migrations', ARRAY[1, 5], 'at migration 5 (log retention)');
SELECT * FROM finish();
ROLLBACK;
