-- Index comparison for the two hot paths (issue 2): the seed's composite indexes against the
-- partial ones the extension ships, on 1M SUCCESS rows + 10k WAIT rows (+ 1k SENDING).
-- Run by sql/bench/indexes.sh, which writes docs/INDEXES.md.
\set ON_ERROR_STOP 1
\pset pager off
SET client_min_messages = warning;

-- History first (as in a live table: old rows settled), the backlog at the end.
INSERT INTO outbox_event (topic, payload, status, next_retry_time, created_at, updated_at,
                          claim_owner, claim_token, claimed_at)
SELECT 'orders', jsonb_build_object('n', g), 'SUCCESS',
       now() - interval '2 days' + g * interval '100 ms', now() - interval '2 days', now() - interval '1 day',
       'relay', g, now() - interval '1 day'
FROM generate_series(1, 1000000) g;
INSERT INTO outbox_event (topic, payload, status, next_retry_time, claim_owner, claim_token, claimed_at)
SELECT 'orders', jsonb_build_object('n', g), 'SENDING', now() - interval '1 hour', 'relay', g,
       now() - (g % 20) * interval '1 minute'
FROM generate_series(1, 1000) g;
-- Half of the backlog is due, half is delayed (backoff or deliver_at).
INSERT INTO outbox_event (topic, payload, status, next_retry_time)
SELECT 'orders', jsonb_build_object('n', g), 'WAIT', now() + (g - 5000) * interval '1 second'
FROM generate_series(1, 10000) g;
VACUUM ANALYZE outbox_event;

\echo '### Partial indexes (shipped)'
\ir hot-paths.sql

DROP INDEX outbox_event_wait_due_idx, outbox_event_sending_claimed_idx;
CREATE INDEX seed_status_next_retry_idx ON outbox_event (status, next_retry_time);
CREATE INDEX seed_status_claimed_idx ON outbox_event (status, claimed_at);
ANALYZE outbox_event;

\echo '### Composite indexes (seed design)'
\ir hot-paths.sql
