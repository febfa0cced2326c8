// Orders and their outbox events in one transaction, with pgx v5.
//
// Usage: go run . [DATABASE_URL]
//
//	DATABASE_URL  postgres:// URL or key=value string (argument, else $DATABASE_URL)
//	$OUTBOX_TOPIC topic of the events (default: orders)
//	$RUN_ID       makes the order numbers unique per run (default: a random one)
//
// Prints one line per outcome (committed / rolled_back / invalid) and a final `done` line.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

const enqueueSQL = `SELECT outbox_enqueue(topic => $1, payload => $2, key => $3, event_type => $4)`

const schemaSQL = `
CREATE TABLE IF NOT EXISTS orders (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  order_no text NOT NULL UNIQUE,
  customer text NOT NULL,
  total numeric(10,2) NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
)`

var errDeclined = errors.New("payment declined")

// placeOrder inserts the business row and its event in the caller's transaction.
func placeOrder(ctx context.Context, tx pgx.Tx, topic, orderNo, customer, total string) (int64, error) {
	var orderID int64
	err := tx.QueryRow(ctx,
		`INSERT INTO orders (order_no, customer, total) VALUES ($1, $2, $3) RETURNING id`,
		orderNo, customer, total).Scan(&orderID)
	if err != nil {
		return 0, err
	}
	payload := map[string]any{"order_id": orderID, "order_no": orderNo, "customer": customer, "total": total}
	var outboxID int64
	err = tx.QueryRow(ctx, enqueueSQL, topic, payload, orderNo, "OrderCreated").Scan(&outboxID)
	return outboxID, err
}

func main() {
	ctx := context.Background()
	url := os.Getenv("DATABASE_URL")
	if len(os.Args) > 1 {
		url = os.Args[1]
	}
	if url == "" {
		log.Fatal("usage: go run . DATABASE_URL (or set $DATABASE_URL)")
	}
	topic := os.Getenv("OUTBOX_TOPIC")
	if topic == "" {
		topic = "orders"
	}
	run := os.Getenv("RUN_ID")
	if run == "" {
		b := make([]byte, 6)
		_, _ = rand.Read(b)
		run = hex.EncodeToString(b)
	}

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, schemaSQL); err != nil {
		log.Fatal(err)
	}
	committed := 0
	invalidSQLState := "none"

	// 1. One order, one event; a bad call in a savepoint (a nested pgx.Tx) does not spoil the
	// transaction.
	key1 := fmt.Sprintf("go-%s-1", run)
	var id1 int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if id1, err = placeOrder(ctx, tx, topic, key1, "alice", "19.90"); err != nil {
			return err
		}
		err = pgx.BeginFunc(ctx, tx, func(sp pgx.Tx) error { // SAVEPOINT ... RELEASE / ROLLBACK TO
			_, err := sp.Exec(ctx, enqueueSQL, "not a topic!", map[string]any{}, key1, "OrderCreated")
			return err
		})
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "22023" { // invalid_parameter_value
			invalidSQLState = pgErr.Code
			fmt.Printf("invalid sqlstate=%s message=%s\n", pgErr.Code, pgErr.Message)
			return nil
		}
		return err
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("committed key=%s outbox_id=%d\n", key1, id1)
	committed++

	// 2. A batch: several orders and their events, one transaction, one commit.
	type placed struct {
		key string
		id  int64
	}
	var batch []placed
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		batch = batch[:0]
		for n, customer := range []string{"bob", "carol", "dave"} {
			key := fmt.Sprintf("go-%s-%d", run, n+2)
			id, err := placeOrder(ctx, tx, topic, key, customer, fmt.Sprint((n+2)*10))
			if err != nil {
				return err
			}
			batch = append(batch, placed{key, id})
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, p := range batch {
		fmt.Printf("committed key=%s outbox_id=%d\n", p.key, p.id)
		committed++
	}

	// 3. Rolled back: neither the order nor its event exists afterwards.
	keyRb := fmt.Sprintf("go-%s-rolled-back", run)
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := placeOrder(ctx, tx, topic, keyRb, "mallory", "999.99"); err != nil {
			return err
		}
		return errDeclined // BeginFunc rolls back on any error
	})
	if !errors.Is(err, errDeclined) {
		log.Fatalf("expected the declined payment, got %v", err)
	}
	fmt.Printf("rolled_back key=%s\n", keyRb)

	fmt.Printf("done committed=%d rolled_back=1 invalid_sqlstate=%s\n", committed, invalidSQLState)
}
