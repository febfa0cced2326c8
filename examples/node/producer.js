// Orders and their outbox events in one transaction, with node-postgres (pg).
//
// Usage: node producer.js [DATABASE_URL]
//   DATABASE_URL  postgresql:// URL (argument, else $DATABASE_URL)
//   $OUTBOX_TOPIC topic of the events (default: orders)
//   $RUN_ID       makes the order numbers unique per run (default: a random one)
//
// Prints one line per outcome (committed / rolled_back / invalid) and a final `done` line.
import { randomUUID } from 'node:crypto';
import pg from 'pg';

const ENQUEUE =
  'SELECT outbox_enqueue(topic => $1, payload => $2, key => $3, event_type => $4) AS outbox_id';

const SCHEMA = `
CREATE TABLE IF NOT EXISTS orders (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  order_no text NOT NULL UNIQUE,
  customer text NOT NULL,
  total numeric(10,2) NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
)`;

// The business row and its event, on the caller's client (inside its transaction).
async function placeOrder(client, topic, orderNo, customer, total) {
  const { rows } = await client.query(
    'INSERT INTO orders (order_no, customer, total) VALUES ($1, $2, $3) RETURNING id',
    [orderNo, customer, total],
  );
  const orderId = rows[0].id; // bigint arrives as a string: exact, never rounded
  const payload = { order_id: orderId, order_no: orderNo, customer, total };
  const res = await client.query(ENQUEUE, [topic, payload, orderNo, 'OrderCreated']);
  return res.rows[0].outbox_id;
}

// BEGIN / COMMIT on one pooled client, ROLLBACK on any error, the client always released.
async function inTransaction(pool, work) {
  const client = await pool.connect();
  try {
    await client.query('BEGIN');
    const result = await work(client);
    await client.query('COMMIT');
    return result;
  } catch (e) {
    await client.query('ROLLBACK');
    throw e;
  } finally {
    client.release();
  }
}

async function main() {
  const connectionString = process.argv[2] ?? process.env.DATABASE_URL;
  if (!connectionString) {
    console.error('usage: node producer.js DATABASE_URL (or set $DATABASE_URL)');
    process.exit(2);
  }
  const topic = process.env.OUTBOX_TOPIC ?? 'orders';
  const run = process.env.RUN_ID || randomUUID().replaceAll('-', '').slice(0, 12);
  const pool = new pg.Pool({ connectionString, max: 2 });
  let committed = 0;
  let invalidSqlstate = null;

  try {
    await pool.query(SCHEMA);

    // 1. One order, one event; a bad call in a savepoint does not spoil the transaction.
    const key1 = `node-${run}-1`;
    const id1 = await inTransaction(pool, async (client) => {
      const id = await placeOrder(client, topic, key1, 'alice', '19.90');
      await client.query('SAVEPOINT bad_call');
      try {
        await client.query(ENQUEUE, ['not a topic!', {}, key1, 'OrderCreated']);
        await client.query('RELEASE SAVEPOINT bad_call');
      } catch (e) {
        if (e.code !== '22023') throw e; // invalid_parameter_value
        await client.query('ROLLBACK TO SAVEPOINT bad_call');
        invalidSqlstate = e.code;
        console.log(`invalid sqlstate=${e.code} message=${e.message}`);
      }
      return id;
    });
    console.log(`committed key=${key1} outbox_id=${id1}`);
    committed++;

    // 2. A batch: several orders and their events, one transaction, one commit.
    const batch = await inTransaction(pool, async (client) => {
      const out = [];
      for (const [n, customer] of [[2, 'bob'], [3, 'carol'], [4, 'dave']]) {
        const key = `node-${run}-${n}`;
        out.push([key, await placeOrder(client, topic, key, customer, String(n * 10))]);
      }
      return out;
    });
    for (const [key, id] of batch) {
      console.log(`committed key=${key} outbox_id=${id}`);
      committed++;
    }

    // 3. Rolled back: neither the order nor its event exists afterwards.
    const keyRb = `node-${run}-rolled-back`;
    try {
      await inTransaction(pool, async (client) => {
        await placeOrder(client, topic, keyRb, 'mallory', '999.99');
        throw new Error('payment declined');
      });
    } catch (e) {
      if (e.message !== 'payment declined') throw e;
      console.log(`rolled_back key=${keyRb}`);
    }
  } finally {
    await pool.end();
  }
  console.log(`done committed=${committed} rolled_back=1 invalid_sqlstate=${invalidSqlstate}`);
}

await main();
