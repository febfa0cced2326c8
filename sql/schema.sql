-- Data model of the outbox (docs/reference.md, "Data model"). Every object carries the outbox_
-- prefix and lives in the extension's schema.

CREATE TYPE @extschema@.outbox_status AS ENUM ('WAIT', 'SENDING', 'SUCCESS', 'FAIL');

-- Plain sequences (not identity columns) so pg_extension_config_dump can register them: a restored
-- database must keep issuing ids and fencing tokens above the ones it already holds.
CREATE SEQUENCE @extschema@.outbox_event_id_seq AS bigint;
CREATE SEQUENCE @extschema@.outbox_claim_token_seq AS bigint;

CREATE TABLE @extschema@.outbox_event (
    id              bigint PRIMARY KEY DEFAULT nextval('@extschema@.outbox_event_id_seq'),
    topic           text NOT NULL,
    event_key       text,
    event_type      text,
    payload         jsonb NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}',
    status          @extschema@.outbox_status NOT NULL,
    retry_count     int NOT NULL DEFAULT 0,
    next_retry_time timestamptz NOT NULL,
    claim_owner     text,
    claim_token     bigint,
    claimed_at      timestamptz,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    -- The event's global identity, sent as the event_id header: consumers dedupe on it. The
    -- bigint id is only this table's key; a restore, a sequence reset or a second database
    -- publishing to the same topic reissues ids, never UUIDs. Last column: 0.1.0 tables get it
    -- by ALTER TABLE ADD COLUMN, and both must have the same row type.
    event_id        uuid NOT NULL DEFAULT @extschema@.outbox_uuidv7(),
    -- Whether the event keeps its key's order (a key, and a topic not in outbox.unordered_topics),
    -- decided at enqueue. Ordered events are claimed through outbox_key, the rest directly.
    ordered         boolean NOT NULL DEFAULT false,
    -- An operator skipped this dead letter (outbox_skip): it no longer holds its key.
    skipped_at      timestamptz
) WITH (
    -- A queue table churns: vacuum and analyze it long before the default 20 % of dead rows.
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    -- Half of each page stays free for the versions a claim and an ack write: on the same page
    -- the WAL logs only their changed bytes, not the payload again, and no extra lock record for
    -- a version that moves (docs/reference.md, "Life-cycle cost"). Last: 0.5.0 -> 0.6.0 appends it.
    fillfactor = 50
);
ALTER SEQUENCE @extschema@.outbox_event_id_seq OWNED BY @extschema@.outbox_event.id;

-- Hot path 1: due unordered WAIT rows, oldest next_retry_time first (outbox_claim). Partial, so
-- its size follows the backlog, not the history of SUCCESS rows. See docs/INDEXES.md.
CREATE INDEX outbox_event_wait_due_idx
    ON @extschema@.outbox_event (next_retry_time, id) WHERE status = 'WAIT' AND NOT ordered;
-- Hot path 1, ordered: a key's unfinished events in commit (= id) order; its first entry is the
-- key's head. Claim cost follows the keys it visits, not a hot key's backlog.
CREATE INDEX outbox_event_key_pending_idx
    ON @extschema@.outbox_event (topic, event_key, id) WHERE ordered AND status <> 'SUCCESS';
-- Hot path 2: leases by age (outbox_reclaim, outbox_stats).
CREATE INDEX outbox_event_sending_claimed_idx
    ON @extschema@.outbox_event (claimed_at) WHERE status = 'SENDING';
-- Dead letters for operators (outbox_dead_letters, outbox_stats); FAIL rows are few.
CREATE INDEX outbox_event_fail_idx
    ON @extschema@.outbox_event (id) WHERE status = 'FAIL';

-- Purge: delivered rows by age, so a purge reads the rows it deletes, not the whole history.
CREATE INDEX outbox_event_success_updated_idx
    ON @extschema@.outbox_event (updated_at) WHERE status = 'SUCCESS';

-- One row per key that may have work for a claim (docs/reference.md, "Per-key order"): created by
-- the first enqueue of an idle key, deleted by a claim once the key has nothing unfinished. due_at
-- is when a claim should look at the key's head next: its enqueue time, the end of a run's lease
-- while a relay holds the key, the head's backoff, 'infinity' while a dead head blocks the key,
-- '-infinity' once the key looked idle (deleted by the same claim when no producer is in flight).
CREATE TABLE @extschema@.outbox_key (
    topic     text NOT NULL,
    event_key text NOT NULL,
    due_at    timestamptz NOT NULL,
    PRIMARY KEY (topic, event_key)
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02
);
CREATE INDEX outbox_key_due_idx ON @extschema@.outbox_key (due_at);

-- pg_dump must carry the outbox: a restored order database still owes its unpublished events.
-- Only tables of an extension are configuration tables, and only while CREATE EXTENSION runs: the
-- SQL-only build (scripts/sql-only) runs this file as a plain script, where its tables are
-- ordinary tables that pg_dump dumps anyway, and the call would fail.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
                WHERE d.classid = 'pg_catalog.pg_class'::pg_catalog.regclass
                  AND d.objid = '@extschema@.outbox_event'::pg_catalog.regclass AND d.deptype = 'e') THEN
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_event', '');
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_event_id_seq', '');
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_key', '');
        PERFORM pg_catalog.pg_extension_config_dump('@extschema@.outbox_claim_token_seq', '');
    END IF;
END
$$;
