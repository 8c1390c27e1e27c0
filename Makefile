# queen-timers. `make help` lists the targets.
.DEFAULT_GOAL := help
SHELL := /bin/bash

.PHONY: help run test bench bench-peers install stop-db psql extension install-extension

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

run:  ## one broker on :6632 over the embedded cluster in .queen/ (or QUEEN_DATABASE_URL); names the cluster
	@scripts/run

test:  ## install what is missing, throwaway cluster, pg_prove + pytest
	@scripts/test $(PYTEST_ARGS)

bench:  ## benchmarks and fault drills (bench/), results printed and in bench/out/
	@bench/run $(BENCH_ARGS)

bench-peers:  ## queen-timers beside graphile-worker, pg-boss, procrastinate, PgQueuer (installs them into bench/peers/.install)
	@bench/peers/run $(BENCH_ARGS)

install:  ## the venv and the Debian test tools, nothing else
	@scripts/install-deps

stop-db:  ## stop this checkout's embedded cluster (.queen/pg), saying which
	@scripts/stop-db

psql:  ## psql into the queen database (QUEEN_DATABASE_URL, or this checkout's embedded cluster)
	@scripts/psql


extension:  ## generate the PostgreSQL extension and the plain psql install file from sql/ into extension/
	@scripts/make-extension extension

install-extension: extension  ## copy extension/ into `pg_config --sharedir`/extension (CREATE EXTENSION queen_timers)
	@dir="$$(pg_config --sharedir)/extension"; install -m 644 extension/queen_timers.control extension/queen_timers--*.sql "$$dir"/ && echo "installed queen_timers $$(sed -n "s/^default_version = '\(.*\)'/\1/p" extension/queen_timers.control) into $$dir"
