-- Index sizes and the plans of both hot paths on outbox_event; included by indexes.sql once per
-- index design.
SELECT indexrelid::regclass AS index, pg_size_pretty(pg_relation_size(indexrelid)) AS size
FROM pg_index WHERE indrelid = 'outbox_event'::regclass ORDER BY 1;
\echo '#### Claim candidates'
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF)
SELECT id FROM outbox_event
WHERE status = 'WAIT' AND next_retry_time <= now()
ORDER BY next_retry_time, id LIMIT 100 FOR UPDATE SKIP LOCKED;
\echo '#### Expired leases'
EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF)
SELECT id FROM outbox_event WHERE status = 'SENDING' AND claimed_at < now() - interval '10 minutes';
