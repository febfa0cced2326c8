-- Nothing is granted to PUBLIC (docs/reference.md, "Privileges"): PostgreSQL grants EXECUTE on new
-- functions to PUBLIC by default, so take it back from every function of the extension.
-- sql/examples/grant-roles.sql is the GRANT recipe for producer, relay and admin roles.
REVOKE ALL ON TABLE @extschema@.outbox_event, @extschema@.outbox_key FROM PUBLIC;
REVOKE ALL ON SEQUENCE @extschema@.outbox_event_id_seq, @extschema@.outbox_claim_token_seq FROM PUBLIC;
REVOKE ALL ON FUNCTION
    @extschema@.outbox_config(),
    @extschema@.outbox_max_payload_bytes(),
    @extschema@.outbox_notify_enabled(),
    @extschema@.outbox_check_topic(text),
    @extschema@.outbox_topic_ordered(text),
    @extschema@.outbox_key_lock_id(text, text),
    @extschema@.outbox_uuidv7(),
    @extschema@.outbox_check_isolation(text),
    @extschema@.outbox_check_owner(text, text),
    @extschema@.outbox_check_ids(text, bigint[]),
    @extschema@.outbox_check_claim_args(text, text, bigint, bigint[]),
    @extschema@.outbox_enqueue(text, jsonb, text, text, jsonb, timestamptz),
    @extschema@.outbox_enqueue_begin(text, text),
    @extschema@.outbox_enqueue_many(text, jsonb[], text[], text[], jsonb[], timestamptz),
    @extschema@.outbox_work_due(),
    @extschema@.outbox_wait(interval),
    @extschema@.outbox_wait_for(bigint, oid),
    @extschema@.outbox_wake_mode(),
    @extschema@.outbox_claim(text, int),
    @extschema@.outbox_ack(text, bigint, bigint[]),
    @extschema@.outbox_status_after_failure(int, int),
    @extschema@.outbox_nack_returning(text, bigint, bigint[], text),
    @extschema@.outbox_nack(text, bigint, bigint[], text),
    @extschema@.outbox_renew(text, bigint, bigint[]),
    @extschema@.outbox_release(text, bigint, bigint[], interval, text),
    @extschema@.outbox_reclaim_returning(interval),
    @extschema@.outbox_reclaim(interval),
    @extschema@.outbox_requeue(bigint[]),
    @extschema@.outbox_purge(interval, int),
    @extschema@.outbox_dead_letters(int, bigint),
    @extschema@.outbox_blocked_keys(int),
    @extschema@.outbox_skip(bigint[]),
    @extschema@.outbox_stats()
FROM PUBLIC;
