-- =====================================================================
-- Part 99: a database built from this schema is at the latest migration.
-- Add a row here with every new file in sql/migrations/.
-- =====================================================================
INSERT INTO queen.schema_migrations (version, name) VALUES
    (1, 'initial'),
    (2, 'log_tenancy'),
    (3, 'timer_stats'),
    (4, 'input_limits'),
    (5, 'log_retention'),
    (6, 'cancel_fast'),
    (7, 'pending_deltas'),
    (8, 'log_order'),
    (9, 'fire_path'),
    (10, 'schedule_path'),
    (11, 'fire_no_subxact'),
    (12, 'resume_wakes'),
    (13, 'staged_payloads'),
    (14, 'pop_bytes'),
    (15, 'stats_pages'),
    (16, 'dlq_bytes'),
    (17, 'schedule_notify'),
    (18, 'fire_fair_share'),
    (19, 'tenant_next_due'),
    (20, 'schedule_plain_insert'),
    (21, 'quota_lookup'),
    (22, 'fire_many_due'),
    (23, 'fire_turn'),
    (24, 'fold_hashed'),
    (25, 'fire_plan_settings'),
    (26, 'pop_bounded'),
    (27, 'consumer_plans'),
    (28, 'required_leases'),
    (29, 'extend_lease_index');
