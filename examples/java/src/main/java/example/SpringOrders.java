package example;

import java.math.BigDecimal;
import java.sql.SQLException;
import java.util.ArrayList;
import java.util.List;
import javax.sql.DataSource;
import org.springframework.context.annotation.Bean;
import org.springframework.context.annotation.Configuration;
import org.springframework.dao.DataAccessException;
import org.springframework.jdbc.core.JdbcTemplate;
import org.springframework.jdbc.support.JdbcTransactionManager;
import org.springframework.transaction.PlatformTransactionManager;
import org.springframework.transaction.annotation.EnableTransactionManagement;
import org.springframework.transaction.annotation.Propagation;
import org.springframework.transaction.annotation.Transactional;

/** The same business transaction in a Spring {@code @Transactional} service. */
public final class SpringOrders {
    private SpringOrders() {}

    /** plain spring-context + spring-jdbc: a DataSource bean is registered by the caller. */
    @Configuration
    @EnableTransactionManagement
    public static class Config {
        @Bean
        public PlatformTransactionManager transactionManager(DataSource ds) {
            return new JdbcTransactionManager(ds); // a DataSourceTransactionManager
        }

        @Bean
        public JdbcTemplate jdbcTemplate(DataSource ds) {
            return new JdbcTemplate(ds);
        }

        @Bean
        public Outbox outbox(JdbcTemplate jdbc) {
            return new Outbox(jdbc);
        }

        @Bean
        public OrderService orderService(JdbcTemplate jdbc, Outbox outbox) {
            return new OrderService(jdbc, outbox);
        }
    }

    /** Enqueues events in the caller's transaction (MANDATORY: never on its own). */
    public static class Outbox {
        private final JdbcTemplate jdbc;

        public Outbox(JdbcTemplate jdbc) {
            this.jdbc = jdbc;
        }

        @Transactional(propagation = Propagation.MANDATORY)
        public long enqueue(String topic, String payloadJson, String key, String eventType) {
            return jdbc.queryForObject(
                    "SELECT outbox_enqueue(topic => ?, payload => ?::jsonb, key => ?, event_type => ?)",
                    Long.class, topic, payloadJson, key, eventType);
        }

        /** In a savepoint (NESTED): a failure rolls back this call only, not the caller's work. */
        @Transactional(propagation = Propagation.NESTED)
        public long enqueueInSavepoint(String topic, String payloadJson, String key, String eventType) {
            return enqueue(topic, payloadJson, key, eventType);
        }
    }

    public static class OrderService {
        private final JdbcTemplate jdbc;
        private final Outbox outbox;

        public OrderService(JdbcTemplate jdbc, Outbox outbox) {
            this.jdbc = jdbc;
            this.outbox = outbox;
        }

        /** One order and its event; commits together, or rolls back together on an exception. */
        @Transactional
        public long placeOrder(String topic, String orderNo, String customer, BigDecimal total) {
            Long orderId = jdbc.queryForObject(JdbcOrders.INSERT_ORDER, Long.class, orderNo, customer, total);
            // The payload is JSON text here: use your JSON library (Jackson's writeValueAsString)
            // for anything that is not a plain number or a fixed-alphabet string.
            String payload = String.format(
                    "{\"order_id\": %d, \"order_no\": \"%s\", \"customer\": \"%s\", \"total\": %s}",
                    orderId, orderNo, customer, total.toPlainString());
            return outbox.enqueue(topic, payload, orderNo, "OrderCreated");
        }

        /** Several orders and their events in one transaction (calls within a bean join it). */
        @Transactional
        public List<Long> placeOrders(String topic, List<String> orderNos, String customer, BigDecimal total) {
            List<Long> ids = new ArrayList<>();
            for (String orderNo : orderNos) {
                ids.add(placeOrder(topic, orderNo, customer, total));
            }
            return ids;
        }

        /** placeOrder, then a failure: Spring rolls the order and its event back. */
        @Transactional
        public long placeOrderThenFail(String topic, String orderNo, String customer, BigDecimal total) {
            placeOrder(topic, orderNo, customer, total);
            throw new IllegalStateException("payment declined");
        }

        /**
         * placeOrder plus a bad enqueue in a savepoint; returns the bad call's SQLSTATE, and the
         * order and its good event still commit.
         */
        @Transactional
        public long placeOrderWithBadCall(String topic, String orderNo, String[] sqlstate) {
            long id = placeOrder(topic, orderNo, "erin", new BigDecimal("7.50"));
            try {
                outbox.enqueueInSavepoint("not a topic!", "{}", orderNo, "OrderCreated");
            } catch (DataAccessException e) {
                // Spring wraps the driver's exception: the SQLSTATE is on the SQLException inside.
                if (e.getMostSpecificCause() instanceof SQLException sql && "22023".equals(sql.getSQLState())) {
                    sqlstate[0] = sql.getSQLState();
                    System.out.println("invalid sqlstate=" + sql.getSQLState() + " via=spring message="
                            + sql.getMessage().lines().findFirst().orElse(""));
                } else {
                    throw e;
                }
            }
            return id;
        }
    }
}
