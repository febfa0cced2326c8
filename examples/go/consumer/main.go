// Command consumer reads the outbox's topic with franz-go and applies each event's effect exactly
// once: the event's id in the inbox and the customer's loyalty points commit in one pgx
// transaction, and only then is the record's offset committed (docs/inbox.md).
//
//	go run ./consumer DATABASE_URL [BOOTSTRAP_SERVERS]
//
// DATABASE_URL is the consumer's database (with the outbox extension and loyalty_points);
// BOOTSTRAP_SERVERS the argument, else $BOOTSTRAP_SERVERS (default 127.0.0.1:9092). Environment:
// OUTBOX_TOPIC (default orders), CONSUMER_NAME (the inbox's consumer, a role the database user is
// a member of; default loyalty), CONSUMER_GROUP (default: a new one, read from the start),
// CONSUMER_INSTANCE (group.instance.id: a restart takes its partitions back at once),
// IDLE_SECONDS (stop after this long without a record, default 5; at most 60 s for the first),
// EXIT_AFTER_COMMITS (fault injection: SIGKILL itself after that many database commits, before
// the offset commit). Prints `applied` or `duplicate` per record, then a `done` line.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"
)

// apply is the effect: PostgreSQL reads the event's JSON payload itself.
const apply = `INSERT INTO loyalty_points (customer, points)
SELECT e->>'customer', (e->>'points')::bigint FROM (SELECT $1::jsonb AS e) event
ON CONFLICT (customer) DO UPDATE SET points = loyalty_points.points + EXCLUDED.points`

func env(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}

func header(r *kgo.Record, name string) string {
	for _, h := range r.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}

// handle records the event in the inbox and, the first time only, applies it: one transaction.
func handle(ctx context.Context, pool *pgxpool.Pool, consumer string, r *kgo.Record) (bool, error) {
	var fresh bool
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, "SELECT outbox_inbox_accept($1, $2::uuid)",
			consumer, header(r, "event_id")).Scan(&fresh); err != nil {
			return err
		}
		if !fresh {
			return nil
		}
		_, err := tx.Exec(ctx, apply, string(r.Value))
		return err
	})
	return fresh, err
}

func main() {
	if len(os.Args) < 2 {
		log.Fatal("usage: consumer DATABASE_URL [BOOTSTRAP_SERVERS]")
	}
	servers := env("BOOTSTRAP_SERVERS", "127.0.0.1:9092")
	if len(os.Args) > 2 {
		servers = os.Args[2]
	}
	consumer := env("CONSUMER_NAME", "loyalty")
	idleSecs, _ := strconv.ParseFloat(env("IDLE_SECONDS", "5"), 64)
	idle := time.Duration(idleSecs * float64(time.Second))
	exitAfter, _ := strconv.Atoi(env("EXIT_AFTER_COMMITS", "0"))

	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	opts := []kgo.Opt{
		kgo.SeedBrokers(strings.Split(servers, ",")...),
		kgo.ConsumerGroup(env("CONSUMER_GROUP", fmt.Sprintf("outbox-example-%d", time.Now().UnixNano()))),
		kgo.ConsumeTopics(env("OUTBOX_TOPIC", "orders")),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.DisableAutoCommit(), // the offset is committed after the database commit
	}
	if instance := os.Getenv("CONSUMER_INSTANCE"); instance != "" {
		opts = append(opts, kgo.InstanceID(instance))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		log.Fatal(err)
	}
	defer cl.Close()

	messages, applied, duplicates := 0, 0, 0
	start, last := time.Now(), time.Time{} // the idle clock starts with the first record
	for (last.IsZero() && time.Since(start) < 60*time.Second) || (!last.IsZero() && time.Since(last) < idle) {
		pollCtx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		fetches := cl.PollFetches(pollCtx)
		cancel()
		fetches.EachError(func(topic string, p int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) {
				log.Fatalf("fetch %s/%d: %v", topic, p, err)
			}
		})
		for _, r := range fetches.Records() {
			last = time.Now()
			messages++
			fresh, err := handle(ctx, pool, consumer, r)
			if err != nil {
				log.Fatal(err)
			}
			if fresh {
				applied++
				fmt.Printf("applied key=%s event_id=%s\n", r.Key, header(r, "event_id"))
			} else {
				duplicates++
				fmt.Printf("duplicate key=%s event_id=%s\n", r.Key, header(r, "event_id"))
			}
			if messages == exitAfter {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			}
			// A crash before this line redelivers the record; the inbox makes it a no-op.
			if err := cl.CommitRecords(ctx, r); err != nil {
				log.Fatal(err)
			}
		}
	}
	fmt.Printf("done messages=%d applied=%d duplicates=%d\n", messages, applied, duplicates)
}
