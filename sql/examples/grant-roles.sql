-- The privilege recipe (docs/reference.md, "Privileges"). Run it as the extension's owner, in
-- the database that has the extension, naming three existing roles:
--
--   psql -d orders -v producer=app_writer -v relay=outbox_relay -v admin=outbox_admin \
--        -f sql/examples/grant-roles.sql
--
-- producer: may only enqueue (no reading payloads, no claiming).
-- relay:    claims, acks, nacks, renews, releases, beats, reclaims, waits for commits and reads
--           stats.
-- admin:    everything the relay may, plus dead letters, blocked keys, relays, requeue, skip and
--           purge, and the inbox's stats and purge.
-- consumer: optional (-v consumer=loyalty): a role named like the consumer, which may accept into
--           and read its own inbox only (docs/inbox.md); GRANT it to the consuming service's role.
-- Assumes the extension lives in schema public; otherwise replace public below.
GRANT USAGE ON SCHEMA public TO :"producer", :"relay", :"admin";

GRANT EXECUTE ON FUNCTION
    public.outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz),
    public.outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz)
TO :"producer";

GRANT EXECUTE ON FUNCTION
    public.outbox_claim(text, int),
    public.outbox_ack(text, bigint, bigint[]),
    public.outbox_ack_returning(text, bigint, bigint[]),
    public.outbox_nack(text, bigint, bigint[], text),
    public.outbox_nack_returning(text, bigint, bigint[], text),
    public.outbox_renew(text, bigint, bigint[]),
    public.outbox_release(text, bigint, bigint[], interval, text),
    public.outbox_release_orphans(text, bigint[]),
    public.outbox_heartbeat(text, interval, timestamptz),
    public.outbox_reclaim(interval),
    public.outbox_reclaim_returning(interval),
    public.outbox_stats(),
    public.outbox_wait(interval),
    public.outbox_wake_mode()
TO :"relay";

GRANT :"relay" TO :"admin";
GRANT EXECUTE ON FUNCTION
    public.outbox_dead_letters(int, bigint),
    public.outbox_blocked_keys(int),
    public.outbox_owners(int),
    public.outbox_requeue(bigint[]),
    public.outbox_skip(bigint[]),
    public.outbox_purge(interval, int),
    public.outbox_inbox_purge(interval, int),
    public.outbox_inbox_stats()
TO :"admin";

\if :{?consumer}
GRANT USAGE ON SCHEMA public TO :"consumer";
-- The accept runs as its caller: the inbox's row-level policy keeps each role to its own rows.
GRANT SELECT, INSERT ON TABLE public.outbox_inbox TO :"consumer";
GRANT EXECUTE ON FUNCTION public.outbox_inbox_accept(text, uuid) TO :"consumer";
\endif
