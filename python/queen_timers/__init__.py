"""queen-timers: a PostgreSQL-centric timer engine with a Queen MQ-compatible log."""

__version__ = "0.1.0"
