package example;

import java.math.BigDecimal;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.SQLException;
import java.sql.Savepoint;
import java.sql.Statement;
import java.util.List;
import java.util.UUID;
import javax.sql.DataSource;
import org.postgresql.ds.PGSimpleDataSource;
import org.springframework.context.annotation.AnnotationConfigApplicationContext;

/**
 * Orders and their outbox events in one transaction: first with plain JDBC, then through a Spring
 * {@code @Transactional} service.
 *
 * <pre>
 * java -cp 'target/classes:target/lib/*' example.Producer [DATABASE_URL]
 *   DATABASE_URL   jdbc:postgresql://... or postgresql://user@host:port/db (argument, else $DATABASE_URL)
 *   $OUTBOX_TOPIC  topic of the events (default: orders)
 *   $RUN_ID        makes the order numbers unique per run (default: a random one)
 * </pre>
 *
 * Prints one line per outcome (committed / rolled_back / invalid) and a final {@code done} line.
 */
public final class Producer {
    private Producer() {}

    public static void main(String[] args) throws Exception {
        String url = Db.jdbcUrl(Db.arg(args, 0, "DATABASE_URL",
                "usage: example.Producer DATABASE_URL (or set $DATABASE_URL)"));
        String topic = Db.env("OUTBOX_TOPIC", "orders");
        String run = Db.env("RUN_ID", UUID.randomUUID().toString().replace("-", "").substring(0, 12));
        int committed = 0;
        String invalidJdbc = "none";

        try (Connection c = DriverManager.getConnection(url)) {
            try (Statement st = c.createStatement()) {
                st.execute(JdbcOrders.SCHEMA);
            }
            c.setAutoCommit(false); // from here on: explicit transactions

            // 1. One order, one event; a bad call in a savepoint does not spoil the transaction.
            String key1 = "java-" + run + "-jdbc-1";
            long id1 = JdbcOrders.placeOrder(c, topic, key1, "alice", new BigDecimal("19.90"));
            Savepoint sp = c.setSavepoint();
            try {
                JdbcOrders.placeOrder(c, "not a topic!", key1 + "-bad", "alice", BigDecimal.ONE);
                c.releaseSavepoint(sp);
            } catch (SQLException e) {
                if (!"22023".equals(e.getSQLState())) { // invalid_parameter_value
                    throw e;
                }
                c.rollback(sp); // undoes the bad call only (and its order row)
                invalidJdbc = e.getSQLState();
                System.out.println("invalid sqlstate=" + e.getSQLState() + " via=jdbc message="
                        + e.getMessage().lines().findFirst().orElse(""));
            }
            c.commit();
            System.out.println("committed key=" + key1 + " outbox_id=" + id1);
            committed++;

            // 2. A batch: several orders and their events, one transaction, one commit.
            String[][] batch = {{"2", "bob"}, {"3", "carol"}, {"4", "dave"}};
            long[] ids = new long[batch.length];
            try {
                for (int i = 0; i < batch.length; i++) {
                    ids[i] = JdbcOrders.placeOrder(c, topic, "java-" + run + "-jdbc-" + batch[i][0],
                            batch[i][1], new BigDecimal(batch[i][0] + "0"));
                }
                c.commit();
            } catch (SQLException e) {
                c.rollback();
                throw e;
            }
            for (int i = 0; i < batch.length; i++) {
                System.out.println("committed key=java-" + run + "-jdbc-" + batch[i][0] + " outbox_id=" + ids[i]);
                committed++;
            }

            // 3. Rolled back: neither the order nor its event exists afterwards.
            String keyRb = "java-" + run + "-jdbc-rolled-back";
            JdbcOrders.placeOrder(c, topic, keyRb, "mallory", new BigDecimal("999.99"));
            c.rollback();
            System.out.println("rolled_back key=" + keyRb);
        }

        // The same through Spring: @Transactional methods of a service bean.
        PGSimpleDataSource ds = new PGSimpleDataSource();
        ds.setURL(url);
        String[] invalidSpring = {"none"};
        try (var ctx = new AnnotationConfigApplicationContext()) {
            ctx.registerBean(DataSource.class, () -> ds);
            ctx.register(SpringOrders.Config.class);
            ctx.refresh();
            SpringOrders.OrderService orders = ctx.getBean(SpringOrders.OrderService.class);

            String key1 = "java-" + run + "-spring-1";
            long id1 = orders.placeOrderWithBadCall(topic, key1, invalidSpring);
            System.out.println("committed key=" + key1 + " outbox_id=" + id1);
            committed++;

            List<String> keys = List.of("java-" + run + "-spring-2", "java-" + run + "-spring-3");
            List<Long> ids = orders.placeOrders(topic, keys, "frank", new BigDecimal("12.00"));
            for (int i = 0; i < keys.size(); i++) {
                System.out.println("committed key=" + keys.get(i) + " outbox_id=" + ids.get(i));
                committed++;
            }

            String keyRb = "java-" + run + "-spring-rolled-back";
            try {
                orders.placeOrderThenFail(topic, keyRb, "mallory", new BigDecimal("999.99"));
            } catch (IllegalStateException e) {
                System.out.println("rolled_back key=" + keyRb);
            }
        }

        String invalid = invalidJdbc.equals(invalidSpring[0]) ? invalidJdbc : invalidJdbc + "," + invalidSpring[0];
        System.out.println("done committed=" + committed + " rolled_back=2 invalid_sqlstate=" + invalid);
    }
}
