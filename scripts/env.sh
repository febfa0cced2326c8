# Sourced by the scripts in this folder: one place for paths and versions.
# shellcheck shell=bash
PGRX_VERSION=0.18.1
PG_MAJOR=15
PG_CONFIG=/usr/lib/postgresql/$PG_MAJOR/bin/pg_config
# Tools installed once per machine and reused by every checkout and CI run.
OUTBOX_TOOLS=${OUTBOX_TOOLS:-/opt/outbox-tools}
# The local broker: Apache Kafka from Maven Central (scripts/broker install), run on the system
# Java 17 (tests/src/kafka.rs reads KAFKA_VERSION from this file too).
KAFKA_VERSION=4.4.0
KAFKA_LOG4J_VERSION=2.25.5
export KAFKA_HOME=${KAFKA_HOME:-$OUTBOX_TOOLS/kafka-$KAFKA_VERSION}
# The NATS sink's server: nats-server built from its Go module (scripts/nats install);
# tests/src/nats.rs reads NATS_SERVER_VERSION from this file too.
NATS_SERVER_VERSION=v2.15.3
export NATS_SERVER_HOME=${NATS_SERVER_HOME:-$OUTBOX_TOOLS/nats-server-$NATS_SERVER_VERSION}
# The RocketMQ sink's broker: Apache RocketMQ from Maven Central (scripts/rocketmq install), run on
# the system Java 17; tests/src/rocketmq.rs reads ROCKETMQ_VERSION from this file too.
ROCKETMQ_VERSION=5.3.3
export ROCKETMQ_HOME=${ROCKETMQ_HOME:-$OUTBOX_TOOLS/rocketmq-$ROCKETMQ_VERSION}
# One build cache per machine, shared by every clone: CI runs in a fresh clone each time and a
# cold build of librdkafka + pgrx takes most of the CI budget.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/outbox/target}
export PATH=$HOME/.cargo/bin:$OUTBOX_TOOLS/bin:$PATH
# The project's own PostgreSQL cluster, created and started by scripts/pg-start: the machine's
# other clusters are never touched. Its port is chosen free when it is created (or when another
# program took it); empty until then. OUTBOX_PG_CLUSTER names another cluster of this machine
# for the scripts to act on (a second checkout's, a benchmark's).
OUTBOX_PG_CLUSTER=${OUTBOX_PG_CLUSTER:-outbox}
PGPORT=$(pg_conftool -s "$PG_MAJOR" "$OUTBOX_PG_CLUSTER" show port 2>/dev/null || true)
export PGHOST=127.0.0.1 PGPORT PGUSER=postgres
# The cargo profile the relay and outbox-bench are built with: `release` (thin LTO, what the package
# ships); scripts/test uses `integration`, the test binaries' profile, so that a relay change is
# compiled once instead of twice.
export OUTBOX_PROFILE=${OUTBOX_PROFILE:-release}
# The relay binary, found the same way by the tests and outbox-bench (tests/src/relay.rs). Not
# exported: a caller that changes CARGO_TARGET_DIR after sourcing this file still gets its own.
OUTBOX_RELAY_BIN=${OUTBOX_RELAY_BIN:-$CARGO_TARGET_DIR/$OUTBOX_PROFILE/outbox-worker}

# Seconds since the outermost script started, in every step's line: where a cold run spends its time.
export OUTBOX_STARTED_AT=${OUTBOX_STARTED_AT:-$(date +%s)}
log() { printf '\033[1m==> [%4ss] %s\033[0m\n' "$(($(date +%s) - OUTBOX_STARTED_AT))" "$*" >&2; }

# Whether something listens on 127.0.0.1:PORT.
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A free loopback port below the ephemeral range.
free_port() {
  local p
  for _ in $(seq 1 100); do
    p=$((20000 + RANDOM % 12000))
    port_open "$p" || { echo "$p"; return 0; }
  done
  echo "no free port found on 127.0.0.1" >&2
  return 1
}
