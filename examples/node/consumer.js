// Reads the outbox's topic with KafkaJS and applies each event's effect exactly once: the event's
// id in the inbox and the customer's loyalty points commit in one PostgreSQL transaction, and only
// then is the message's offset committed (docs/inbox.md).
//
// Usage: node consumer.js DATABASE_URL [BOOTSTRAP_SERVERS]
//   DATABASE_URL        the consumer's database (with the outbox extension and loyalty_points)
//   BOOTSTRAP_SERVERS   argument, else $BOOTSTRAP_SERVERS (default: 127.0.0.1:9092)
//   $OUTBOX_TOPIC       topic to read (default: orders)
//   $CONSUMER_NAME      the inbox's consumer, a role the database user is a member of (default: loyalty)
//   $CONSUMER_GROUP     consumer group (default: a new one, so the topic is read from the start)
//   $IDLE_SECONDS       stop after this long without a message (default: 5; the wait for the
//                       first message, while the consumer joins its group, is at most 60 s)
//   $EXIT_AFTER_COMMITS fault injection: SIGKILL itself after that many database commits, before
//                       the offset commit (the restarted consumer gets that message again)
//
// Prints `applied` or `duplicate` per message, then a final `done` line.
import { randomUUID } from 'node:crypto';
import { Kafka, logLevel } from 'kafkajs';
import pg from 'pg';

// The effect: PostgreSQL reads the event's JSON payload itself.
const APPLY = `INSERT INTO loyalty_points (customer, points)
SELECT e->>'customer', (e->>'points')::bigint FROM (SELECT $1::jsonb AS e) event
ON CONFLICT (customer) DO UPDATE SET points = loyalty_points.points + EXCLUDED.points`;

// The inbox says whether the event is new; only then the effect; both in one transaction.
async function handle(db, consumerName, eventId, value) {
  await db.query('BEGIN');
  try {
    const { rows } = await db.query('SELECT outbox_inbox_accept($1, $2::uuid) AS fresh', [
      consumerName,
      eventId,
    ]);
    if (rows[0].fresh) {
      await db.query(APPLY, [value]);
    }
    await db.query('COMMIT');
    return rows[0].fresh;
  } catch (e) {
    await db.query('ROLLBACK');
    throw e;
  }
}

async function main() {
  const [url, brokersArg] = process.argv.slice(2);
  if (!url) {
    console.error('usage: node consumer.js DATABASE_URL [BOOTSTRAP_SERVERS]');
    process.exit(2);
  }
  const env = (name, fallback) => process.env[name] || fallback;
  const brokers = (brokersArg || env('BOOTSTRAP_SERVERS', '127.0.0.1:9092')).split(',');
  const topic = env('OUTBOX_TOPIC', 'orders');
  const consumerName = env('CONSUMER_NAME', 'loyalty');
  const idleMs = Number(env('IDLE_SECONDS', '5')) * 1000;
  const exitAfter = Number(env('EXIT_AFTER_COMMITS', '0'));

  const db = new pg.Client({ connectionString: url });
  await db.connect();
  const kafka = new Kafka({ clientId: 'outbox-example', brokers, logLevel: logLevel.NOTHING });
  // KafkaJS has no static membership: a short session timeout hands a dead member's partitions
  // to its restarted successor after 6 s (the broker's minimum) instead of 30.
  const consumer = kafka.consumer({
    groupId: env('CONSUMER_GROUP', `outbox-example-${randomUUID().slice(0, 8)}`),
    sessionTimeout: 6000,
    heartbeatInterval: 1000,
  });
  await consumer.connect();
  await consumer.subscribe({ topic, fromBeginning: true });

  let messages = 0;
  let applied = 0;
  let duplicates = 0;
  const start = Date.now();
  let last = 0; // the idle clock starts with the first message: joining the group takes a while
  await consumer.run({
    autoCommit: false, // the offset is committed after the database commit
    eachMessage: async ({ partition, message }) => {
      last = Date.now();
      messages += 1;
      const header = (name) => message.headers[name]?.toString();
      const eventId = header('event_id');
      const key = message.key?.toString() ?? '';
      if (await handle(db, consumerName, eventId, message.value.toString())) {
        applied += 1;
        console.log(`applied key=${key} event_id=${eventId}`);
      } else {
        duplicates += 1;
        console.log(`duplicate key=${key} event_id=${eventId}`);
      }
      if (messages === exitAfter) {
        process.kill(process.pid, 'SIGKILL');
      }
      // A crash before this line redelivers the message; the inbox makes it a no-op.
      const next = (BigInt(message.offset) + 1n).toString();
      await consumer.commitOffsets([{ topic, partition, offset: next }]);
    },
  });
  for (;;) {
    await new Promise((resolve) => setTimeout(resolve, 200));
    if (last ? Date.now() - last >= idleMs : Date.now() - start >= 60000) break;
  }
  await consumer.disconnect();
  await db.end();
  console.log(`done messages=${messages} applied=${applied} duplicates=${duplicates}`);
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
